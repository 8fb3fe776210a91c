"""The README followed from top to bottom as a newcomer would, offline: the shell blocks that
write the example inputs and run esmc-mlx on the packaged esmc-tiny, and every Python block, in
the order the README gives them (one namespace for the Python, as in one session). Blocks that
install, reach the Hub, validate against torch (`make demo`, which CI runs) or publish are left
out, each block whole; so is a Python block that loads a model, SAE or adapter this offline run
has not made."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
LOADED = re.compile(r'\bload\w*\("([^"]+)"')
OFFLINE_COMMANDS = ("--version", "info", "embed", "score", "scan", "features", "fold")
PACKAGED = ("tiny",)  # what load() and load_sae() read from the package itself, offline


def readme_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def runs_here(line: str) -> bool:
    """A shell line this test may run: one writing the example inputs, or esmc-mlx on the
    packaged model without validation."""
    words = line.split()
    if not words:
        return False
    if words[0] == "printf":
        return True
    if words[0] == "esmc-convert":
        return (words[1] == "tiny" and "--no-validate" in words) or words[1] == "tiny-fold"
    return words[0] == "esmc-mlx" and words[1] in OFFLINE_COMMANDS


def loads_only_local(body: str, here: Path) -> bool:
    """Whether every `load...("name")` in a Python block names something already in `here`, or
    packaged with esmc-mlx."""
    return all(name in PACKAGED or (here / name).exists() for name in LOADED.findall(body))


def shell_lines(lang: str, body: str) -> list[str]:
    """The lines of a shell block this test runs: all of them, or none when one may not run."""
    lines = [x for x in body.splitlines() if x.strip() and not x.lstrip().startswith("#")]
    return lines if lang == "bash" and all(runs_here(x) for x in lines) else []


def test_the_selection_finds_the_readmes_offline_lines():
    lines = [x for lang, body in readme_blocks() for x in shell_lines(lang, body)]
    firsts = {" ".join(x.split()[:2]) for x in lines}
    assert {"esmc-convert tiny", "esmc-mlx info", "esmc-mlx embed", "esmc-mlx score", "esmc-mlx scan"} <= firsts
    assert "esmc-mlx features" in firsts  # on the packaged SAE
    assert {"esmc-convert tiny-fold", "esmc-mlx fold"} <= firsts
    assert sum(lang == "python" for lang, _ in readme_blocks()) >= 3
    assert not runs_here("esmc-convert 6B --q mxfp4 --upload-repo my-org/ESMC-6B-mxfp4")
    assert not runs_here("esmc-convert tiny -o esmc-tiny-4bit --q 4 --force")  # validates: needs torch
    assert not runs_here("esmc-mlx push esmc-tiny-4bit my-org/esmc-tiny-4bit --dry-run")


@pytest.mark.slow  # converts, embeds, scores and scans: tens of seconds on the 2-core host
def test_the_readme_runs_from_top_to_bottom(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the README's scan draws a heatmap (the plot extra)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    printed = {}
    ran: list[str] = []
    for lang, body in readme_blocks():
        if lang == "python":
            if loads_only_local(body, tmp_path):
                ran.append(body)
                exec(compile(body, "README.md", "exec"), namespace)
            continue
        for line in shell_lines(lang, body):
            done = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
            assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
            printed[line.split()[1]] = done.stdout
    for command in ("embed", "score", "scan"):  # each says what it wrote and how long it took
        assert re.search(r"\d+\.\d s", printed[command]), printed[command]
    assert (tmp_path / "dms.scored.csv").read_text().startswith("mutant,masked_marginal,wt_marginal\n")
    assert (tmp_path / "scan" / "sp_P69905_HBA_HUMAN_heatmap.png").stat().st_size > 0
    stored = namespace["stored"]
    assert stored.ids == ["sp|P69905|HBA_HUMAN"] and stored.per_residue("sp|P69905|HBA_HUMAN").shape == (142, 256)
    assert namespace["scan"].scores.shape == (22, 20)
    assert any("output_attentions=True" in body for body in ran)
    assert any('load_sae("tiny")' in body for body in ran) and namespace["feats"][0].indices.shape == (24, 16)
    assert (tmp_path / "feats" / "summary.csv").read_text().startswith("id,layer,rank")
    assert len(namespace["out"].attentions) == namespace["model"].config.num_hidden_layers
