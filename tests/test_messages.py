"""What the commands say and write for a newcomer: one ``Warning:`` line for any warning, scan
files named by the FASTA ID, ``info --json`` numbers, file modes from the umask, the bench's
rates and plot, ``push --dry-run`` without the Hub. The packaged esmc-tiny, no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

import esmc_mlx
from esmc_mlx import bench
from esmc_mlx.artifact import human_size
from esmc_mlx.cli import main as cli
from esmc_mlx.convert import convert

WT = "MKTAYIAKQRQISFVKSHFSRQ"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return convert("tiny", tmp_path_factory.mktemp("tiny") / "fp32", progress=False)


def test_every_warning_is_one_warning_line(tiny, monkeypatch):
    """A library's plain UserWarning is one `Warning: ...` line too, as esmc-mlx's own: no
    category, file, line number or source line."""
    from esmc_mlx import cli as cli_module

    original = cli_module.model_facts

    def noisy(path):
        warnings.warn("a library's own warning", UserWarning, stacklevel=1)
        return original(path)

    monkeypatch.setattr(cli_module, "model_facts", noisy)
    result = CliRunner().invoke(cli, ["info", str(tiny), "--json"])
    assert result.exit_code == 0, result.output
    assert "Warning: a library's own warning" in result.output
    assert "UserWarning" not in result.output and "warnings.warn" not in result.output and ".py:" not in result.output


def test_info_json_gives_numbers(tiny):
    result = CliRunner().invoke(cli, ["info", str(tiny), "--json"])
    facts = json.loads(result.output)
    size = sum(f.stat().st_size for f in tiny.glob("model*.safetensors"))
    assert facts["parameters"] == 5_220_416 and facts["size_bytes"] == size and facts["shards"] == 1
    assert isinstance(facts["bits_per_weight"], float) and facts["quantization"] is None
    assert facts["architecture"] == {
        "model": "ESMC",
        "layers": 6,
        "hidden_size": 256,
        "attention_heads": 4,
        "intermediate_size": 768,
    }
    text = CliRunner().invoke(cli, ["info", str(tiny)]).output  # the text form keeps its words
    assert "5,220,416" in text and human_size(size) in text


def test_scan_of_a_fasta_file_is_named_by_its_id(tiny, tmp_path):
    fasta = tmp_path / "hba.fasta"
    fasta.write_text(f">sp|P69905|HBA_HUMAN Hemoglobin subunit alpha\n{WT}\n")
    out = tmp_path / "scan"
    args = ["scan", str(tiny), "--sequence", str(fasta), "-o", str(out), "--no-plot", "--no-progress"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "Scanned sp|P69905|HBA_HUMAN: 22 residues" in result.output
    assert sorted(p.name for p in out.glob("*_matrix.npy")) == ["sp_P69905_HBA_HUMAN_matrix.npy"]
    result = CliRunner().invoke(cli, [*args, "--name", "alpha"])  # --name still wins
    assert result.exit_code == 0 and (out / "alpha_matrix.npy").exists(), result.output
    result = CliRunner().invoke(cli, ["scan", str(tiny), "--sequence", WT, "-o", str(out), "--no-plot"])
    assert result.exit_code == 0 and (out / "sequence_matrix.npy").exists(), result.output  # literal: "sequence"


@pytest.mark.parametrize("storage", ["npy", "safetensors"])
@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_embeddings_take_the_users_umask(tiny, tmp_path, storage, umask):
    """safetensors wrote its shards 0600 whatever the umask."""
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{WT}\n>b\n{WT[:10]}\n")
    previous = os.umask(umask)
    try:
        result = CliRunner().invoke(
            cli, ["embed", str(tiny), str(fasta), "-o", str(tmp_path / "e"), "--format", storage, "--no-progress"]
        )
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    files = [p for p in (tmp_path / "e").iterdir() if p.is_file()]
    assert any(p.suffix == (".npy" if storage == "npy" else ".safetensors") for p in files)
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, (f.name, oct(f.stat().st_mode))


def test_bench_rates_and_plot_without_torch(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the plot extra)")
    assert bench.flop_rate(0.00041) == "0.41 GFLOP/s"  # a tiny model's row, not "0.0 TFLOP/s"
    assert bench.flop_rate(12.345) == "12.3 TFLOP/s"
    lines: list[str] = []
    results = bench.run(
        models=("tiny",), shapes=[(1, 8)], device="cpu", with_torch=False, out_dir=tmp_path, log=lines.append
    )
    assert "torch not run (--no-torch)" in lines[0] and "absent" not in lines[0]
    assert "GFLOP/s" in "\n".join(lines) and (tmp_path / "bench.png").stat().st_size > 0
    assert [r["impl"] for r in results["forward"]] == ["mlx"]


def test_bench_says_why_it_drew_no_plot(tmp_path, monkeypatch):
    from esmc_mlx.errors import install_hint

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    lines: list[str] = []
    bench.run(models=("tiny",), shapes=[(1, 8)], device="cpu", with_torch=False, out_dir=tmp_path, log=lines.append)
    assert (
        lines[-1] == f"wrote {tmp_path / 'bench.json'}; no plot: matplotlib is not installed ({install_hint('plot')})"
    )
    assert not (tmp_path / "bench.png").exists()


@pytest.mark.slow  # four child processes: over 5 s on the 2-core host
def test_push_dry_run_works_offline_without_a_token(tiny, tmp_path):
    """Offline, or without a token, a dry run shows the card and the files from the artifact alone."""
    artifact = convert("tiny", tmp_path / "tiny-4bit", q="4", progress=False)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    for extra in ({}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}):  # offline; no token
        done = subprocess.run(
            [sys.executable, "-m", "esmc_mlx.cli", "push", str(artifact), "my-org/tiny-4bit", "--dry-run"],
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=120,
        )
        assert done.returncode == 1 and "validation" in done.stdout + done.stderr  # not validated: refused
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "esmc_mlx.cli",
                "push",
                str(artifact),
                "my-org/tiny-4bit",
                "--dry-run",
                "--allow-unvalidated",
            ],
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        out = done.stdout
        assert "Dry run, without the Hub: nothing was uploaded. A push to my-org/tiny-4bit would send:" in out
        assert "+ model.safetensors" in out and "+ config.json" in out and "+ README.md" in out
        assert "--- README.md (model card) ---" in out and "library_name: mlx" in out
        assert ("offline mode is on" if not extra else "no Hugging Face token") in out
    assert not (artifact / "README.md").exists()  # a dry run writes nothing


def test_model_cards_say_what_installs_and_what_esmc_tiny_is(tiny, tmp_path):
    from esmc_mlx.hub.card import render_card

    card = render_card(tiny, "me/esmc-tiny-mlx")
    assert "pip install esmc-mlx" not in card and "pypi.org" not in card
    assert "esmc-mlx is not published on PyPI" in card and "python -m build" in card
    assert "not a model for biology" in card and "from EvolutionaryScale" not in card
    assert "esmc-tiny, the demo model bundled with esmc-mlx" in card
    packaged = (Path(esmc_mlx.__file__).parent / "data" / "esmc-tiny" / "README.md").read_text()
    assert "It is not a model for biology." in packaged.replace("**", "")


def test_missing_extras_are_named_by_what_pip_can_install(monkeypatch):
    """'pip install esmc-mlx[plot]' asks PyPI for a package that is not there."""
    import shutil

    from esmc_mlx.errors import TORCH_CPU_INDEX, install_hint

    assert install_hint("plot") == "pip install 'matplotlib>=3.8' (esmc-mlx's plot extra)"
    assert install_hint("h5") == "pip install 'h5py>=3.8' (esmc-mlx's h5 extra)"
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no nvidia-smi: torch's CPU build
    torch_hint = install_hint("torch")
    assert "'torch>=2.4'" in torch_hint and "'transformers>=5.23'" in torch_hint and TORCH_CPU_INDEX in torch_hint
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert TORCH_CPU_INDEX not in install_hint("torch")
    assert "esmc-mlx[" not in install_hint("plot") + torch_hint


def test_a_pth_without_torch_names_what_to_install(tmp_path, monkeypatch):
    from esmc_mlx.errors import install_hint

    pth = tmp_path / "esmc_300m_2024_12_v0.pth"
    pth.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip: torch would be asked to read it
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    result = CliRunner().invoke(cli, ["convert", str(pth), "-o", str(tmp_path / "out"), "--no-validate"])
    assert result.exit_code == 1, result.output
    assert f"reading a .pth checkpoint needs torch: {install_hint('torch')}" in result.output
    assert not (tmp_path / "out").exists()
