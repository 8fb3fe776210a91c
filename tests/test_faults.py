"""The fault battery of docs/reliability.md ("Nothing lost, nothing leaked"): each case asserts
the exit code, the message and the state of the disk afterwards (old output byte-identical, no
debris).

Sections follow its rules: 1 --force, 2 old output until proven, 3 locks, 4 the index,
5 bad numbers, 6 debris (with a real SIGKILL), 7 one Error line, 8 real inputs and the umask.
docs/reliability.md has the table.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
from fault_tools import (
    DEAD,
    cli,
    convert_cli,
    dead_staging,
    debris,
    one_error_line,
    rewrite_header,
    small_disk,  # noqa: F401  (fixture)
    snapshot,
    visible,
)
from safetensors.torch import load_file, save_file

import esmc_mlx
from esmc_mlx import outputs, pipeline, settings, testing
from esmc_mlx.convert import convert
from esmc_mlx.errors import ConvertError, EsmcMlxWarning, OutputError, SequenceError, ValidationError
from esmc_mlx.tasks.fasta import read_fasta
from esmc_mlx.tasks.jobs import resolve_sequence

SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"


# --- helpers ---------------------------------------------------------------------------------------
@pytest.fixture
def old_output(checkpoints, tmp_path):
    """An esmc-mlx output that later runs must not lose: (path, snapshot)."""
    out = convert(str(checkpoints["published"]), tmp_path / "out", progress=False)
    return out, snapshot(out)


def edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


# --- rule 1: --force replaces only what esmc-mlx wrote ----------------------------------------------
def test_force_refuses_a_users_directory(checkpoints, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a week of notes")
    before = snapshot(out)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    one_error_line(result, str(out), "esmc-mlx did not write it", "--force will not replace")
    assert snapshot(out) == before and debris(tmp_path) == []


def test_force_refuses_an_output_holding_a_users_file(old_output, checkpoints, tmp_path):
    out, _ = old_output
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    one_error_line(result, "notes.txt", "esmc-mlx did not write", "move them out")
    assert snapshot(out) == before and debris(tmp_path) == []


def test_force_refuses_a_regular_file_and_a_link(checkpoints, tmp_path):
    target = tmp_path / "results.csv"
    target.write_text("id,score\n")
    result = convert_cli(checkpoints["published"], "-o", target, "--force", "--no-validate")
    one_error_line(result, "it is a file")
    assert target.read_text() == "id,score\n"
    link = tmp_path / "link"
    link.symlink_to(checkpoints["published"])
    result = convert_cli(checkpoints["published"], "-o", link, "--force", "--no-validate")
    assert result.exit_code == 1 and "Error:" in result.output
    assert link.is_symlink() and debris(tmp_path) == []


@pytest.mark.parametrize("where", [".", ".."])
def test_force_refuses_the_current_directory_and_its_parents(old_output, checkpoints, monkeypatch, where):
    out, before = old_output
    monkeypatch.chdir(out)
    result = convert_cli(checkpoints["published"], "-o", where, "--force", "--no-validate")
    one_error_line(result, "current directory")
    assert snapshot(out) == before and debris(out, out.parent) == []


def test_force_refuses_the_source_itself_and_a_folder_holding_it(old_output, checkpoints, tmp_path):
    out, before = old_output
    # quantizing (or converting) an output onto itself: the conversion would read what it replaces
    result = cli("quantize", out, "-o", out, "--q", "4", "--force")
    one_error_line(result, "is the input")
    result = convert_cli(out, "-o", out, "--force", "--no-validate")
    one_error_line(result, "is the input")
    assert snapshot(out) == before
    # an output folder that holds the checkpoint being converted
    outer = tmp_path / "outer"
    convert(str(checkpoints["published"]), outer, progress=False)
    shutil.copytree(checkpoints["published"], outer / "ckpt")
    result = convert_cli(outer / "ckpt", "-o", outer, "--force", "--no-validate")
    one_error_line(result, str(outer / "ckpt"), "contains the input")
    assert (outer / "ckpt" / "model.safetensors").exists() and debris(tmp_path) == []


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_an_output_inside_its_input_is_refused(old_output, command):
    # a model written inside the model it read would be carried along by OUT's loads and uploads
    out, before = old_output
    entries = sorted(out.rglob("*"))
    for inner in (out / "sub", out / "a" / "b"):
        if command == "convert":
            result = convert_cli(out, "-o", inner, "--q", "8", "--no-validate")
        else:
            result = cli("quantize", out, "-o", inner, "--q", "8")
        one_error_line(result, f"the output {inner} is inside the input {out.resolve()}")
    assert snapshot(out) == before and sorted(out.rglob("*")) == entries


def test_force_replaces_an_esmc_mlx_output_and_one_from_before_the_marker(old_output, checkpoints, tmp_path):
    out, before = old_output
    marker = json.loads((out / outputs.MARKER).read_text())
    assert marker["written_by"] == "esmc-mlx" and "config.json" in marker["entries"]
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--dtype", "float16", "--no-validate")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16" and snapshot(out) != before
    (out / outputs.MARKER).unlink()  # an output written before the marker existed
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    assert result.exit_code == 0, result.output
    assert (out / outputs.MARKER).exists() and debris(tmp_path) == []


def test_force_knows_what_validate_and_push_add_and_keeps_a_hand_written_card(old_output, checkpoints, tmp_path):
    from esmc_mlx.artifact import GENERATED_CARD_LINE

    out, _ = old_output
    (out / "validation").mkdir()
    (out / "validation" / "report.json").write_text("{}")
    (out / "README.md").write_text(f"# card\n\n{GENERATED_CARD_LINE}\n")  # what push generates
    assert convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate").exit_code == 0
    (out / "README.md").write_text("# My own card, a day of work\n")
    before = snapshot(out)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    one_error_line(result, "README.md", "esmc-mlx did not write")
    assert snapshot(out) == before


def test_force_keeps_a_users_file_inside_the_report_folder(old_output, checkpoints, tmp_path):
    out, _ = old_output
    (out / "validation").mkdir()
    (out / "validation" / "report.json").write_text("{}")
    outputs.add_to_marker(out, "validation")  # as validate records it, or a validated conversion
    (out / "validation" / "my_analysis.ipynb").write_text("a day of work")
    before = snapshot(out)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    one_error_line(result, "validation/my_analysis.ipynb", "esmc-mlx did not write")
    assert snapshot(out) == before and debris(tmp_path) == []


def test_without_force_an_existing_output_is_refused_before_any_work(old_output, checkpoints, monkeypatch):
    out, before = old_output
    monkeypatch.setattr("esmc_mlx.convert.resolve", lambda *a: pytest.fail("resolved the source"))
    result = convert_cli("300M", "-o", out, "--no-validate")
    one_error_line(result, "already exists", "--force")
    assert snapshot(out) == before


# --- rule 2: the old output stays until the new one is proven -----------------------------------------
def _failing_validation(monkeypatch, passed=False, crash=False):
    """The pipeline's policy is under test, not validation itself (tests/test_validate.py): a
    validation that writes its report into the directory it is given and passes or fails."""

    def validate(directory, source, **kwargs):
        if crash:
            raise ValidationError("the reference could not be read")
        (Path(directory) / "validation").mkdir()
        (Path(directory) / "validation" / "report.json").write_text(json.dumps({"passed": passed}))
        return SimpleNamespace(
            passed=passed,
            failed=[] if passed else [SimpleNamespace(name="kl_mean")],
            summary=lambda: f"Validation {'PASSED' if passed else 'FAILED'}",
            directory=Path(directory) / "validation",
        )

    monkeypatch.setattr(pipeline, "validate", validate)
    monkeypatch.setattr(pipeline, "validation_available", lambda: True)


def test_failed_validation_keeps_the_old_output_and_puts_the_new_one_beside_it(
    old_output, checkpoints, tmp_path, monkeypatch
):
    out, before = old_output
    _failing_validation(monkeypatch)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--dtype", "float16")
    line = one_error_line(result, "validation failed (kl_mean)", f"The old {out} is unchanged", "out.failed-")
    assert snapshot(out) == before
    failed = [p for p in tmp_path.iterdir() if p.name.startswith("out.failed-")]
    assert len(failed) == 1 and str(failed[0]) in line
    assert (failed[0] / "validation" / "report.json").exists() and (failed[0] / outputs.MARKER).exists()
    assert json.loads((failed[0] / "config.json").read_text())["dtype"] == "float16"
    assert debris(tmp_path) == []


def test_a_failed_validation_without_an_old_output_stays_where_asked(checkpoints, tmp_path, monkeypatch):
    _failing_validation(monkeypatch)
    out = tmp_path / "new"
    result = convert_cli(checkpoints["published"], "-o", out)
    one_error_line(result, "validation failed (kl_mean)", f"stays at {out}", "will not be uploaded")
    assert (out / "validation" / "report.json").exists() and (out / outputs.MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]


def test_a_crash_in_validation_keeps_the_old_output(old_output, checkpoints, tmp_path, monkeypatch):
    out, before = old_output
    _failing_validation(monkeypatch, crash=True)
    result = convert_cli(checkpoints["published"], "-o", out, "--force")
    one_error_line(result, "could not be read")
    assert snapshot(out) == before and debris(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_passing_validation_swaps_in_the_validated_artifact(old_output, checkpoints, tmp_path, monkeypatch):
    out, before = old_output
    _failing_validation(monkeypatch, passed=True)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--dtype", "float16")
    assert result.exit_code == 0, result.output
    assert f"Report: {out / 'validation' / 'report.md'}" in result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert "validation" in json.loads((out / outputs.MARKER).read_text())["entries"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_ctrl_c_during_conversion_keeps_the_old_output(old_output, checkpoints, tmp_path, monkeypatch):
    out, before = old_output

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("esmc_mlx.convert.write_config", interrupted)  # after every shard was written
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    assert result.exit_code == 1 and "Traceback" not in result.output and "Aborted" not in result.output
    assert f"Stopped (Ctrl-C): {out} is as it was." in result.output, result.output
    assert snapshot(out) == before and debris(tmp_path) == []


def test_ctrl_c_between_the_two_renames_puts_the_old_output_back(old_output, checkpoints, tmp_path, monkeypatch):
    """The swap is two renames (old aside, new in): an interrupt between them must not leave OUT
    missing, the old output hidden as .out.old-* until a later run on that path."""
    out, before = old_output
    replace = os.replace

    def interrupted_swap(src, dst):
        if Path(dst) == out and Path(src).name.startswith(".out.partial-"):  # the new output going in
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(outputs.os, "replace", interrupted_swap)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Stopped (Ctrl-C): {out} is as it was." in result.output, result.output
    assert snapshot(out) == before and debris(tmp_path) == []


def test_a_nan_source_with_force_keeps_the_old_output(old_output, checkpoints, tmp_path):
    out, before = old_output
    bad = edited_checkpoint(
        checkpoints["published"],
        tmp_path / "nan",
        lambda s: s["esmc.layers.1.mlp.down_proj.weight"].__setitem__((3, 5), float("nan")),
    )
    result = convert_cli(bad, "-o", out, "--force", "--no-validate")
    one_error_line(result, "esmc.layers.1.mlp.down_proj.weight", "NaN or Inf")
    assert snapshot(out) == before and debris(tmp_path) == []


# --- rule 3: two runs never silently overwrite each other ---------------------------------------------
HOLD_LOCK = """
import sys, time
from esmc_mlx.outputs import output_lock
with output_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def locked_by_other_process(tmp_path):
    """Lock tmp_path/out from another process, as a second esmc-mlx run would see it."""
    procs = []

    def hold(target):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(target)],
            stdout=subprocess.PIPE,
            text=True,
            env=testing.child_env(),
        )
        assert proc.stdout.readline().strip() == "locked"
        procs.append(proc)
        return proc.pid

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_conversion_to_the_same_output_fails_naming_the_holder(
    old_output, checkpoints, tmp_path, locked_by_other_process
):
    out, before = old_output
    pid = locked_by_other_process(out)
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    one_error_line(result, str(out), "being written by another esmc-mlx run", f"PID {pid}")
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_two_real_conversions_to_one_output(tmp_path):
    """Two esmc-convert processes started together: one writes, the other stops with a message
    (the lock's, or "already exists" when the first finished before it got there); never two
    "Wrote" lines for one directory."""
    src = testing.write_random_checkpoint(tmp_path / "src", testing.tiny_config(**KILL_CONFIG), dtype="float32")
    env = testing.child_env()
    command = [
        *testing.console_command("esmc-convert"),
        str(src),
        "-o",
        str(tmp_path / "out"),
        "--no-validate",
        "--shard-size",
        "8MB",
    ]
    procs = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(rc for rc, _, _ in results) == [0, 1], results
    loser = next(err for rc, _, err in results if rc == 1)
    assert "being written by another esmc-mlx run (PID" in loser or "already exists" in loser, loser
    assert sum("Wrote" in out for _, out, _ in results) == 1
    assert esmc_mlx.load(tmp_path / "out")[0] is not None
    assert debris(tmp_path) == []


def test_a_lock_is_per_path_and_released_after_errors(checkpoints, tmp_path):
    with outputs.output_lock(tmp_path / "a"):
        with pytest.raises(OutputError, match=f"PID {os.getpid()}"):
            convert(str(checkpoints["published"]), tmp_path / "a", progress=False)
        convert(str(checkpoints["published"]), tmp_path / "b", progress=False)  # another path: free
    with pytest.raises(ConvertError):
        convert(str(tmp_path / "missing"), tmp_path / "c", progress=False)
    with outputs.output_lock(tmp_path / "c"):  # released although the run failed
        pass
    assert debris(tmp_path) == []


def test_score_and_embed_take_the_lock_too(converted, tmp_path, locked_by_other_process):
    csv_in = tmp_path / "dms.csv"
    csv_in.write_text("mutant,DMS_score\nM1A,0.5\nK2R,0.1\n")
    scored = tmp_path / "scored.csv"
    pid = locked_by_other_process(scored)
    result = cli("score", converted, "--sequence", SEQ, "--mutations", csv_in, "-o", scored, "--no-progress")
    one_error_line(result, f"PID {pid}")
    assert not scored.exists()
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    pid = locked_by_other_process(tmp_path / "emb")
    result = cli("embed", converted, fasta, "-o", tmp_path / "emb", "--no-progress")
    one_error_line(result, f"PID {pid}")
    assert not (tmp_path / "emb").exists()


def test_validate_takes_the_artifacts_lock(old_output, checkpoints, tmp_path, locked_by_other_process):
    """A conversion replacing OUT holds OUT's lock; validate must not write its report into OUT
    meanwhile (a report of the old weights beside the new ones, which push would publish)."""
    out, before = old_output
    pid = locked_by_other_process(out)
    result = cli("validate", out, "--reference", checkpoints["published"], "--quick")
    one_error_line(result, f"PID {pid}")
    assert snapshot(out) == before


@pytest.fixture
def read_only_folder(monkeypatch):
    """read_only_folder(F): no lock file can be made in F (EACCES), as in a folder this user may
    not write in (chmod cannot show that to root, so os.open refuses them here)."""
    real_open = os.open

    def make(folder: Path):
        def refusing(path, *args, **kwargs):
            if Path(path).parent == folder and str(path).endswith(".lock"):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(outputs.os, "open", refusing)

    return make


def test_validate_goes_on_unlocked_where_no_lock_can_be_made(old_output, checkpoints, tmp_path, read_only_folder):
    """validate only writes inside MLX_DIR: where the folder holding it is read-only, no run
    can replace MLX_DIR either, so the lock is not needed; a conversion there still fails."""
    out, _ = old_output
    read_only_folder(out.parent)
    result = cli("validate", out, "--reference", checkpoints["published"], "--quick")
    assert result.exit_code == 0, result.output
    assert (out / "validation" / "report.json").is_file()
    result = convert_cli(checkpoints["published"], "-o", tmp_path / "other", "--no-validate")
    one_error_line(result, "Permission denied")
    assert not (tmp_path / "other").exists()


# --- rule 4: a model directory means exactly what its index says --------------------------------------
def test_converter_refuses_a_stray_safetensors_beside_indexed_shards(tmp_path, tiny_config):
    src = testing.write_random_checkpoint(tmp_path / "src", tiny_config, dtype="float32", shard_bytes=1 << 20)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shutil.copy(shards[0], src / "model_old.safetensors")
    result = convert_cli(src, "-o", tmp_path / "out", "--no-validate")
    one_error_line(result, "model_old.safetensors", "not named by model.safetensors.index.json")
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_quantize_info_validate_and_load_refuse_a_stray_file_in_an_artifact(old_output, checkpoints, tmp_path):
    out, _ = old_output
    shutil.copy(out / "model.safetensors", out / "model_old.safetensors")
    for result in (
        cli("quantize", out, "-o", tmp_path / "q4", "--q", "4"),
        cli("info", out),
        cli("validate", out, "--reference", checkpoints["published"]),
    ):
        one_error_line(result, "model_old.safetensors")
    with pytest.raises(ConvertError, match="model_old.safetensors"):
        esmc_mlx.load(out)
    assert not (tmp_path / "q4").exists() and debris(tmp_path) == []


def _copy_into_the_last_shard(directory: Path) -> str:
    """Put a tensor of the first shard, changed, into the last one too (the index still names the
    first): which copy a reader takes must not depend on the order it reads the files in."""
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1
    first, last = load_file(str(shards[0])), load_file(str(shards[-1]))
    name = sorted(first)[0]
    last[name] = first[name] + 5
    save_file(last, str(shards[-1]), metadata={"format": "pt"})
    return name


def test_a_tensor_in_two_shards_is_refused(checkpoints, converted, tmp_path, tiny_config):
    src = testing.write_random_checkpoint(tmp_path / "src", tiny_config, dtype="float32", shard_bytes=1 << 20)
    name = _copy_into_the_last_shard(src)
    result = convert_cli(src, "-o", tmp_path / "out", "--no-validate")  # was: converted the last shard's copy
    one_error_line(result, f"tensor {name} is also in")
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []
    art = tmp_path / "art"
    assert convert_cli(checkpoints["published"], "-o", art, "--shard-size", "1MB", "--no-validate").exit_code == 0
    name = _copy_into_the_last_shard(art)
    with pytest.raises(ConvertError, match=f"tensor {name} is also in"):
        esmc_mlx.load(art)
    one_error_line(cli("info", art), f"tensor {name} is also in")  # was: its bytes counted twice


def test_several_safetensors_without_an_index_are_refused(checkpoints, tmp_path):
    src = shutil.copytree(checkpoints["esm"], tmp_path / "src")
    shutil.copy(src / "model.safetensors", src / "extra.safetensors")
    result = convert_cli(src, "-o", tmp_path / "out", "--no-validate")
    one_error_line(result, "2 .safetensors files", "extra.safetensors", "no model.safetensors.index.json")


# --- rule 5: bad numbers are caught where they enter --------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_in_the_source_fails_naming_the_tensor(checkpoints, tmp_path, value):
    bad = edited_checkpoint(
        checkpoints["published"],
        tmp_path / "bad",
        lambda s: s["esmc.layers.0.self_attn.q_proj.weight"].__setitem__((0, 0), value),
    )
    result = convert_cli(bad, "-o", tmp_path / "out", "--no-validate")
    one_error_line(result, "esmc.layers.0.self_attn.q_proj.weight", "1 NaN or Inf value(s)", "damaged")
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_nan_in_a_fused_legacy_tensor_names_the_checkpoint_tensor(reference_model, tmp_path):
    model = testing.random_transformers_model(testing.tiny_config(), seed=1)
    with torch.no_grad():
        model.esmc.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    pth = testing.write_checkpoint(model, tmp_path / "legacy" / "esmc.pth", "legacy")
    result = convert_cli(pth, "-o", tmp_path / "out", "--no-validate")
    one_error_line(result, "transformer.blocks.1.ffn.1.weight", "NaN or Inf")  # the fused gate/up tensor
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_a_cast_that_overflows_float16_is_refused(checkpoints, tmp_path):
    bad = edited_checkpoint(
        checkpoints["published"], tmp_path / "big", lambda s: s["lm_head.dense.weight"].__setitem__((1, 1), 1e6)
    )
    result = convert_cli(bad, "-o", tmp_path / "out", "--dtype", "float16", "--no-validate")
    one_error_line(result, "lm_head.dense.weight", "overflows float16", "1e+06")
    assert convert_cli(bad, "-o", tmp_path / "out", "--no-validate").exit_code == 0  # float32 holds it


def test_an_empty_sequence_is_an_error_everywhere(converted, tmp_path):
    model = esmc_mlx.load(converted)[0]
    with pytest.raises(SequenceError, match="empty sequence"):
        model.embed([SEQ, ""])
    fasta = tmp_path / "empty.fasta"
    fasta.write_text(">a\nMKT\n>b\n\n>c\nACD\n")
    result = cli("embed", converted, fasta, "-o", tmp_path / "emb", "--no-progress")
    one_error_line(result, "'b'", "no sequence")
    assert not (tmp_path / "emb").exists() and debris(tmp_path) == []
    (tmp_path / "m.csv").write_text("mutant\nM1A\n")
    for wt in ("", "   ", "*"):
        result = cli("score", converted, "--sequence", wt, "--mutations", tmp_path / "m.csv", "--no-progress")
        assert result.exit_code == 1 and "Error:" in result.output and "Traceback" not in result.output


def test_inputs_longer_than_training_warn_before_the_work(converted, tmp_path):
    model = esmc_mlx.load(converted)[0]
    rng = np.random.default_rng(0)
    long = "".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), 2100))
    with pytest.warns(
        EsmcMlxWarning, match="2,100 residues is longer than the 2,046 residues \\(2,048 tokens\\) ESMC was trained on"
    ):
        emb = model.embed(long)
    assert np.isfinite(emb.mean).all()
    # 20,000 residues: the warning (slow, memory) comes before any forward pass
    huge = "A" * 20000
    with warnings.catch_warnings():
        warnings.simplefilter("error", EsmcMlxWarning)
        with pytest.raises(EsmcMlxWarning, match=r"20,000 residues.*slow.*GB"):
            model.embed(huge)
    fasta = tmp_path / "long.fasta"
    fasta.write_text(f">long\n{long}\n")
    result = cli("embed", converted, fasta, "-o", tmp_path / "emb", "--no-progress")
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if line.startswith("Warning:")]
    assert len(warned) == 1 and "2,100 residues" in warned[0]


# --- rule 6: no debris -------------------------------------------------------------------------------
KILL_CONFIG = dict(hidden_size=512, num_attention_heads=8, num_hidden_layers=8, intermediate_size=1536)


def test_a_killed_conversion_is_cleaned_up_and_named_by_the_next_run(tmp_path):
    src = testing.write_random_checkpoint(tmp_path / "src", testing.tiny_config(**KILL_CONFIG), dtype="float32")
    out = tmp_path / "out"
    env = testing.child_env()
    command = [
        *testing.console_command("esmc-convert"),
        str(src),
        "-o",
        str(out),
        "--no-validate",
        "--shard-size",
        "1MB",
    ]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        staged = [p for p in tmp_path.glob(".out.partial-*") if list(p.glob("shard-*"))]
        if staged:
            staging = staged[0]
            break
        time.sleep(0.005)
    assert staging is not None, "the conversion finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert staging.exists() and not out.exists()  # what a kill leaves: the staging (and maybe the lock file)
    assert staging.name.startswith(f".out.partial-{proc.pid}-")
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"Warning: removed {staging}" in result.stderr and f"PID {proc.pid}" in result.stderr
    assert "Traceback" not in result.stderr
    assert debris(tmp_path) == [] and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_a_terminated_conversion_cleans_up_itself(tmp_path):
    """SIGTERM (a scheduler's time limit) unwinds like Ctrl-C: the run removes its own staging."""
    src = testing.write_random_checkpoint(tmp_path / "src", testing.tiny_config(**KILL_CONFIG), dtype="float32")
    env = testing.child_env()
    command = [
        *testing.console_command("esmc-convert"),
        str(src),
        "-o",
        str(tmp_path / "out"),
        "--no-validate",
        "--shard-size",
        "1MB",
    ]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if [p for p in tmp_path.glob(".out.partial-*") if list(p.glob("shard-*"))]:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the conversion finished before it could be terminated"
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    out = tmp_path / "out"
    assert proc.returncode == 1 and f"Stopped (SIGTERM): {out} was not written." in err and "Traceback" not in err, err
    assert debris(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_console_command_runs_the_script_without_an_install(monkeypatch, tmp_path):
    """A checkout run without `pip install` (the GPU machine's) has no console scripts on PATH:
    the tests above then start the same entry point with this Python, under the script's name."""
    monkeypatch.setenv("PATH", str(tmp_path))
    command = testing.console_command("esmc-mlx")
    assert command[0] == sys.executable
    done = subprocess.run([*command, "--version"], env=testing.child_env(), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("esmc-mlx, version"), done.stderr


def test_leftovers_are_known_by_their_mark_and_a_half_swapped_output_goes_back(old_output, checkpoints, tmp_path):
    out, before = old_output
    staged = outputs.make_staging(tmp_path, "out", "partial")  # its marker names it and this process
    dead = tmp_path / f".out.partial-{DEAD}-abcdef"
    staged.rename(dead)  # the name it was made under no longer matches: not a leftover any more
    (dead / "shard-0.tmp.safetensors").write_bytes(b"\0" * 100)
    leftover = dead_staging(tmp_path, "out", "partial")
    (leftover / "shard-0.tmp.safetensors").write_bytes(b"\0" * 100)
    unmarked = tmp_path / ".out.partial-k3j_x9a2"  # a name alone decides nothing
    unmarked.mkdir()
    (unmarked / "notes.txt").write_text("mine")
    with pytest.warns(EsmcMlxWarning, match=f"removed {re.escape(str(leftover))}"):
        convert(str(checkpoints["published"]), out, force=True, progress=False)
    assert not leftover.exists() and (unmarked / "notes.txt").read_text() == "mine" and dead.exists()
    # a run killed between its two renames: the old output sits aside and OUT is missing
    aside = dead_staging(tmp_path, "out", "old")
    os.replace(out, aside / "out")
    kept = snapshot(aside / "out")
    with pytest.warns(EsmcMlxWarning, match="restored"):
        with pytest.raises(OutputError, match="already exists"):
            convert(str(checkpoints["published"]), out, progress=False)  # no --force: the restored one stays
    assert snapshot(out) == kept and not aside.exists()


def test_embed_force_clears_what_it_wrote_and_its_leftovers(converted, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n>b\nACDEFGHIK\n")
    emb = tmp_path / "emb"
    assert cli("embed", converted, fasta, "-o", emb, "--no-progress").exit_code == 0
    dead_staging(emb, "manifest.json", "tmp")  # a manifest being written when the run was killed
    result = cli("embed", converted, fasta, "-o", emb, "--force", "--pool", "max", "--no-progress")
    assert result.exit_code == 0 and "Warning: removed" in result.output, result.output
    assert visible(emb) == ["index.tsv", "manifest.json", "max.npy"] and debris(emb) == []
    # what a version without the marker left (parts/, a temporary manifest) is not esmc-mlx's by
    # its names: the folder is refused, untouched
    old = tmp_path / "old"
    (old / "parts").mkdir(parents=True)
    (old / ".manifest.json.tmp").write_text('{"form')
    before = snapshot(old)
    for extra in ([], ["--force"]):
        one_error_line(cli("embed", converted, fasta, "-o", old, "--no-progress", *extra), str(old), "did not make")
    assert snapshot(old) == before and sorted(p.name for p in old.iterdir()) == [".manifest.json.tmp", "parts"]
    # a directory of someone else's is never cleared, with or without --force
    other = tmp_path / "other"
    other.mkdir()
    (other / "parts").mkdir()
    for manifest in ('{"format": "something-else"}', "[]"):  # [] was an AttributeError traceback
        (other / "manifest.json").write_text(manifest)
        before = snapshot(other)
        for extra in ([], ["--force"]):
            result = cli("embed", converted, fasta, "-o", other, "--no-progress", *extra)
            one_error_line(result, str(other))
        assert snapshot(other) == before


def test_embed_never_clears_or_overwrites_a_users_arrays(converted, tmp_path):
    """Names like mean.npy or index.tsv are an embeddings directory's only when its manifest
    says so: a folder of the user's arrays is neither cleared by --force nor written into."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n>b\nACDEFGHIK\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    np.save(mine / "mean.npy", np.arange(5))
    (mine / "index.tsv").write_text("my own index\n")
    (mine / "parts").mkdir()
    (mine / "parts" / "notes.txt").write_text("mine")
    before = snapshot(mine)
    for extra in ([], ["--force"]):
        result = cli("embed", converted, fasta, "-o", mine, "--no-progress", *extra)
        one_error_line(result, str(mine))
        assert snapshot(mine) == before
    # in an embeddings directory, an array its manifest does not name is the user's too
    emb = tmp_path / "emb"
    assert cli("embed", converted, fasta, "-o", emb, "--no-progress").exit_code == 0
    np.save(emb / "umap.npy", np.arange(3))
    result = cli("embed", converted, fasta, "-o", emb, "--no-progress", "--force", "--pool", "max")
    one_error_line(result, "--force will not clear", "umap.npy")
    assert (emb / "umap.npy").exists() and (emb / "mean.npy").exists()
    (emb / "umap.npy").unlink()
    result = cli("embed", converted, fasta, "-o", emb, "--no-progress", "--force", "--pool", "max")
    assert result.exit_code == 0, result.output
    assert visible(emb) == ["index.tsv", "manifest.json", "max.npy"]


@pytest.mark.parametrize(
    "storage,name,damage",
    [("safetensors", "embeddings.safetensors.index.json", "[]"), ("npy", "index.tsv", "id\tlength\tsha1\na\n")],
)
def test_damaged_merged_embeddings_are_computed_again(converted, tmp_path, storage, name, damage):
    """A merged file damaged since its merge (an index that is a JSON list, a cut line in
    index.tsv) made every rerun fail with a TypeError / ValueError traceback."""
    from esmc_mlx.tasks.store import read_embeddings

    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n>b\nACDEFGHIK\n")
    emb = tmp_path / "emb"
    args = ("embed", converted, fasta, "-o", emb, "--format", storage, "--no-progress")
    assert cli(*args).exit_code == 0
    want = np.asarray(read_embeddings(emb).mean)
    (emb / name).write_text(damage)
    result = cli(*args)
    assert result.exit_code == 0 and "Embedded 2 sequences (0 already done" in result.output, result.output
    np.testing.assert_allclose(np.asarray(read_embeddings(emb).mean), want, atol=1e-6)


@pytest.mark.parametrize("content", [b"PK\x03\x04cut", b"\x80\x04pickled", b"\x93NUMPY\x01\x00"])
def test_a_damaged_part_is_one_error_naming_it(converted, tmp_path, content):
    """A part that is not what write_part wrote (cut, or another file under its name) made every
    rerun fail with a ValueError / BadZipFile traceback."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n>b\nACDEFGHIK\n")
    emb = tmp_path / "emb"
    assert cli("embed", converted, fasta, "-o", emb, "--no-progress").exit_code == 0
    manifest = json.loads((emb / "manifest.json").read_text())
    (emb / "manifest.json").write_text(json.dumps(dict(manifest, complete=False)))
    (emb / "parts").mkdir()
    part = emb / "parts" / "part-20261201T000000-abcdef-000001.npz"
    part.write_bytes(content)
    before = snapshot(emb)
    result = cli("embed", converted, fasta, "-o", emb, "--no-progress")
    line = one_error_line(result, str(part), "move it out")
    assert "allow_pickle" not in line and "unsafely" not in line  # numpy's advice is not repeated
    after = snapshot(emb)
    assert {k: v for k, v in after.items() if k != "manifest.json"} == {
        k: v for k, v in before.items() if k != "manifest.json"
    }


def test_temporary_files_of_killed_jobs_are_removed_by_the_next_run(converted, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    emb = tmp_path / "emb"
    assert cli("embed", converted, fasta, "-o", emb, "--no-progress").exit_code == 0
    (emb / "parts").mkdir()
    dead_staging(emb / "parts", "part-x.npz", "tmp")
    dead_staging(emb, "manifest.json", "tmp")
    csv_in = tmp_path / "m.csv"
    csv_in.write_text("mutant\nM1A\n")
    scored_tmp = dead_staging(tmp_path, "scored.csv", "tmp")
    # files named as esmc-mlx names its temporary files, without its mark: the user's
    lookalikes = [emb / f".manifest.json.tmp-{DEAD}-abcdef", tmp_path / f".scored.csv.tmp-{DEAD}-abcdef"]
    for path in lookalikes:
        path.write_text("mine")
    result = cli("embed", converted, fasta, "-o", emb, "--no-progress")
    assert result.exit_code == 0 and result.output.count("Warning: removed") == 2, result.output
    result = cli(
        "score", converted, "--sequence", SEQ, "--mutations", csv_in, "-o", tmp_path / "scored.csv", "--no-progress"
    )
    assert result.exit_code == 0 and f"removed {scored_tmp}" in result.output, result.output
    assert all(path.read_text() == "mine" for path in lookalikes)
    assert not [p for p in (*tmp_path.iterdir(), *emb.iterdir()) if outputs.staging_mark(p)]
    assert not (emb / "parts").exists()  # its leftover gone, the empty folder went with the merge


def test_a_failed_embed_into_a_new_folder_leaves_nothing(converted, tmp_path, monkeypatch):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "emb" / "parts" / "x"))

    monkeypatch.setattr(np, "savez", full)
    result = cli("embed", converted, fasta, "-o", tmp_path / "emb", "--no-progress")
    one_error_line(result, "the disk is full", "part-")
    assert debris(tmp_path / "emb", tmp_path / "emb" / "parts", tmp_path) == []


def test_score_leaves_no_temporary_file_when_writing_fails(converted, tmp_path, monkeypatch):
    csv_in = tmp_path / "dms.csv"
    csv_in.write_text("mutant\nM1A\n")
    scored = tmp_path / "scored.csv"
    scored.write_text("old results\n")
    import csv as csv_module

    def broken_writerow(self, row):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(csv_module.DictWriter, "writerow", broken_writerow)
    args = ("score", converted, "--sequence", SEQ, "--mutations", csv_in, "-o", scored, "--no-progress")
    result = cli(*args, "--force")  # (the old file is the user's: replaced only with --force)
    one_error_line(result, "the disk is full", "scored.csv")
    assert scored.read_text() == "old results\n" and debris(tmp_path) == []


def test_disk_full_during_conversion_is_one_line_naming_the_file(old_output, checkpoints, tmp_path, monkeypatch):
    out, before = old_output

    def full(path, arrays, metadata=None):
        Path(path).write_bytes(b"\0" * 10)  # a partial shard, as a real full disk leaves
        raise RuntimeError("[write] Unable to write 8 bytes to file.")  # what MLX says, without errno

    monkeypatch.setattr(mx, "save_safetensors", full)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 100, 0))
    result = convert_cli(checkpoints["published"], "-o", out, "--force", "--no-validate")
    one_error_line(result, "the disk is full", "shard-0.tmp.safetensors", "nothing was left behind")
    assert snapshot(out) == before and debris(tmp_path) == []


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_a_really_full_disk(small_disk, checkpoints, tmp_path):
    result = convert_cli(checkpoints["published"], "-o", small_disk / "out", "--no-validate")
    one_error_line(result, "the disk is full", str(small_disk))
    assert list(small_disk.iterdir()) == []
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\n{SEQ * 10}\n" for i in range(100)))
    model = convert(str(checkpoints["published"]), tmp_path / "model", progress=False)
    result = cli("embed", model, fasta, "-o", small_disk / "emb", "--per-residue", "--no-progress")
    one_error_line(result, "the disk is full")
    assert debris(small_disk, small_disk / "emb", small_disk / "emb" / "parts") == []


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_a_disk_that_fills_during_the_embed_merge(small_disk, tmp_path):
    """The parts fit and the merged copy does not. The merge wrote through a memory map into a
    sparse file: the process died of SIGBUS (rc 135 from a shell) with `.merge/` and its lock
    left. Now the space is reserved first: one Error line, the parts kept, and once the disk has
    room a rerun merges them without embedding anything again."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\n{SEQ}{SEQ[:16]}\n" for i in range(11)))  # 11 x 49 residues x 256 x 4 B
    tiny = Path(esmc_mlx.__file__).parent / "data" / "esmc-tiny"
    command = [*testing.console_command("esmc-mlx"), "embed", str(tiny), str(fasta), "-o", str(small_disk / "emb")]
    env = testing.child_env()
    run = lambda: subprocess.run([*command, "--per-residue", "--no-progress"], env=env, capture_output=True, text=True)  # noqa: E731
    first = run()
    assert first.returncode == 1, (first.returncode, first.stderr)  # not -7 (SIGBUS)
    assert first.stderr.count("Error:") == 1 and "the disk is full" in first.stderr and "Traceback" not in first.stderr
    assert debris(small_disk, small_disk / "emb") == [] and len(list((small_disk / "emb" / "parts").iterdir())) == 1
    subprocess.run(["mount", "-o", "remount,size=2m", str(small_disk)], check=True)
    second = run()
    assert second.returncode == 0 and "Embedded 0 sequences (11 already done" in second.stdout, second.stderr
    assert np.load(small_disk / "emb" / "per_residue.npy").shape == (11 * 49, 256)
    assert not (small_disk / "emb" / "parts").exists()


# --- rule 7: every failure is one Error line -----------------------------------------------------------
def _with_header(src: Path, dst: Path, edit) -> Path:
    """A copy of a checkpoint whose safetensors header was edited (the data left as is)."""
    shutil.copytree(src, dst)
    rewrite_header(dst / "model.safetensors", edit)
    return dst


NAME = "esmc.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda h: h[NAME].__setitem__("dtype", "F16"), "needs"),  # dtype/offset mismatch
        (lambda h: h[NAME].pop("data_offsets"), "no valid data_offsets"),
        (lambda h: h[NAME].__setitem__("dtype", "Q4"), "unknown dtype 'Q4'"),
        (lambda h: h[NAME].__setitem__("shape", [512, "x"]), "no valid shape"),
        (lambda h: h[NAME].__setitem__("data_offsets", [10, 5]), "no valid data_offsets"),
    ],
)
def test_malformed_safetensors_headers(checkpoints, tmp_path, edit, message):
    bad = _with_header(checkpoints["published"], tmp_path / "bad", edit)
    result = convert_cli(bad, "-o", tmp_path / "out", "--no-validate")
    one_error_line(result, "corrupt safetensors header", NAME, message)
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.double(), "(F64)"),  # MLX cannot read it: was a RuntimeError traceback
        (lambda t: t.long(), "(I64)"),  # was converted: the weights truncated to integers
        (lambda t: t > 0, "(BOOL)"),
        (lambda t: t[0].clone(), "shape ()"),  # a 0-d tensor: was an IndexError traceback
    ],
)
def test_tensors_of_an_odd_dtype_or_rank(checkpoints, tmp_path, edit, message):
    name = "esmc.norm.weight"
    bad = edited_checkpoint(checkpoints["published"], tmp_path / "bad", lambda st: st.update({name: edit(st[name])}))
    one_error_line(convert_cli(bad, "-o", tmp_path / "out", "--no-validate"), name, message)
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []
    if message == "shape ()":  # the same in a legacy .pth, whose config is inferred from the shapes
        state = torch.load(checkpoints["legacy"], weights_only=True)
        state["transformer.norm.weight"] = edit(state["transformer.norm.weight"])
        torch.save(state, tmp_path / "bad.pth")
        one_error_line(convert_cli(tmp_path / "bad.pth", "-o", tmp_path / "out", "--no-validate"), message)


@pytest.mark.parametrize("text", ["[]", "null", "\udcff"])
def test_a_damaged_hash_memo_only_costs_the_hashing(checkpoints, tmp_path, monkeypatch, text):
    """The memo of source hashes (<cache>/hashes.json) holding a JSON list made every conversion
    fail with a TypeError traceback; the memo is a cache: it is started again."""
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path / "cache"))
    settings.reload()  # read once per process: this test changes it
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "hashes.json").write_text(text, errors="surrogateescape")
    result = convert_cli(checkpoints["published"], "-o", tmp_path / "out", "--no-validate")
    assert result.exit_code == 0, result.output
    assert isinstance(json.loads((tmp_path / "cache" / "hashes.json").read_text()), dict)


@pytest.mark.parametrize("text", ["[]", "null", "3"])
def test_a_checkpoint_config_that_is_not_an_object(checkpoints, tmp_path, text):
    src = shutil.copytree(checkpoints["published"], tmp_path / "src")
    (src / "config.json").write_text(text)  # was: AttributeError: 'list' object has no attribute 'get'
    one_error_line(convert_cli(src, "-o", tmp_path / "o", "--no-validate"), "config.json", "not a JSON object")
    assert not (tmp_path / "o").exists() and debris(tmp_path) == []


@pytest.mark.parametrize(
    "field,value",
    [("num_attention_heads", 0), ("hidden_size", -1), ("num_hidden_layers", "2x"), ("intermediate_size", 1.5)],
)
def test_nonsense_config_values(old_output, checkpoints, tmp_path, field, value):
    src = shutil.copytree(checkpoints["published"], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    one_error_line(convert_cli(src, "-o", tmp_path / "o", "--no-validate"), "config.json", field)
    out, _ = old_output
    artifact = json.loads((out / "config.json").read_text())
    artifact[field] = value
    (out / "config.json").write_text(json.dumps(artifact))
    one_error_line(cli("info", out), "config.json", field)
    with pytest.raises(ConvertError, match=field):
        esmc_mlx.load(out)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda c: c.__setitem__("quantization", {"bits": 4}),
            "quantization: needs positive integers bits and group_size",
        ),
        (lambda c: c.__setitem__("quantization", "yes"), "quantization: not an object"),
        (
            lambda c: c.__setitem__("quantization_config", {"bits": 4, "group_size": 64, "x.y": {"bits": "4"}}),
            "entry 'x.y'",
        ),
        (lambda c: c.__setitem__("esmc_mlx", "converted"), "esmc_mlx is not an object"),
        (lambda c: c.__setitem__("dtype", "int8"), "dtype 'int8' is not one of float32, bfloat16, float16"),
    ],
)
def test_damaged_artifact_config_fields(old_output, tmp_path, edit, message):
    out, _ = old_output
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    for result in (
        cli("info", out),
        cli("embed", out, fasta, "-o", tmp_path / "emb"),
        cli("quantize", out, "-o", tmp_path / "q", "--q", "4"),
    ):
        one_error_line(result, "config.json", message)
    assert not (tmp_path / "emb").exists() and not (tmp_path / "q").exists() and debris(tmp_path) == []


@pytest.mark.parametrize(
    "change", [{"bits": 7}, {"group_size": 48}, {"mode": "mxfp4"}], ids=["bits7", "group48", "mxfp4-g64"]
)
def test_a_quantization_record_mlx_cannot_run(tmp_path, change):
    """A well-formed record MLX refuses (7 bits, a group size the widths do not divide, mxfp4
    with group size 64) is refused where config.json is read, naming the file and MLX's table."""
    out = convert("tiny", tmp_path / "q4", q="4", progress=False)
    config = json.loads((out / "config.json").read_text())
    config["quantization"].update(change)
    (out / "config.json").write_text(json.dumps(config))
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    one_error_line(cli("embed", out, fasta, "-o", tmp_path / "emb"), "config.json", "is not a quantization MLX runs")
    with pytest.raises(ConvertError, match="is not a quantization MLX runs"):
        esmc_mlx.load(out)
    result = cli("validate", out, "--reference", "tiny", "--report", tmp_path / "rep")
    one_error_line(result, "config.json", "is not a quantization MLX runs")
    assert not (tmp_path / "emb").exists() and not (tmp_path / "rep").exists() and debris(tmp_path) == []


def test_an_index_naming_files_elsewhere_is_refused(old_output, tmp_path):
    out, _ = old_output
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.replace(out / "model.safetensors", elsewhere / "model.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "../elsewhere/model.safetensors" for k in index["weight_map"]}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    one_error_line(cli("info", out), "names files outside its directory", "../elsewhere/model.safetensors")
    with pytest.raises(ConvertError, match="outside its directory"):
        esmc_mlx.load(out)
    one_error_line(convert_cli(out, "-o", tmp_path / "o"), "outside its directory")


def test_info_on_folders_that_are_not_models(tmp_path):
    (tmp_path / "empty").mkdir()
    one_error_line(cli("info", tmp_path / "empty"), "no config.json")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    one_error_line(cli("info", bad), "config.json", "not valid JSON")
    (bad / "config.json").write_text("[1, 2]")
    one_error_line(cli("info", bad), "not a JSON object")
    (bad / "config.json").write_text('{"hidden_size": 128}')
    one_error_line(cli("info", bad), "num_attention_heads")


def test_truncated_weights_in_an_artifact(old_output, tmp_path):
    out, _ = old_output
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:-4096])
    with pytest.raises(ConvertError, match="model.safetensors: truncated or corrupt"):
        esmc_mlx.load(out)
    one_error_line(cli("info", out), "truncated or corrupt")
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    one_error_line(cli("embed", out, fasta, "-o", tmp_path / "emb"), "truncated or corrupt")
    assert not (tmp_path / "emb").exists()


def test_an_integer_weight_in_an_artifact(old_output, tmp_path):
    out, _ = old_output
    state = load_file(str(out / "model.safetensors"))
    state["esmc.norm.weight"] = state["esmc.norm.weight"].long()  # was a traceback from MLX's finfo
    save_file(state, str(out / "model.safetensors"), metadata={"format": "mlx"})
    with pytest.raises(ConvertError, match="model.safetensors: tensor esmc.norm.weight is int64, not a float"):
        esmc_mlx.load(out)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    one_error_line(cli("embed", out, fasta, "-o", tmp_path / "emb"), "esmc.norm.weight is int64")
    assert not (tmp_path / "emb").exists()


@pytest.mark.parametrize("typo", ["wt.fasta", "WT.FA", "data/wt", "seqs.fa.gz"])
def test_a_missing_fasta_given_as_sequence_is_not_read_as_a_protein(converted, tmp_path, monkeypatch, typo):
    """'.', 'F', 'A', 'S', 'T', 'W' are residue letters: a mistyped --sequence wt.fasta was
    scored (and scanned) as the protein WT.FASTA."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.csv").write_text("mutant\nW1A\n")
    monkeypatch.setattr("esmc_mlx.tasks.jobs.load", lambda *a, **k: pytest.fail("loaded the model"))
    result = cli("score", converted, "--sequence", typo, "--mutations", "m.csv", "-o", "out.csv")
    one_error_line(result, f"--sequence {typo}: no such file")
    result = cli("scan", converted, "--sequence", typo, "-o", "scan", "--no-plot")
    one_error_line(result, f"--sequence {typo}: no such file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv"]


def test_missing_local_paths_say_so(tmp_path, monkeypatch):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    for missing in (tmp_path / "nowhere", "./nowhere-mlx", "~/nowhere-mlx", "nowhere.pth"):
        one_error_line(cli("embed", missing, fasta, "-o", tmp_path / "e"), "no such file or directory")
        with pytest.raises(ConvertError, match="no such file or directory"):
            esmc_mlx.load(missing)
    # "models/esmc" with a models/ folder here: a typo in a path, not only a Hub failure
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    from esmc_mlx import resolve as resolve_module
    from esmc_mlx.errors import HubError

    def offline(repo_id, revision=None):
        raise HubError(f"{repo_id}: no such model repo on the Hub")

    monkeypatch.setattr(resolve_module, "download_checkpoint", offline)
    one_error_line(
        convert_cli("models/esmc", "-o", tmp_path / "o"), "models/esmc: no such file or directory here", "Hub"
    )
    assert debris(tmp_path) == [] and not (tmp_path / "e").exists()


def test_an_empty_model_name_is_not_the_current_directory(converted, tmp_path, monkeypatch):
    """Path("") is ".": an unset $MODEL made `embed "" in.fasta` embed with the model in the
    current directory (and `esmc-convert ""` convert the checkpoint there) without a word."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{SEQ}\n")
    monkeypatch.chdir(converted)
    one_error_line(cli("embed", "", fasta, "-o", tmp_path / "e"), "'' names no model")
    one_error_line(convert_cli("", "-o", tmp_path / "o"), "'' names no model")
    for name in ("", "  "):
        with pytest.raises(ConvertError, match="names no model"):
            esmc_mlx.load(name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta"]


def test_load_refuses_a_dtype_that_is_not_a_float(converted):
    """load(dtype=mx.int32) cast every weight to integers without a word; a name or a numpy
    dtype failed in MLX's astype with a TypeError."""
    import mlx.core as mx
    import numpy as np

    for dtype in (mx.int32, np.float16, "int8"):
        with pytest.raises(ConvertError, match="choose one of mx.float32"):
            esmc_mlx.load(converted, dtype=dtype)
    assert esmc_mlx.load(converted, dtype="float16")[0].dtype == mx.float16


def test_score_into_a_missing_folder_fails_before_scoring(converted, tmp_path, monkeypatch):
    csv_in = tmp_path / "dms.csv"
    csv_in.write_text("mutant\nM1A\n")
    monkeypatch.setattr("esmc_mlx.tasks.jobs.score_mutations", lambda *a, **k: pytest.fail("scored first"))
    monkeypatch.setattr("esmc_mlx.tasks.jobs.load", lambda *a, **k: pytest.fail("loaded the model first"))
    one_error_line(
        cli("score", converted, "--sequence", SEQ, "--mutations", csv_in, "-o", tmp_path / "nope" / "scored.csv"),
        "no such directory",
        "nope",
    )
    result = cli("score", converted, "--sequence", SEQ, "--mutations", csv_in, "-o", tmp_path)
    assert result.exit_code == 2 and "is a directory" in result.output  # click's check of the option
    assert not (tmp_path / "nope").exists()


def test_score_never_writes_over_its_own_inputs(converted, tmp_path, monkeypatch):
    """-o naming the mutations CSV or the wild-type FASTA (a typo) is refused: the CSV it would
    write drops fields past the header, and a FASTA would become a CSV."""
    csv_in = tmp_path / "dms.csv"
    csv_in.write_text("mutant,DMS_score\nM1A,0.5\nK2R,0.1,a note\n")
    wt = tmp_path / "wt.fasta"
    wt.write_text(f">wt\n{SEQ}\n")
    before = snapshot(tmp_path)
    monkeypatch.setattr("esmc_mlx.tasks.jobs.load", lambda *a, **k: pytest.fail("loaded the model first"))
    monkeypatch.chdir(tmp_path)
    for out, name in ((csv_in, "dms.csv"), (Path("wt.fasta"), "wt.fasta")):
        result = cli("score", converted, "--sequence", wt, "--mutations", csv_in, "-o", out)
        one_error_line(result, f"-o {out} is the input", name)
    assert snapshot(tmp_path) == before and debris(tmp_path) == []


def test_validate_into_an_impossible_report_folder_fails_before_validating(
    converted, checkpoints, tmp_path, monkeypatch
):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    monkeypatch.setattr("esmc_mlx.validate.core.SourceWeights", lambda *a, **k: pytest.fail("validated first"))
    result = cli("validate", converted, "--reference", checkpoints["published"], "--report", blocker / "report")
    one_error_line(result, "cannot create", "notes.txt is a file")
    assert blocker.read_text() == "mine"


def test_an_error_during_validation_starts_its_own_line(converted, checkpoints, monkeypatch):
    """validate's progress bar stayed open when an error left it: the Error text came after
    'validating: 0%|...| [importing torch]' on the same line."""

    def no_device(name):
        raise ValidationError(f"--reference-device {name}: no such device here")

    monkeypatch.setattr("esmc_mlx.validate.core.torch_ref.pick_device", no_device)
    result = cli("validate", converted, "--reference", checkpoints["published"], "--reference-device", "cuda")
    one_error_line(result, "--reference-device cuda: no such device here")


def test_score_writes_through_a_fifo_a_device_and_a_link(converted, tmp_path):
    """-o was written beside and renamed over the path: a FIFO (or, as root, -o /dev/null) became
    a regular file, and a link was replaced by a file, the file it pointed to left as it was."""
    csv_in = tmp_path / "dms.csv"
    csv_in.write_text("mutant\nM1A\nK2R\n")

    def score(out, *extra):
        result = cli("score", converted, "--sequence", SEQ, "--mutations", csv_in, "-o", out, "--no-progress", *extra)
        assert result.exit_code == 0, result.output

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so that opening it to write does not block
    try:
        score(fifo)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
        assert os.read(reader, 1 << 16).decode().startswith("mutant,masked_marginal,wt_marginal")
    finally:
        os.close(reader)
    real = tmp_path / "real.csv"
    real.write_text("old\n")
    (tmp_path / "link.csv").symlink_to(real.name)
    score(tmp_path / "link.csv", "--force")  # real.csv is the user's: replaced only with --force
    assert (tmp_path / "link.csv").is_symlink() and real.read_text().startswith("mutant,")
    if os.geteuid() == 0:  # a device node like /dev/null (making one needs root)
        null = tmp_path / "null"
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        score(null)
        assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert debris(tmp_path) == []


def test_a_dangling_link_is_named_as_one(converted, tmp_path, monkeypatch):
    """A link to nothing read as 'already exists' (-o DIR), as a model alias that is not one
    (a model given by a bare name), as a path written to only after the work (-o FILE), and
    as a path that 'does not exist' (inputs that click checks)."""
    monkeypatch.chdir(tmp_path)
    Path("gone").symlink_to(tmp_path / "nowhere" / "model")
    Path("in.fa").write_text(f">a\n{SEQ}\n")
    for result in (convert_cli("gone", "-o", "out", "--no-validate"), cli("embed", "./gone", "in.fa", "-o", "e")):
        one_error_line(result, f"gone: a link to {tmp_path / 'nowhere' / 'model'}, which does not exist")
    result = convert_cli(converted, "-o", "gone", "--q", "8", "--no-validate")
    one_error_line(result, "gone is a link to", "which does not exist; remove the link or choose another output")
    (tmp_path / "dms.csv").write_text("mutant\nM1A\n")
    result = cli("score", converted, "--sequence", SEQ, "--mutations", "dms.csv", "-o", "gone")
    one_error_line(result, "-o gone: a link to", "whose folder does not exist")
    # an input that must exist (a model directory, a FASTA, a CSV): not only "does not exist"
    for result in (
        cli("info", "gone"),
        cli("validate", "gone", "--reference", converted),
        cli("embed", converted, "gone", "-o", "e"),
        cli("score", converted, "--sequence", SEQ, "--mutations", "gone", "-o", "s.csv"),
    ):
        one_error_line(result, f"gone is a link to {tmp_path / 'nowhere' / 'model'}, which does not exist", code=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dms.csv", "gone", "in.fa"]


def test_failed_runs_leave_no_folders_they_made(checkpoints, converted, tmp_path):
    result = convert_cli(tmp_path / "missing", "-o", tmp_path / "new" / "deeper" / "out")
    one_error_line(result, "no such file or directory")
    bad = edited_checkpoint(
        checkpoints["published"], tmp_path / "nan", lambda s: s["esmc.norm.weight"].__setitem__(0, float("nan"))
    )
    one_error_line(convert_cli(bad, "-o", tmp_path / "new" / "out", "--no-validate"), "esmc.norm.weight")
    (tmp_path / "bad.fasta").write_text("not fasta\n")
    one_error_line(cli("embed", converted, tmp_path / "bad.fasta", "-o", tmp_path / "new" / "emb"), "bad.fasta")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.fasta", "nan"]


def test_output_under_a_file_and_on_a_read_only_file_system(checkpoints, tmp_path):
    (tmp_path / "a_file").write_text("")
    one_error_line(convert_cli(checkpoints["published"], "-o", tmp_path / "a_file" / "out"), "cannot create", "a_file")
    result = convert_cli(checkpoints["published"], "-o", "/proc/esmc-out", "--no-validate")
    one_error_line(result, "/proc")


def test_system_errors_become_one_line_naming_the_path(checkpoints, tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/data/secret/model.safetensors")

    monkeypatch.setattr("esmc_mlx.convert.sources.safetensors_header", denied)
    one_error_line(
        convert_cli(checkpoints["published"], "-o", tmp_path / "out"),
        "/data/secret/model.safetensors: Permission denied",
    )
    assert debris(tmp_path) == []


class Custom:  # an object torch's safe loader refuses
    pass


def test_pth_messages_never_advise_unsafe_loading(tmp_path):
    torch.save({"w": torch.zeros(2), "obj": Custom()}, tmp_path / "objects.pth")
    line = one_error_line(
        convert_cli(tmp_path / "objects.pth", "-o", tmp_path / "o"), "objects.pth", "plain state dict", "state_dict()"
    )
    assert "weights_only" not in line and "trust" not in line
    (tmp_path / "notes.pth").write_text("hello")  # not a checkpoint (and not a zip: no mmap)
    line = one_error_line(convert_cli(tmp_path / "notes.pth", "-o", tmp_path / "o"), "notes.pth", "cannot read it")
    assert "mmap" not in line and "_use_new_zipfile_serialization" not in line
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.pth", "b.pth"):
        torch.save({"w": torch.zeros(2)}, two / name)
    line = one_error_line(convert_cli(two, "-o", tmp_path / "o"), "2 .pth files", "a.pth, b.pth")
    assert "nor a .pth" not in line
    torch.save({"w": torch.zeros(2)}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    line = one_error_line(convert_cli(tmp_path / "old.pth", "-o", tmp_path / "o"), "old.pth")
    assert "mmap" not in line  # an old-format file is read (and then refused for not being ESMC)
    assert not (tmp_path / "o").exists() and debris(tmp_path) == []


# --- rule 8: inputs people really have; nonsense values refused; the umask ---------------------------
def test_a_spreadsheet_csv_with_bom_and_crlf(converted, tmp_path):
    csv_in = tmp_path / "excel.csv"
    # a byte-order mark, CRLF, and the empty rows a spreadsheet leaves below the data
    csv_in.write_bytes("\ufeffmutant,DMS_score\r\nM1A,0.5\r\nK2R,0.1\r\nT3S,0.9\r\n,\r\n,,\r\n".encode("utf-8"))
    out = tmp_path / "scored.csv"
    result = cli("score", converted, "--sequence", SEQ, "--mutations", csv_in, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "Scored 3 mutants" in result.output
    rows = out.read_text().splitlines()
    assert rows[0].startswith("mutant,DMS_score,masked_marginal") and len(rows) == 4


FASTA_TEXT = (
    ">sp|P69905|HBA_HUMAN Hemoglobin subunit alpha OS=Homo sapiens OX=9606 GN=HBA1 PE=1 SV=2\n"
    "mvlspadktn\nVKAAWGKVGA*\n\n\n>  tr|A0A024R161|A0A024R161_HUMAN  spaced header\n\nMKTAYIAKQR\n"
)


@pytest.mark.parametrize("variant", ["plain", "crlf", "cr", "bom", "gzip", "gzip-unnamed", "latin1"])
def test_fasta_from_common_tools(tmp_path, variant):
    text = (
        FASTA_TEXT.replace("\n", "\r\n")
        if variant == "crlf"
        else FASTA_TEXT.replace("\n", "\r")
        if variant == "cr"
        else FASTA_TEXT
    )
    data = text.encode("latin-1" if variant == "latin1" else "utf-8")
    if variant == "latin1":
        data = data.replace(b"spaced header", b"na\xefve header")
    if variant == "bom":
        data = b"\xef\xbb\xbf" + data
    if variant.startswith("gzip"):
        data = gzip.compress(data)
    path = tmp_path / ("in.fasta.gz" if variant == "gzip" else "in.fasta")
    path.write_bytes(data)
    records = read_fasta(path)
    assert [(r.id, r.sequence) for r in records] == [
        ("sp|P69905|HBA_HUMAN", "MVLSPADKTNVKAAWGKVGA"),
        ("tr|A0A024R161|A0A024R161_HUMAN", "MKTAYIAKQR"),
    ]


def pipe_path(data: bytes) -> tuple[str, int]:
    """``data`` behind an anonymous pipe, named as `<(...)` names one (/dev/fd/N), and the fd to
    close after: a second read of it finds nothing."""
    r, w = os.pipe()
    os.write(w, data)  # well under the pipe's buffer
    os.close(w)
    return f"/dev/fd/{r}", r


@pytest.mark.parametrize("compressed", [False, True])
def test_fasta_from_a_pipe_is_read_once(compressed):
    """`--fasta <(zcat x.fa.gz)` / `<(cat x.fa)`: the gzip check peeks at the stream instead of
    opening it a second time (which found it empty: 'no FASTA records'); --sequence takes a
    pipe holding one record (it was refused as 'no such file')."""
    data = FASTA_TEXT.encode()
    path, fd = pipe_path(gzip.compress(data) if compressed else data)
    try:
        assert [r.id for r in read_fasta(path)] == ["sp|P69905|HBA_HUMAN", "tr|A0A024R161|A0A024R161_HUMAN"]
    finally:
        os.close(fd)
    path, fd = pipe_path(b">wt\nMKTAYIAKQR\n")
    try:
        assert resolve_sequence(path) == "MKTAYIAKQR"
    finally:
        os.close(fd)


def test_embed_of_a_pipe_is_one_error(converted, tmp_path):
    """embed reads its FASTA twice (checked before the model loads, then embedded): a pipe is
    refused in one line saying so, before anything is written."""
    path, fd = pipe_path(FASTA_TEXT.encode())
    try:
        one_error_line(cli("embed", converted, path, "-o", tmp_path / "e"), path, "not a regular file", "twice")
    finally:
        os.close(fd)
    assert not (tmp_path / "e").exists()


def test_unreadable_fasta_is_one_error(converted, tmp_path):
    (tmp_path / "bin.fasta").write_bytes(b"\x00\x01\x02>a\n")
    one_error_line(cli("embed", converted, tmp_path / "bin.fasta", "-o", tmp_path / "e"), "bin.fasta")
    (tmp_path / "bad.fasta.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    one_error_line(cli("embed", converted, tmp_path / "bad.fasta.gz", "-o", tmp_path / "e"), "bad.fasta.gz")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "args,option",
    [
        (["--shard-size", "0"], "--shard-size"),
        (["--shard-size", "-5MB"], "--shard-size"),
        (["--shard-size", "lots"], "--shard-size"),
        (["--shard-size", "0.5KB"], "--shard-size"),
        (["--group-size", "0", "--q", "4"], "group"),
        (["--q", "17"], "17"),
        (["--q", ""], "--q ''"),  # an unset shell variable: not a float conversion
        (["--q", "4", "--q", ""], "--q ''"),  # was: out/4bit and out/float
        (["--upload-repo", ""], "is not a Hub repo id"),  # was: converted, and nothing uploaded
    ],
)
def test_nonsense_convert_options(checkpoints, tmp_path, args, option):
    result = convert_cli(checkpoints["published"], "-o", tmp_path / "out", "--no-validate", *args)
    assert result.exit_code in (1, 2) and option in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


@pytest.mark.parametrize(
    "command",
    [
        ["embed", "{model}", "{fasta}", "-o", "{tmp}/e", "--batch-tokens", "0"],
        ["score", "{model}", "--sequence", SEQ, "--mutations", "{csv}", "-B", "0"],
        ["validate", "{model}", "--reference", "tiny", "--max-length", "0"],
        ["validate", "{model}", "--reference", "tiny", "--threshold", "fidelity_logits=nan"],  # was: ran, then failed
        ["quantize", "{model}", "-o", "{tmp}/q", "--q", "4", "--shard-size", "0"],
    ],
)
def test_nonsense_job_options(converted, tmp_path, command):
    (tmp_path / "in.fasta").write_text(f">a\n{SEQ}\n")
    (tmp_path / "m.csv").write_text("mutant\nM1A\n")
    args = [
        a.format(model=converted, fasta=tmp_path / "in.fasta", csv=tmp_path / "m.csv", tmp=tmp_path) for a in command
    ]
    result = cli(*args)
    assert result.exit_code == 2 and "Invalid value" in result.output
    assert not (tmp_path / "e").exists() and not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["convert", "tiny", "-o", "-", "--no-validate"],
        ["quantize", "{model}", "-o", "-", "--q", "4"],
        ["embed", "{model}", "{fasta}", "-o", "-"],
        ["score", "{model}", "--sequence", SEQ, "--mutations", "{csv}", "-o", "-"],
        ["scan", "{model}", "--sequence", SEQ, "-o", "-", "--no-plot"],
        ["validate", "{model}", "--reference", "tiny", "--report", "-"],
        ["bench", "--model", "tiny", "--no-torch", "-o", "-"],
    ],
)
def test_dash_as_an_output_is_refused(converted, tmp_path, monkeypatch, command):
    """`-o -` (stdout to many tools) is refused, not made a file or folder named '-' (score: the
    CSV, rc 0)."""
    (tmp_path / "in.fasta").write_text(f">a\n{SEQ}\n")
    (tmp_path / "m.csv").write_text("mutant\nM1A\n")
    monkeypatch.chdir(tmp_path)
    args = [a.format(model=converted, fasta=tmp_path / "in.fasta", csv=tmp_path / "m.csv") for a in command]
    result = cli(*args)
    assert result.exit_code == 2 and "'-' would be a file or folder named '-'" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fasta", "m.csv"]


@pytest.mark.parametrize("option,message", [("--layers", "no layer given"), ("--pool", "unknown pooling ['']")])
def test_empty_embed_options_are_refused_not_defaulted(converted, tmp_path, option, message):
    """--layers "" / --pool "" (an unset shell variable) ran with the default layer / pooling."""
    (tmp_path / "in.fasta").write_text(f">a\n{SEQ}\n")
    result = cli("embed", converted, tmp_path / "in.fasta", "-o", tmp_path / "e", option, "", "--no-progress")
    one_error_line(result, message)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_take_the_users_umask(checkpoints, tmp_path, umask):
    previous = os.umask(umask)
    try:
        out = convert(str(checkpoints["published"]), tmp_path / "out", progress=False)
        fasta = tmp_path / "in.fasta"
        fasta.write_text(f">a\n{SEQ}\n")
        result = cli("embed", out, fasta, "-o", tmp_path / "emb", "--no-progress")
        assert result.exit_code == 0, result.output
    finally:
        os.umask(previous)
    for folder in (out, tmp_path / "emb"):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
        for f in folder.iterdir():
            want = (0o777 if f.is_dir() else 0o666) & ~umask
            assert f.stat().st_mode & 0o777 == want, (f, oct(f.stat().st_mode))


# --- options that would be ignored are refused; an absent reference device fails before converting --
def test_options_that_would_be_ignored_are_refused(checkpoints, converted, tmp_path):
    """--private without --upload-repo created nothing private; --revision with a local source or
    artifact read the local files, whatever revision was asked for."""
    result = convert_cli(checkpoints["published"], "-o", tmp_path / "a", "--private", "--no-validate")
    assert result.exit_code == 2 and "--upload-repo" in result.output, result.output
    result = convert_cli(checkpoints["published"], "-o", tmp_path / "b", "--revision", "v2", "--no-validate")
    one_error_line(result, "revision 'v2'", "is local")
    (tmp_path / "in.fasta").write_text(f">a\n{SEQ}\n")
    result = cli("validate", converted, "--reference", checkpoints["published"], "--revision", "v2", "--quick")
    one_error_line(result, "revision 'v2'", "is local")
    assert debris(tmp_path) == [] and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.skipif(
    getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(), reason="MPS is here"
)
def test_an_absent_reference_device_fails_before_the_conversion(checkpoints, tmp_path):
    """--reference-device mps without an MPS device was reported after converting (hours for a 6B)."""
    result = convert_cli(checkpoints["published"], "-o", tmp_path / "out", "--reference-device", "mps")
    one_error_line(result, "--reference-device mps", "sees no MPS device")
    assert "Validating the conversion" not in result.output, result.output  # failed before it had one
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_a_closed_stdout_ends_quietly(converted):
    """`esmc-mlx info X | head`: the reader going away printed `Error: Broken pipe`."""
    env = testing.child_env()
    p = subprocess.Popen(
        [sys.executable, "-m", "esmc_mlx.cli", "info", str(converted)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    p.stdout.close()  # before the command writes: its first write finds no reader
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1 and err == "", err


def test_embed_keeps_what_a_shorter_fasta_lacks_unless_told(converted, tmp_path):
    """A rerun with a FASTA that lost records deleted their stored embeddings in the merge."""
    (tmp_path / "all.fa").write_text(f">a\n{SEQ}\n>b\n{SEQ[:20]}\n")
    (tmp_path / "one.fa").write_text(f">a\n{SEQ}\n")
    assert cli("embed", converted, tmp_path / "all.fa", "-o", tmp_path / "e", "--no-progress").exit_code == 0
    before = snapshot(tmp_path / "e")
    result = cli("embed", converted, tmp_path / "one.fa", "-o", tmp_path / "e", "--no-progress")
    one_error_line(result, "1 ID that", "one.fa lacks ('b' ...)", "--drop-missing")
    assert snapshot(tmp_path / "e") == before
    result = cli("embed", converted, tmp_path / "one.fa", "-o", tmp_path / "e", "--drop-missing", "--no-progress")
    assert result.exit_code == 0 and "Dropped 1 stored embedding of IDs not in" in result.output, result.output
