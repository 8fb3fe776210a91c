"""The one output guard (esmc_mlx/outputs.py) under faults: what esmc-mlx reads never decides what
it deletes outside its output; leftovers are known by esmc-mlx's mark, never by a name; every
command that writes goes through the same target check; a failed run leaves no partial output.
Each case asserts the exit code, the one `Error:` line and the disk afterwards (digests of the
user's files before and after, no debris). docs/reliability.md has the table.

The model is the packaged esmc-tiny, converted here: no torch needed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from fault_tools import DEAD, cli, convert_cli, dead_staging, debris, one_error_line, snapshot, visible

from esmc_mlx import outputs
from esmc_mlx.convert import convert
from esmc_mlx.errors import OutputError

SEQ = "MKTAYIAKQRQ"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return convert("tiny", tmp_path_factory.mktemp("tiny") / "model", progress=False)


@pytest.fixture
def model_state(model):
    """The model directory's digests: no run below may change it."""
    before = snapshot(model)
    yield model
    assert snapshot(model) == before and debris(model, model.parent) == []


def scan(model, out, *extra):
    return cli("scan", model, "--sequence", SEQ, "-o", out, "--no-plot", "--no-progress", *extra)


# --- rule 1: what esmc-mlx reads never decides what it deletes outside its output --------------------
def test_a_planted_scan_manifest_deletes_nothing(model_state, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("important")
    (tmp_path / "victim").mkdir()
    other = tmp_path / "victim" / "important.txt"
    other.write_text("also important")
    out = tmp_path / "a" / "b" / "OUT"
    out.mkdir(parents=True)
    files = {str(victim): victim.stat().st_size, "../../victim/important.txt": other.stat().st_size}
    planted = {"format": "esmc-mlx-scan/1", "proteins": {"sequence": {"settings": {}, "files": files}}}
    (out / "scan-manifest.json").write_text(json.dumps(planted))
    before = snapshot(tmp_path)
    one_error_line(scan(model_state, out), str(out), "esmc-mlx did not make")
    assert snapshot(tmp_path) == before and visible(out) == ["scan-manifest.json"]


def test_a_manifest_and_marker_of_a_real_scan_folder_edited_to_name_outside_files(model_state, tmp_path):
    """Even in a folder esmc-mlx made, a manifest entry is read only for names its marker lists,
    and a marker lists only names inside the folder."""
    out = tmp_path / "scan"
    assert scan(model_state, out).exit_code == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("x" * 40)
    mine = out / "notes.txt"  # the user's file inside the scan folder: not in the marker
    mine.write_text("y" * 40)
    manifest = json.loads((out / "scan-manifest.json").read_text())
    manifest["proteins"]["sequence"]["files"].update({"../victim.txt": 40, str(victim): 40, "notes.txt": 40})
    (out / "scan-manifest.json").write_text(json.dumps(manifest))
    marker = json.loads((out / outputs.MARKER).read_text())
    marker["entries"] += ["../victim.txt", str(victim)]
    (out / outputs.MARKER).write_text(json.dumps(marker))
    result = scan(model_state, out, "--offset", "5")  # other settings: scanned again, stale files looked at
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "x" * 40 and mine.read_text() == "y" * 40
    assert "M5A" in (out / "sequence_scan.csv").read_text() and debris(out, tmp_path) == []


def test_a_planted_marker_cannot_make_force_clear_outside_the_folder(model_state, tmp_path):
    victim = tmp_path / "victim.npy"
    np.save(victim, np.arange(3))
    folder = tmp_path / "emb"
    folder.mkdir()
    entries = ["../victim.npy", str(victim), "/etc/hostname"]
    (folder / outputs.MARKER).write_text(
        json.dumps({"written_by": "esmc-mlx", "version": "0", "kind": "embeddings", "entries": entries})
    )
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    before = snapshot(victim)
    result = cli("embed", model_state, fasta, "-o", folder, "--force", "--no-progress")
    assert result.exit_code == 0, result.output
    assert snapshot(victim) == before and visible(folder) == ["index.tsv", "manifest.json", "mean.npy"]


# --- rule 2: leftovers are known by esmc-mlx's own mark, never by a name ------------------------------
def test_a_users_folder_named_like_an_old_output_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert convert_cli("tiny", "-o", "results", "--no-validate").exit_code == 0
    mine = tmp_path / ".results.old-20241201"
    (mine / "drafts").mkdir(parents=True)
    (mine / "drafts" / "plan.md").write_text("a month of work")
    before = snapshot(mine)
    result = convert_cli("tiny", "-o", "results", "--force", "--no-validate")
    assert result.exit_code == 0 and "Warning" not in result.output, result.output
    assert snapshot(mine) == before


def test_a_users_files_named_like_temporary_or_old_outputs_beside_a_csv(model_state, tmp_path):
    csv_in = tmp_path / "m.csv"
    csv_in.write_text("mutant\nM1A\nK2P\n")
    old = tmp_path / ".s.csv.old-2024_nov"
    old.write_text("last november's scores")
    tmp = tmp_path / f".s.csv.tmp-{DEAD}-abcdef"
    tmp.write_text("half of something of mine")
    before = {p: snapshot(p) for p in (old, tmp, csv_in)}
    result = cli("score", model_state, "--sequence", SEQ, "--mutations", csv_in, "-o", tmp_path / "s.csv")
    assert result.exit_code == 0 and "Warning" not in result.output, result.output
    assert {p: snapshot(p) for p in before} == before
    assert (tmp_path / "s.csv").read_text().startswith("mutant,masked_marginal")


def test_a_users_file_where_the_lock_goes_is_neither_used_nor_removed(model_state, tmp_path):
    csv_in = tmp_path / "m.csv"
    csv_in.write_text("mutant\nM1A\n")
    lock = tmp_path / ".s.csv.lock"
    lock.write_text("my notes on the lock")
    before = snapshot(tmp_path)
    result = cli("score", model_state, "--sequence", SEQ, "--mutations", csv_in, "-o", tmp_path / "s.csv")
    one_error_line(result, str(lock), "is in the way")
    assert snapshot(tmp_path) == before
    link = tmp_path / ".out.lock"  # a link there is not esmc-mlx's either
    link.symlink_to(tmp_path / "m.csv")
    before = snapshot(tmp_path)
    one_error_line(convert_cli("tiny", "-o", tmp_path / "out", "--no-validate"), "is in the way")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["renamed", "other target", "alive", "link"])
def test_marked_folders_that_are_not_this_outputs_leftovers_stay(tmp_path, case):
    """A staging folder counts as a leftover of OUT only under the name it was made with, made
    for OUT, by a process that is gone, and not through a link."""
    out = convert("tiny", tmp_path / "out", progress=False)
    if case == "renamed":
        kept = dead_staging(tmp_path, "out", "partial").rename(tmp_path / f".out.partial-{DEAD}-000000")
    elif case == "other target":
        kept = dead_staging(tmp_path, "other", "partial").rename(tmp_path / f".out.partial-{DEAD}-111111")
        marker = json.loads((kept / outputs.MARKER).read_text())
        (kept / outputs.MARKER).write_text(json.dumps(dict(marker, staged_as=kept.name)))
    elif case == "alive":
        kept = dead_staging(tmp_path, "out", "partial")
        marker = json.loads((kept / outputs.MARKER).read_text())
        (kept / outputs.MARKER).write_text(json.dumps(dict(marker, pid=os.getppid())))
    else:
        (tmp_path / "elsewhere").mkdir()
        real = dead_staging(tmp_path / "elsewhere", "out", "old")
        kept = tmp_path / real.name
        kept.symlink_to(real)
    (kept / "mine.txt").write_text("mine")
    before = snapshot(kept)
    result = convert_cli("tiny", "-o", out, "--force", "--no-validate")
    assert result.exit_code == 0 and "Warning" not in result.output, result.output
    assert kept.exists() and snapshot(kept) == before


def test_a_real_leftover_of_a_killed_run_goes_and_is_named(tmp_path):
    out = convert("tiny", tmp_path / "out", progress=False)
    leftover = dead_staging(tmp_path, "out", "partial")
    (leftover / "shard-0.tmp.safetensors").write_bytes(b"\0" * 64)
    result = convert_cli("tiny", "-o", out, "--force", "--no-validate")
    assert result.exit_code == 0 and f"Warning: removed {leftover}" in result.output, result.output
    assert not leftover.exists() and debris(tmp_path) == []


# --- rule 3: every command that writes goes through the same target check -----------------------------
def test_scan_never_writes_into_a_folder_it_did_not_make(model_state, tmp_path):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "sequence_scan.csv").write_text("my hand-made table\n")
    before = snapshot(mine)
    one_error_line(scan(model_state, mine), str(mine), "esmc-mlx did not make")
    assert snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == ["sequence_scan.csv"]
    # an empty folder is taken, and is the scan's from then on
    empty = tmp_path / "empty"
    empty.mkdir()
    assert scan(model_state, empty).exit_code == 0
    assert json.loads((empty / outputs.MARKER).read_text())["kind"] == "scan"


def test_the_root_folder_is_no_output(model_state):
    before = sorted(os.listdir("/"))
    one_error_line(scan(model_state, "/"), "-o /")
    assert sorted(os.listdir("/")) == before


def test_nothing_is_written_inside_a_model(model_state, tmp_path):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    csv_in = tmp_path / "m.csv"
    csv_in.write_text("mutant\nM1A\n")
    one_error_line(scan(model_state, model_state), "is the input")
    one_error_line(cli("embed", model_state, fasta, "-o", model_state / "emb"), "inside the input")
    one_error_line(scan(model_state, model_state / "scans"), "inside the input")
    one_error_line(
        cli("score", model_state, "--sequence", SEQ, "--mutations", csv_in, "-o", model_state / "s.csv"),
        "inside the input",
    )
    # a model that is not the input is no place for outputs either
    other = convert("tiny", tmp_path / "other", progress=False)
    before = snapshot(other)
    one_error_line(cli("embed", model_state, fasta, "-o", other / "emb"), f"is inside {other}", "a model")
    one_error_line(scan(model_state, other / "deep" / "er"), f"is inside {other}")
    one_error_line(convert_cli("tiny", "--q", "4", "--q", "8", "-o", other, "--no-validate"), f"is inside {other}")
    one_error_line(convert_cli("tiny", "-o", other / "sub", "--no-validate"), f"is inside {other}")
    assert snapshot(other) == before and sorted(p.name for p in other.iterdir()) == sorted(
        p.name for p in (tmp_path / "other").iterdir()
    )
    assert not (other / "deep").exists() and not (other / "4bit").exists()


def test_outputs_of_one_kind_are_not_written_over_by_another(model_state, tmp_path):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    scans, emb = tmp_path / "scans", tmp_path / "emb"
    assert scan(model_state, scans).exit_code == 0
    assert cli("embed", model_state, fasta, "-o", emb, "--no-progress").exit_code == 0
    before = {p: snapshot(p) for p in (scans, emb)}
    one_error_line(cli("embed", model_state, fasta, "-o", scans), "holds an esmc-mlx scan")
    one_error_line(cli("embed", model_state, fasta, "-o", scans, "--force"), "holds an esmc-mlx scan")
    one_error_line(scan(model_state, emb), "holds an esmc-mlx embeddings")
    one_error_line(convert_cli("tiny", "-o", emb, "--force", "--no-validate"), "--force will not replace", "embeddings")
    one_error_line(scan(model_state, emb / "scans"), f"is inside {emb}")
    assert {p: snapshot(p) for p in before} == before and debris(tmp_path, scans, emb) == []


def test_a_file_where_a_folder_output_goes(model_state, tmp_path):
    target = tmp_path / "results"
    target.write_text("mine")
    one_error_line(scan(model_state, target), "is a file", code=2)  # click's own check of the option
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    one_error_line(cli("embed", model_state, fasta, "-o", target), "is a file", code=2)
    with pytest.raises(OutputError, match="a file, not a folder"):  # the guard's own, for the API
        with outputs.guard(target, "scan", "folder"):
            pass
    assert target.read_text() == "mine" and debris(tmp_path) == []


# --- rule 8 (partial output): a failed run leaves nothing it made -----------------------------------
def full_disk(monkeypatch, folder: Path):
    """numpy's writer on a full disk: part of the bytes, then an OSError without errno ("8000
    requested and 3040 written"); the file system then reports no free space."""
    real_save = np.save

    def save(file, array, *args, **kwargs):
        if hasattr(file, "write"):
            file.write(b"\x93NUMPY" + b"\0" * 64)
            raise OSError("8000 requested and 3040 written")
        return real_save(file, array, *args, **kwargs)

    monkeypatch.setattr(np, "save", save)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 100, 0))


def test_scan_onto_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(model_state, tmp_path, monkeypatch):
    full_disk(monkeypatch, tmp_path)
    out = tmp_path / "new" / "scan"
    one_error_line(scan(model_state, out), "the disk is full", str(out / "sequence_matrix.npy"))
    assert not (tmp_path / "new").exists() and debris(tmp_path) == []


def test_a_full_disk_in_the_middle_of_a_fasta_keeps_the_proteins_done(model_state, tmp_path, monkeypatch):
    out = tmp_path / "scans"
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    assert cli("scan", model_state, "--fasta", fasta, "-o", out, "--no-plot", "--no-progress").exit_code == 0
    before = snapshot(out)
    fasta.write_text(f">a\n{SEQ}\n>b\nMVLSPADKTNV\n")
    full_disk(monkeypatch, tmp_path)
    result = cli("scan", model_state, "--fasta", fasta, "-o", out, "--no-plot", "--no-progress")
    one_error_line(result, "the disk is full", str(out / "b_matrix.npy"))
    assert snapshot(out) == before and debris(out, tmp_path) == []  # a's files as they were, none of b's


def test_an_embed_that_fails_after_it_began_leaves_no_folder(model_state, tmp_path, monkeypatch):
    from esmc_mlx.errors import ScoringError
    from esmc_mlx.tasks import jobs

    def broken(*args, **kwargs):
        raise ScoringError("the forward failed")
        yield  # a generator, as iter_embeddings

    monkeypatch.setattr(jobs, "iter_embeddings", broken)
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    one_error_line(cli("embed", model_state, fasta, "-o", tmp_path / "new" / "emb", "--no-progress"), "forward failed")
    assert not (tmp_path / "new").exists() and debris(tmp_path) == []


def test_an_embed_of_a_model_whose_config_lies_makes_nothing(tmp_path):
    model = convert("tiny", tmp_path / "model", progress=False)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, vocab_size=1)))
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    one_error_line(cli("embed", model, fasta, "-o", tmp_path / "emb"), "config.json", "vocab_size")
    assert not (tmp_path / "emb").exists() and debris(tmp_path) == []


# --- the guard's API, as new commands use it -------------------------------------------------------
def test_one_call_for_each_shape_of_output(tmp_path):
    source = tmp_path / "input.txt"
    source.write_text("read me")
    with outputs.guard(tmp_path / "adapter", "adapter", "directory", inputs=[source]) as target:
        (target.path / "adapters.safetensors").write_bytes(b"weights")
        target.publish()
    assert json.loads((tmp_path / "adapter" / outputs.MARKER).read_text())["kind"] == "adapter"
    with outputs.guard(tmp_path / "maps", "attention", "folder", inputs=[source]) as folder:
        with folder.file("P1_attention.npy", "wb") as f:
            f.write(b"rows")
        with outputs.guard(tmp_path / "maps", "attention", "folder") as same:  # nested: the same guard
            assert same is folder
    assert json.loads((tmp_path / "maps" / outputs.MARKER).read_text())["entries"] == ["P1_attention.npy"]
    with outputs.guard(tmp_path / "p.csv", "predictions", "file", inputs=[source]) as target:
        with target.open("w") as f:
            f.write("id,label\n")
    assert (tmp_path / "p.csv").read_text() == "id,label\n" and debris(tmp_path, tmp_path / "maps") == []
    with pytest.raises(OutputError, match="is the input"):
        with outputs.guard(source, "predictions", "file", inputs=[source]):
            pass
    with pytest.raises(OutputError, match="holds an esmc-mlx attention"):
        with outputs.guard(tmp_path / "maps", "features", "folder"):
            pass
    with pytest.raises(OutputError, match="--force will not replace .* it holds an esmc-mlx attention, not an adapter"):
        with outputs.guard(tmp_path / "maps", "adapter", "directory", force=True):
            pass
    assert source.read_text() == "read me"
