"""Publishing to the Hub and downloading from it, with the real huggingface_hub client against the
local Hub of tests/hub_server.py (127.0.0.1 only; conftest_hub refuses any other connection)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest_hub import GUARD, hub, no_remote_network  # noqa: F401  (fixtures)
from hub_server import Blob

from esmc_mlx import load
from esmc_mlx.artifact import PLOT_NAME
from esmc_mlx.cli import convert_main, main
from esmc_mlx.convert import convert
from esmc_mlx.errors import HubError
from esmc_mlx.hub import push as push_module
from esmc_mlx.hub.card import MARKER, read_validation, render_card
from esmc_mlx.hub.push import push_artifact
from esmc_mlx.testing import child_env, random_sequences

# huggingface_hub's own LFS upload passes a file as `data=`, which its HTTP client deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

SOURCE_REPO = "biohub/ESMC-tiny-test"
COMMAND = f"esmc-convert {SOURCE_REPO} --q 4 --upload-repo my-org/ESMC-tiny-4bit"


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(push_module, "RETRY_WAITS", (0.0, 0.0))


def tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0\0")) + chunk(b"IEND", b"")


def write_validation(artifact: Path, passed: bool = True) -> None:
    """What the validator writes (a minimal version of it): report.json, report.md, a plot."""
    folder = artifact / "validation"
    folder.mkdir(exist_ok=True)
    checks = [
        {"name": "fidelity_logits_rel_err", "value": 3e-7, "threshold": 1e-5, "passed": True},
        {"name": "top1", "value": 0.99 if passed else 0.41, "threshold": 0.88, "passed": passed},
    ]
    (folder / "report.json").write_text(json.dumps({"passed": passed, "checks": checks}))
    rows = "\n".join(
        f"| {c['name']} | {c['value']} | {c['threshold']} | {'yes' if c['passed'] else 'no'} |" for c in checks
    )
    (folder / "report.md").write_text(
        f"# Validation report\n\n| check | value | threshold | passed |\n|---|---|---|---|\n{rows}\n"
    )
    (folder / PLOT_NAME).write_bytes(tiny_png())


def host_source(hub, checkpoint_dir: Path, license_: str = "mit") -> None:
    """Publish the random checkpoint on the local Hub as the source repo, with a licensed card."""
    hub.state.create_repo(SOURCE_REPO)
    files = {p.name: p.read_bytes() for p in checkpoint_dir.iterdir() if p.is_file()}
    files["README.md"] = f"---\nlicense: {license_}\nlibrary_name: transformers\n---\n# ESMC tiny\n".encode()
    hub.state.commit_files(SOURCE_REPO, files, "add checkpoint")


def make_artifact(
    source: str,
    out: Path,
    q: str | None = "4",
    validated: bool | None = True,
    shard_bytes: int | None = None,
    command: str | None = COMMAND,
) -> Path:
    kwargs = {"shard_bytes": shard_bytes} if shard_bytes else {}
    convert(source, out, q=q, force=True, progress=False, command=command, **kwargs)
    if validated is not None:
        write_validation(out, passed=validated)
    return out


def logits(model_ref) -> np.ndarray:
    model, tokenizer = load(model_ref)
    batch = tokenizer(random_sequences(3, seed=1))
    return np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits)


def commits(repo_id: str, revision: str = "main") -> list:
    from huggingface_hub import HfApi

    return HfApi().list_repo_commits(repo_id, revision=revision)


def repo_files(repo_id: str, revision: str = "main") -> set[str]:
    from huggingface_hub import HfApi

    return set(HfApi().list_repo_files(repo_id, revision=revision))


def writes(hub) -> list:
    return [r for r in hub.state.log if r[0] in ("POST", "PUT", "DELETE") and "validate-yaml" not in r[1]]


# --- the headline path -------------------------------------------------------------------------------
@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_convert_push_download_load_gives_the_same_logits(hub, checkpoints, tmp_path):
    from huggingface_hub import ModelCard, snapshot_download

    host_source(hub, checkpoints["published"])
    artifact = make_artifact(SOURCE_REPO, tmp_path / "ESMC-tiny-4bit", validated=None)  # source from the local Hub
    panel = tmp_path / "panel.fasta"
    panel.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ\n>b\nMVLSPADKTNVKAAWGKVGAHAGEYGAEALERMF\n")
    validated = CliRunner().invoke(
        main, ["validate", str(artifact), "--reference", SOURCE_REPO, "--sequences", str(panel)]
    )
    assert validated.exit_code == 0, validated.output  # the real validator writes validation/
    before = logits(artifact)

    result = CliRunner().invoke(main, ["push", str(artifact), "my-org/ESMC-tiny-4bit"])
    assert result.exit_code == 0, result.output
    assert "Created my-org/ESMC-tiny-4bit" in result.output and "validation: passed" in result.output

    history = commits("my-org/ESMC-tiny-4bit")
    assert len(history) == 2 and all(len(c.commit_id) == 40 for c in history)  # initial commit + the artifact
    local = snapshot_download("my-org/ESMC-tiny-4bit")
    assert Path(local).name == history[0].commit_id
    names = {p.relative_to(local).as_posix() for p in Path(local).rglob("*") if p.is_file()}
    assert {
        "README.md",
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "validation/report.json",
        "validation/report.md",
    } <= names
    plots = sorted(n for n in names if n.startswith("validation/") and n.endswith(".png"))
    assert plots
    assert (Path(local) / "model.safetensors").read_bytes() == (artifact / "model.safetensors").read_bytes()

    np.testing.assert_array_equal(logits("my-org/ESMC-tiny-4bit"), before)

    card = ModelCard((Path(local) / "README.md").read_text())
    assert card.data.library_name == "mlx"
    assert card.data.base_model == SOURCE_REPO and card.data.base_model_relation == "quantized"
    assert card.data.license == "mit"  # carried from the source's card
    assert {"mlx", "esmc", "protein", "4-bit"} <= set(card.data.tags)
    assert COMMAND in card.text and "bits per weight" in card.text.lower()
    report_table = next(
        line
        for line in (artifact / "validation" / "report.md").read_text().splitlines()
        if line.startswith("| fidelity")
    )
    assert report_table in card.text and f"]({plots[0]})" in card.text  # the report, its plot linked from the root
    assert 'load("my-org/ESMC-tiny-4bit")' in card.text and "esmc-mlx info" in card.text
    assert (artifact / "README.md").read_text() == card.content  # the local artifact carries the same card


def test_second_push_of_a_changed_artifact_makes_a_second_commit(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a", q=None, shard_bytes=200_000)
    shards = sorted(p.name for p in artifact.glob("model-*.safetensors"))
    assert len(shards) >= 2
    first = push_artifact(artifact, "alice/tiny")
    assert first.created and set(shards) <= repo_files("alice/tiny")

    make_artifact(str(checkpoints["published"]), artifact, q="8")  # same directory, now one 8-bit shard
    second = push_artifact(artifact, "alice/tiny")
    assert not second.created and not second.unchanged and second.commit_oid != first.commit_oid
    assert [c.commit_id for c in commits("alice/tiny")][:2] == [second.commit_oid, first.commit_oid]
    assert set(second.deletions) == set(shards)  # stale shards go, or load() would mix them in
    assert not set(shards) & repo_files("alice/tiny")
    np.testing.assert_array_equal(logits("alice/tiny"), logits(artifact))

    again = push_artifact(artifact, "alice/tiny")  # nothing changed: no empty commit
    assert again.unchanged and again.commit_oid == second.commit_oid and len(commits("alice/tiny")) == 3
    assert "Nothing to push" in again.summary()


def test_create_pr_opens_a_pr_ref_and_leaves_main_alone(hub, checkpoints, tmp_path):
    from huggingface_hub import HfApi, snapshot_download

    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a", q="4")
    push_artifact(artifact, "my-org/tiny")
    main_head = commits("my-org/tiny")[0].commit_id
    make_artifact(str(checkpoints["published"]), artifact, q="8")

    result = CliRunner().invoke(
        main, ["push", str(artifact), "my-org/tiny", "--create-pr", "--commit-message", "Re-quantize to 8 bits"]
    )
    assert result.exit_code == 0, result.output
    assert "Opened a pull request" in result.output and "/my-org/tiny/discussions/1" in result.output
    refs = HfApi().list_repo_refs("my-org/tiny", include_pull_requests=True)
    assert [r.ref for r in refs.pull_requests] == ["refs/pr/1"]
    assert commits("my-org/tiny")[0].commit_id == main_head
    assert commits("my-org/tiny", "refs/pr/1")[0].title == "Re-quantize to 8 bits"
    pr = Path(snapshot_download("my-org/tiny", revision="refs/pr/1"))
    assert json.loads((pr / "config.json").read_text())["quantization"]["bits"] == 8


def test_revision_pushes_to_a_new_branch(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    result = push_artifact(artifact, "alice/tiny", revision="dev", private=True)
    assert result.created and hub.state.repos["alice/tiny"].private
    assert "config.json" in repo_files("alice/tiny", "dev") and repo_files("alice/tiny") == {".gitattributes"}


def test_an_empty_revision_is_refused_not_taken_for_main(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    result = CliRunner().invoke(main, ["push", str(artifact), "alice/tiny", "--revision", ""])
    assert result.exit_code == 1 and result.output.count("Error:") == 1 and "--revision ''" in result.output
    assert hub.state.log == [] and "alice/tiny" not in hub.state.repos  # was: committed to main
    for bad in (5, b"dev", "  "):  # 5 and b"dev" were AttributeErrors ('int' object has no attribute 'strip')
        with pytest.raises(HubError, match=r"--revision .*: give the branch to commit to"):
            push_artifact(artifact, "alice/tiny", revision=bad)
    assert hub.state.log == []


def test_the_validate_command_a_refused_push_suggests_reads_its_reference(hub, tmp_path):
    # the packaged model's artifacts are told to run `esmc-mlx validate DIR --reference
    # esmc-mlx/tiny` (the id their provenance records): that id must name the packaged model,
    # not go to the Hub
    from esmc_mlx.resolve import resolve

    artifact = convert("tiny", tmp_path / "tiny-4bit", q="4", progress=False)
    with pytest.raises(HubError, match=r"--reference esmc-mlx/tiny\n"):
        push_artifact(artifact, "alice/tiny")
    assert resolve("esmc-mlx/tiny").path == resolve("tiny").path
    assert hub.state.log == []


def test_a_repo_without_model_files_is_named_as_such(hub, tmp_path):
    # not 'alice/empty: a file, not a model directory' (the client returns a snapshot path it
    # never made when no file matches), in load, embed and score alike
    hub.state.create_repo("alice/empty")  # only .gitattributes, as a push to another branch leaves main
    with pytest.raises(HubError, match=r"alice/empty: the repo holds no model files on main"):
        load("alice/empty")
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQR\n")
    result = CliRunner().invoke(main, ["embed", "alice/empty", str(fasta), "-o", str(tmp_path / "e")])
    assert result.exit_code == 1 and "the repo holds no model files on main" in result.output, result.output
    assert not (tmp_path / "e").exists()


# --- what gets refused before anything is sent --------------------------------------------------------
@pytest.mark.parametrize("validated", [None, False])
def test_unvalidated_or_failed_artifact_is_refused_unless_allowed(hub, checkpoints, tmp_path, validated):
    from huggingface_hub import ModelCard

    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a", validated=validated)
    with pytest.raises(HubError, match="--allow-unvalidated") as refused:
        push_artifact(artifact, "alice/tiny")
    assert ("not validated" if validated is None else "validation failed: top1 = 0.41") in str(refused.value)
    assert hub.state.log == []  # refused before any request

    result = push_artifact(artifact, "alice/tiny", allow_unvalidated=True)
    card = ModelCard(result.card)
    assert ("**Not validated.**" if validated is None else "**Validation: FAILED.**") in card.text
    assert any("allow-unvalidated" in n for n in result.notes)


def test_no_token_then_the_stored_login(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    hub.use_token(None)
    result = CliRunner().invoke(main, ["push", str(artifact), "alice/tiny"])
    assert result.exit_code == 1 and "Error: cannot push to alice/tiny: no Hugging Face token" in result.output
    assert "hf auth login" in result.output and writes(hub) == []

    hub.token_path.write_text("hf_alice")  # what `hf auth login` stores (HF_HOME/token)
    assert push_artifact(artifact, "alice/tiny").created


@pytest.mark.parametrize(
    "token, message",
    [
        ("hf_wrong", "rejected the token (401 Unauthorized"),
        ("hf_read", "the token of alice is read-only"),
        ("hf_fine", "the Hub refused to create alice/tiny for alice (403"),
    ],
)
def test_tokens_without_write_access(hub, checkpoints, tmp_path, token, message):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    hub.use_token(token)
    with pytest.raises(HubError, match=message.replace("(", r"\(")):
        push_artifact(artifact, "alice/tiny")
    assert hub.state.repos == {}


def test_fine_grained_token_without_write_access_to_an_existing_repo(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    hub.state.create_repo("alice/tiny")
    hub.use_token("hf_fine")
    with pytest.raises(HubError, match=r"alice has no write access to alice/tiny \(403.*alice/tiny is unchanged\.$"):
        push_artifact(artifact, "alice/tiny")
    assert len(commits("alice/tiny")) == 1


def test_repo_of_someone_else(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    hub.state.create_repo("alice/tiny")
    hub.use_token("hf_bob")
    with pytest.raises(HubError, match="alice/tiny already exists and belongs to 'alice'.*Push to bob/tiny"):
        push_artifact(artifact, "alice/tiny")
    with pytest.raises(HubError, match="'my-org' is not your user name"):
        push_artifact(artifact, "my-org/tiny")
    assert writes(hub) == [] and len(commits("alice/tiny")) == 1


# --- failures during the push ----------------------------------------------------------------------------
def test_failed_upload_names_the_file_and_publishes_nothing(hub, checkpoints, tmp_path):
    def lose(path: Path) -> None:  # every upload of this file's content fails
        hub.state.faults.fail_lfs_oids = {hashlib.sha256(path.read_bytes()).hexdigest()}

    # Some shards got through: nothing is committed, the (empty) repo stays so that a re-run resumes.
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a", q=None, shard_bytes=200_000)
    lost = sorted(artifact.glob("model-*.safetensors"))[-1]
    lose(lost)
    result = CliRunner().invoke(main, ["push", str(artifact), "alice/tiny"])
    assert result.exit_code == 1
    error = result.output.strip()
    assert error.startswith("Error: push to alice/tiny@main failed:") and "\n" not in error  # one line
    assert f"Error while uploading '{lost.name}'" in error and "524" in error
    assert "Nothing was committed" in error and "stays empty" in error
    assert [c.title for c in commits("alice/tiny")] == ["initial commit"]
    hub.state.faults.fail_lfs_oids = set()
    puts = len(hub.state.lfs_puts)
    assert push_artifact(artifact, "alice/tiny").commit_oid
    assert len(hub.state.lfs_puts) - puts == 1  # only the shard that had failed is sent again

    # A repo that existed stays exactly as it was.
    head = commits("alice/tiny")[0].commit_id
    make_artifact(str(checkpoints["published"]), artifact, q=None, shard_bytes=100_000)
    stored = hub.state.repos["alice/tiny"].lfs
    lost = next(
        p
        for p in sorted(artifact.glob("model-*.safetensors"))
        if hashlib.sha256(p.read_bytes()).hexdigest() not in stored
    )
    lose(lost)
    with pytest.raises(HubError, match=f"Error while uploading '{lost.name}'") as failed:
        push_artifact(artifact, "alice/tiny")
    assert "alice/tiny is unchanged" in str(failed.value) and "deleted again" not in str(failed.value)
    assert commits("alice/tiny")[0].commit_id == head
    hub.state.faults.fail_lfs_oids = set()
    push_artifact(artifact, "alice/tiny")
    np.testing.assert_array_equal(logits("alice/tiny"), logits(artifact))


def test_refused_commit_takes_back_the_repo_and_branch_it_created(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    hub.state.faults.reject_commits = 1  # 422: retrying would not help
    with pytest.raises(
        HubError,
        match=r"422.*file too large.*the repo alice/tiny that this push created was "
        "deleted again",
    ) as refused:
        push_artifact(artifact, "alice/tiny")
    assert "alice/tiny" not in hub.state.repos and "\n" not in str(refused.value)

    hub.state.create_repo("alice/tiny")
    hub.state.faults.fail_commits = 3  # 500 on every attempt: transient, but it never clears
    with pytest.raises(
        HubError,
        match=r"500.*alice/tiny is unchanged \(the branch dev that this push created was "
        r"deleted again\). Run the same command again",
    ):
        push_artifact(artifact, "alice/tiny", revision="dev")
    assert set(hub.state.repos["alice/tiny"].refs) == {"main"} and len(commits("alice/tiny")) == 1


def test_transient_failures_are_retried(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a", q=None, shard_bytes=200_000)
    faults = hub.state.faults
    faults.fail_lfs_puts, faults.fail_commits = 2, 1  # two uploads fail, then the commit fails once
    result = push_artifact(artifact, "alice/tiny")
    assert result.created and faults.fail_lfs_puts == 0 and faults.fail_commits == 0
    assert len(commits("alice/tiny")) == 2

    make_artifact(str(checkpoints["published"]), artifact, q="8")
    faults.drop_commit_responses = 1  # the Hub commits, the answer is lost: no second, duplicate commit
    result = push_artifact(artifact, "alice/tiny")
    assert len(commits("alice/tiny")) == 3 and commits("alice/tiny")[0].commit_id == result.commit_oid


def test_offline_mode(hub, checkpoints, tmp_path):
    """HF_HUB_OFFLINE is read when huggingface_hub is imported: a fresh process gets it."""
    import os
    import subprocess
    import sys

    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    push_artifact(artifact, "alice/tiny")
    np.save(tmp_path / "online.npy", logits("alice/tiny"))  # downloads into the cache

    script = (
        GUARD
        + """
import sys
import numpy as np
from esmc_mlx import load
from esmc_mlx.errors import EsmcMlxError
from esmc_mlx.hub.push import push_artifact
from esmc_mlx.testing import random_sequences
model, tokenizer = load("alice/tiny")
batch = tokenizer(random_sequences(3, seed=1))
np.save(sys.argv[1], np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits))
for call in (lambda: load("alice/never-downloaded"), lambda: push_artifact(sys.argv[2], "alice/tiny")):
    try:
        call()
        print("no error")
    except EsmcMlxError as e:
        print("Error:", str(e).splitlines()[0])
"""
    )
    requests = len(hub.state.log)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "offline.npy"), str(artifact)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "offline.npy"), np.load(tmp_path / "online.npy"))  # the cache
    not_cached, push = done.stdout.strip().splitlines()[-2:]
    assert "offline mode is on" in not_cached and "not in the local cache" in not_cached
    assert "offline mode is on" in push
    assert len(hub.state.log) == requests


def test_dry_run_checks_and_shows_but_writes_nothing(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    result = CliRunner().invoke(main, ["push", str(artifact), "my-org/tiny", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "Dry run: nothing was uploaded. A push would create my-org/tiny" in result.output
    assert "+ model.safetensors" in result.output and "+ README.md" in result.output
    assert "library_name: mlx" in result.output and MARKER in result.output
    assert writes(hub) == [] and not (artifact / "README.md").exists()


def test_hand_written_card_is_kept(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    (artifact / "README.md").write_text("---\nlicense: mit\nlibrary_name: mlx\n---\n# My own card\n")
    result = push_artifact(artifact, "alice/tiny")
    assert not result.card_generated and "# My own card" in result.card
    assert (artifact / "README.md").read_text().endswith("# My own card\n")


# --- esmc-convert --upload-repo -----------------------------------------------------------------------
def test_esmc_convert_upload_repo(hub, checkpoints, tmp_path, monkeypatch):
    import esmc_mlx.pipeline as convert_module  # the pipeline's convert step (writes into the staging directory)

    def convert_and_validate(
        job, directory, *args, **kwargs
    ):  # a quick stand-in for --validate (tested with the real one above)
        convert_module_write(job, directory, *args, **kwargs)
        write_validation(Path(directory))

    convert_module_write = convert_module.write_artifact
    monkeypatch.setattr(convert_module, "write_artifact", convert_and_validate)
    out = tmp_path / "ESMC-tiny-4bit"
    result = CliRunner().invoke(
        convert_main,
        [
            str(checkpoints["published"]),
            "-o",
            str(out),
            "--q",
            "4",
            "--no-validate",
            "--upload-repo",
            "my-org/ESMC-tiny-4bit",
            "--private",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"Wrote {out}" in result.output and "Created my-org/ESMC-tiny-4bit" in result.output
    assert hub.state.repos["my-org/ESMC-tiny-4bit"].private
    np.testing.assert_array_equal(logits("my-org/ESMC-tiny-4bit"), logits(out))


def test_esmc_convert_upload_repo_checks_access_before_converting(hub, checkpoints, tmp_path):
    out = tmp_path / "out"
    hub.use_token(None)
    result = CliRunner().invoke(
        convert_main, [str(checkpoints["published"]), "-o", str(out), "--upload-repo", "my-org/x"]
    )
    assert result.exit_code == 1 and "no Hugging Face token" in result.output and not out.exists()

    hub.use_token("hf_alice")  # converted, but not validated: kept locally, not published, and told how
    result = CliRunner().invoke(
        convert_main, [str(checkpoints["published"]), "-o", str(out), "--no-validate", "--upload-repo", "my-org/x"]
    )
    assert result.exit_code == 1 and f"Wrote {out}" in result.output
    assert f"esmc-mlx push {out} my-org/x --allow-unvalidated" in result.output
    assert (out / "config.json").exists() and hub.state.repos == {}


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_a_fresh_process_takes_endpoint_and_token_from_the_environment(hub, checkpoints, tmp_path):
    """huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE at import and HF_TOKEN when asked."""
    import os
    import subprocess
    import sys

    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    command = [sys.executable, "-c", GUARD + "from esmc_mlx.cli import main; main()", "push", str(artifact)]
    done = subprocess.run(
        [*command, "bob/tiny"], capture_output=True, text=True, timeout=120, env={**os.environ, "HF_TOKEN": "hf_bob"}
    )
    assert done.returncode == 0, done.stderr
    assert "Created bob/tiny" in done.stdout and "bob/tiny" in hub.state.repos
    done = subprocess.run(
        [*command, "bob/other"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_TOKEN": "hf_bob", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 1 and "offline mode is on" in done.stderr


# --- nothing private leaves the machine (docs/reliability.md, rule 9) ------------------------------------
MARK = "Q7privatemark"


def sent_or_stored(hub) -> list[bytes]:
    """Every request target and body the Hub received, and every file, object and commit text it holds."""
    return hub.state.received + hub.state.stored_bytes()


def test_nothing_private_is_uploaded(hub, checkpoints, tmp_path, monkeypatch):
    home = tmp_path / f"home-{MARK}"  # a home, a user name and working directories that carry the marker
    work = home / f"models-{MARK}"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for name in ("USER", "LOGNAME", "USERNAME"):
        monkeypatch.setenv(name, f"user-{MARK}")
    monkeypatch.chdir(work)
    source = work / "ckpt"
    shutil.copytree(checkpoints["published"], source)
    panel = work / "panel.fasta"
    panel.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ\n>b\nMVLSPADKTNVKAAWGKVGAHAGEYGAEALERMF\n")
    out = work / "ESMC-tiny-4bit"
    convert(
        str(source),
        out,
        q="4",
        progress=False,
        command=f"esmc-convert {source} -o {out} --q 4 --upload-repo alice/tiny --shard-size=~/x/y",
    )
    validated = CliRunner().invoke(main, ["validate", str(out), "--reference", str(source), "--sequences", str(panel)])
    assert validated.exit_code == 0, validated.output
    assert MARK in str(out) and MARK in validated.output  # the local output names the local paths

    result = push_artifact(out, "alice/tiny")
    received = sent_or_stored(hub)
    assert any(b"ESMC-tiny-4bit" in b for b in received) and len(hub.state.stored_bytes()) > 5
    for secret in (MARK, str(tmp_path), "hf_alice"):  # tokens travel in the Authorization header only
        assert not [b[:200] for b in received if secret.encode() in b], secret
    config = json.loads((out / "config.json").read_text())["esmc_mlx"]
    assert config["source"]["id"] == "ckpt" and len(config["source"]["files"]["model.safetensors"]) == 64
    assert config["command"] == "esmc-convert ckpt -o ESMC-tiny-4bit --q 4 --upload-repo alice/tiny --shard-size=y"
    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["artifact"]["path"] == "ESMC-tiny-4bit" and report["reference"]["id"] == "ckpt"
    assert report["panel"]["source"] == "panel.fasta"
    assert "esmc-convert ckpt -o ESMC-tiny-4bit" in result.card


@pytest.mark.parametrize(
    "where, leak, found",
    [
        ("config.json", "command", "a local absolute path"),
        ("validation/report.json", "token", "an access token"),
    ],
)
def test_an_artifact_holding_private_data_is_not_sent(hub, checkpoints, tmp_path, where, leak, found):
    """What an older esmc-mlx wrote (or a hand edit) is caught before anything is sent."""
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    path = artifact / where
    data = json.loads(path.read_text())
    if leak == "command":
        data["esmc_mlx"]["command"] = f"esmc-convert {tmp_path}/ckpt --q 4"
    else:
        data["note"] = "pushed with hf_alice"
    path.write_text(json.dumps(data))
    with pytest.raises(HubError, match=f"refusing to push .*: {where} holds {found}"):
        push_artifact(artifact, "alice/tiny")
    assert hub.state.log == []


def test_public_forms_of_paths_and_commands(tmp_path, monkeypatch):
    from esmc_mlx.privacy import public_command, public_source_id, scrub

    monkeypatch.setenv("HOME", "/home/Jane Doe")
    assert (
        public_source_id("/data/x/esmc_300m.pth") == "esmc_300m.pth"
        and public_source_id("biohub/ESMC-6B") == "biohub/ESMC-6B"
    )
    assert (
        public_command("esmc-convert '/data/my models/ckpt' -o ./out --q 4 --upload-repo my-org/x")
        == "esmc-convert ckpt -o out --q 4 --upload-repo my-org/x"
    )
    report = {
        "a": "/home/Jane Doe/m/art/model.safetensors: truncated",
        "b": ["see https://hf.co/a/b, 1/2"],
        "c": f"{tmp_path}/art/validation/r.png",
        "n": 3.5,
    }
    assert scrub(report, tmp_path / "art") == {
        "a": "model.safetensors: truncated",
        "b": ["see https://hf.co/a/b, 1/2"],
        "c": "validation/r.png",
        "n": 3.5,
    }


@pytest.mark.parametrize("bad", ["no-slash", "a/b/c", "org/na--me", "org/-name", "org/name.git", ""])
def test_one_repo_id_check_for_push_and_card(hub, checkpoints, tmp_path, bad):
    from esmc_mlx.hub.card import base_model_of

    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    with pytest.raises(HubError, match="is not a Hub repo id"):
        push_artifact(artifact, bad)
    assert (
        base_model_of({"source": {"id": bad}}) is None and base_model_of({"source": {"id": "biohub/x"}}) == "biohub/x"
    )
    assert hub.state.log == []


# --- card and server details ----------------------------------------------------------------------------
def test_card_of_an_unquantized_local_conversion(checkpoints, tmp_path):
    from huggingface_hub import ModelCard

    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a", q=None, validated=None, command=None)
    card = ModelCard(render_card(artifact, "alice/tiny-fp32"))
    data = card.data.to_dict()
    assert data["library_name"] == "mlx" and "base_model" not in data and "base_model_relation" not in data
    assert {"mlx", "esmc", "protein", "float32"} <= set(data["tags"])
    assert "Not quantized" in card.text and "Not validated" in card.text
    assert "no command line was recorded" in card.text
    assert read_validation(artifact).state == "missing"
    # its first sentence is a sentence
    assert "An ESMC protein language model from a local checkpoint (`published`), converted to [MLX]" in card.text


def test_incomplete_artifact_is_refused(hub, checkpoints, tmp_path):
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a", q=None, shard_bytes=200_000)
    next(artifact.glob("model-*.safetensors")).unlink()
    with pytest.raises(HubError, match="incomplete artifact, .* names shards that are missing"):
        push_artifact(artifact, "alice/tiny")
    with pytest.raises(HubError, match="not a Hub repo id"):
        push_artifact(artifact, "no-slash")
    assert hub.state.log == []


def test_a_stray_weight_file_is_refused_not_published(hub, checkpoints, tmp_path):
    """With a hand-written card (so no generated one to check the weights), a model_old.safetensors
    beside the weights was uploaded with them, and the published repo then failed every load (load
    refuses a stray file the index does not name)."""
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    shutil.copy(artifact / "model.safetensors", artifact / "model_old.safetensors")
    (artifact / "README.md").write_text("---\nlicense: mit\n---\n# My own card\n")  # no card rendered to notice
    with pytest.raises(HubError, match="model_old.safetensors not named by model.safetensors"):
        push_artifact(artifact, "alice/tiny")
    assert hub.state.log == [] and "alice/tiny" not in hub.state.repos


def test_push_sends_nothing_while_another_run_writes_the_artifact(hub, checkpoints, tmp_path):
    """A conversion replacing the artifact (--force) holds its lock; push must not upload
    meanwhile, its files read from the old artifact or the new one, whichever the swap had reached."""
    import subprocess
    import sys

    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    hold = (
        "import sys, time\nfrom esmc_mlx.outputs import output_lock\n"
        "with output_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n"
    )
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-c", hold, str(artifact)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "locked"
        result = CliRunner().invoke(main, ["push", str(artifact), "alice/tiny"])
        assert result.exit_code == 1 and f"PID {proc.pid}" in result.output, result.output
        assert hub.state.log == [] and "alice/tiny" not in hub.state.repos
    finally:
        proc.kill()
        proc.wait()


def test_push_goes_on_unlocked_where_no_lock_can_be_made(hub, checkpoints, tmp_path, monkeypatch):
    """push only reads the artifact (and writes its card inside it): in a folder this user may
    not write in, where no run can replace the artifact either, it needs no lock. chmod cannot
    show that to root, so os.open refuses the lock file here."""
    artifact = make_artifact(str(checkpoints["published"]), tmp_path / "a")
    real_open = os.open

    def refusing(path, *args, **kwargs):
        if Path(path).parent == Path(artifact).parent and str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    result = CliRunner().invoke(main, ["push", str(artifact), "alice/tiny"])
    assert result.exit_code == 0, result.output
    assert "alice/tiny" in hub.state.repos


def test_server_ids_are_git_object_ids():
    assert Blob.regular(b"hello\n").oid == "ce013625030ba8dba906f756967f9e9ca394464a"  # git hash-object
    if shutil.which("git"):
        import subprocess

        out = subprocess.run(["git", "hash-object", "--stdin"], input=b"x" * 1000, capture_output=True, check=True)
        assert Blob.regular(b"x" * 1000).oid == out.stdout.decode().strip()
