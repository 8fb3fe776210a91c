"""What may leave the machine: `push` uploads the artifact (what artifact.published_files says it is
made of) and what the user names with --include, never a link's target outside the folder, never
a file holding an access token; and no local path the user typed is published (config.json, the
model card, the commit, report.json). Against the local Hub of tests/hub_server.py; each case
asserts the exit code, the message, what reached the Hub and the user's files afterwards."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest_hub import hub, no_remote_network  # noqa: F401  (fixtures)
from fault_tools import cli, convert_cli, one_error_line, snapshot

from esmc_mlx import outputs
from esmc_mlx.artifact import published_files
from esmc_mlx.convert import convert
from esmc_mlx.hub.card import render_card

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"  # the shape of a Hugging Face token, nobody's
ARTIFACT_FILES = {
    "README.md",
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "validation/report.json",
    "validation/report.md",
}


def artifact(folder: Path) -> Path:
    """esmc-tiny converted, with a passing validation report as validate writes it (in short)."""
    out = convert("tiny", folder, progress=False)
    (out / "validation").mkdir()
    checks = [{"name": "fidelity_logits_rel_err", "value": 3e-7, "threshold": 1e-5, "passed": True}]
    (out / "validation" / "report.json").write_text(json.dumps({"passed": True, "checks": checks}))
    (out / "validation" / "report.md").write_text("# Validation report\n\npassed\n")
    outputs.add_to_marker(out, "validation")
    return out


def repo_files(repo_id: str) -> set[str]:
    from huggingface_hub import HfApi

    return set(HfApi().list_repo_files(repo_id))


def writes(hub) -> list:
    return [r for r in hub.state.log if r[0] in ("POST", "PUT", "DELETE") and "validate-yaml" not in r[1]]


def listed(output: str) -> set[str]:
    """The files a dry run says it would upload."""
    return {line.split(" (")[0].removeprefix("  + ") for line in output.splitlines() if line.startswith("  + ")}


# --- rule 4: push uploads the artifact, not the folder -----------------------------------------------
def test_push_uploads_what_the_artifact_is_made_of_and_what_is_named(hub, tmp_path):
    out = artifact(tmp_path / "out")
    (out / "private.fasta").write_text(">patient_17\nMKT\n")
    (out / "notes.md").write_text("benchmarks to publish\n")
    (out / "drafts").mkdir()
    (out / "drafts" / "plan.docx").write_bytes(b"PK\x03\x04 a draft")
    (out / "drafts" / "figure.txt").write_text("a figure\n")
    mine = {p: snapshot(out / p) for p in ("private.fasta", "notes.md", "drafts")}
    dry = cli("push", out, "my-org/tiny", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert listed(dry.output) == ARTIFACT_FILES and "private.fasta" not in dry.output
    assert cli("push", out, "my-org/tiny").exit_code == 0
    assert repo_files("my-org/tiny") - {".gitattributes"} == ARTIFACT_FILES
    result = cli("push", out, "my-org/tiny", "--include", "notes.md", "--include", out / "drafts")
    assert result.exit_code == 0, result.output
    extra = {"notes.md", "drafts/plan.docx", "drafts/figure.txt"}
    assert repo_files("my-org/tiny") - {".gitattributes"} == ARTIFACT_FILES | extra
    assert {p: snapshot(out / p) for p in mine} == mine


def test_what_include_may_name(hub, tmp_path):
    out = artifact(tmp_path / "out")
    (tmp_path / "beside.txt").write_text("not the artifact's\n")
    for item, message in (
        ("missing.md", "no such file"),
        ("../beside.txt", "not inside"),
        (tmp_path / "beside.txt", "not inside"),
    ):
        one_error_line(cli("push", out, "my-org/tiny", "--include", item, "--dry-run"), message)
    assert writes(hub) == []


def test_a_link_that_leads_out_of_the_folder_is_refused(hub, tmp_path):
    out = artifact(tmp_path / "out")
    secret = tmp_path / "secret.txt"
    secret.write_text("the content of a file outside the artifact\n")
    (out / "notes.md").symlink_to(secret)
    before = snapshot(tmp_path / "secret.txt")
    one_error_line(cli("push", out, "my-org/tiny", "--include", "notes.md"), "notes.md leads outside")
    (out / "notes.md").unlink()
    # one of the artifact's own files as a link to a file outside: refused without --include
    (out / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    (out / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    one_error_line(cli("push", out, "my-org/tiny"), "tokenizer.json leads outside")
    assert writes(hub) == [] and snapshot(secret) == before
    # a link inside the folder is what it points to: sent
    os.replace(tmp_path / "tokenizer.json", out / "tokenizer.json.real")
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to("tokenizer.json.real")
    assert "tokenizer.json" in published_files(out)


@pytest.mark.parametrize(
    "where",
    ["setup.sh", "notes.txt", "tokenizer_config.json", "validation/report.md", "README.md", "model.safetensors"],
)
def test_an_access_token_in_any_file_sent_is_refused(hub, tmp_path, where):
    out = artifact(tmp_path / "out")
    path = out / where
    if where == "model.safetensors":  # in the weights' header metadata
        from safetensors.numpy import load_file, save_file

        save_file(load_file(str(path)), str(path), metadata={"format": "mlx", "note": f"token {TOKEN}"})
    elif where == "README.md":  # a hand-written card
        path.write_text(f"# My model\n\nLoad it with HF_TOKEN={TOKEN}\n")
    else:
        path.write_text((path.read_text() if path.exists() else "") + f"\nexport HF_TOKEN={TOKEN}\n")
    include = ["--include", where] if where in ("setup.sh", "notes.txt") else []
    result = cli("push", out, "my-org/tiny", *include)
    line = one_error_line(result, f"{where} holds an access token")
    assert TOKEN not in line and writes(hub) == []
    if include:  # not named: not sent, so not refused
        assert cli("push", out, "my-org/tiny").exit_code == 0
        assert where not in repo_files("my-org/tiny")


def test_the_token_in_use_is_refused_whatever_its_shape(hub, tmp_path):
    out = artifact(tmp_path / "out")
    (out / "notes.md").write_text("pushed as hf_alice\n")  # the test Hub's token in use
    one_error_line(cli("push", out, "my-org/tiny", "--include", "notes.md"), "notes.md holds an access token")
    assert writes(hub) == []


# --- rule 5: no path the user typed is published -------------------------------------------------
@pytest.mark.parametrize(
    "spelling",
    [
        ["-o", "SECRET/alice/out"],
        ["--output=SECRET/alice/out"],
        ["-oSECRET/alice/out"],
        ["-o", "./SECRET/alice/out"],
        "absolute glued",
    ],
)
def test_a_typed_output_path_is_in_no_published_file(hub, tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SECRET" / "alice").mkdir(parents=True)
    if spelling == "absolute glued":
        spelling = [f"-o{tmp_path}/SECRET/alice/out"]
    result = convert_cli("tiny", *spelling, "--dtype", "float16", "--no-validate")
    assert result.exit_code == 0, result.output
    out = tmp_path / "SECRET" / "alice" / "out"
    config = json.loads((out / "config.json").read_text())
    command = config["esmc_mlx"]["command"]
    assert "SECRET" not in command and "alice" not in command and str(tmp_path) not in command, command
    assert command.endswith("tiny --output out --dtype float16 --no-validate"), command
    card = render_card(out, "my-org/tiny")
    assert "SECRET" not in card and "alice" not in card
    pushed = cli("push", out, "my-org/tiny", "--allow-unvalidated")
    assert pushed.exit_code == 0, pushed.output
    sent = b"".join(hub.state.stored_bytes())
    assert b"SECRET" not in sent and b"alice/out" not in sent
    quantized = cli("quantize", out, "-o", "SECRET/alice/q8", "--q", "8")
    assert quantized.exit_code == 0, quantized.output
    command = json.loads((tmp_path / "SECRET/alice/q8/config.json").read_text())["esmc_mlx"]["command"]
    assert "SECRET" not in command and "alice" not in command, command


def test_a_commit_message_holding_a_local_path_is_refused(hub, tmp_path):
    out = artifact(tmp_path / "out")
    result = cli("push", out, "my-org/tiny", "--commit-message", f"from {tmp_path}/SECRET/alice")
    one_error_line(result, "commit message would hold", "a local absolute path")
    assert writes(hub) == []


@pytest.mark.slow  # validation runs torch: over 5 s on the 2-core host
def test_a_typed_panel_path_is_not_in_the_report(tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="validation needs torch")
    monkeypatch.chdir(tmp_path)
    out = convert("tiny", tmp_path / "out", progress=False)
    (tmp_path / "SECRET" / "alice").mkdir(parents=True)
    shutil.copyfile(Path(__file__).parent.parent / "esmc_mlx" / "data" / "panel.fasta", "SECRET/alice/panel.fa")
    result = cli("validate", "out", "--reference", "tiny", "--sequences", "SECRET/alice/panel.fa", "--quick")
    assert result.exit_code == 0, result.output
    for name in ("report.json", "report.md"):
        text = (out / "validation" / name).read_text()
        assert "SECRET" not in text and "alice" not in text, name
    assert json.loads((out / "validation" / "report.json").read_text())["panel"]["source"] == "panel.fa"
