"""The output guard for the writers of SAE features, attention maps, quantized SAEs, fine-tuning and
predictions, under faults: each refuses a folder esmc-mlx did not make, an output inside an input or
inside another esmc-mlx output, another kind's folder, and leaves nothing behind a failure; push
uploads an SAE's and an adapter's own files only. Each case asserts the exit code, the one `Error:`
line and the disk afterwards (digests of the user's files before and after, no debris), in the
style of tests/test_guard.py. docs/reliability.md has the table.

The model is the packaged esmc-tiny, converted here, and a random SAE: no torch needed."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
from fault_tools import cli, debris, one_error_line, snapshot, visible

from esmc_mlx import outputs
from esmc_mlx.errors import HubError
from esmc_mlx.hub import push

SEQ = "MKTAYIAKQRQISFVKSHFSRQ"


@pytest.fixture
def inputs_unchanged(model, sae):
    """The model's and the SAE's digests: no run below may change them."""
    before = snapshot(model), snapshot(sae)
    yield model, sae
    assert (snapshot(model), snapshot(sae)) == before and debris(model, sae, model.parent, sae.parent) == []


def features(model, sae, out, *extra):
    return cli("features", model, "--sae", sae, "--sequence", SEQ, "--layer", "1", "-o", out, "--no-plot", *extra)


def attention(model, out, *extra):
    return cli("attention", model, "--sequence", SEQ, "-o", out, "--no-plot", "--no-progress", *extra)


def users_folder(path, **files):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


# --- a folder esmc-mlx did not make, another kind's folder ---------------------------------------
def test_features_and_attention_never_write_into_a_users_folder(inputs_unchanged, tmp_path):
    model, sae = inputs_unchanged
    mine = users_folder(tmp_path / "results", **{"summary.csv": "my table\n", "sequence_contacts.npy": "mine"})
    before = snapshot(mine)
    one_error_line(features(model, sae, mine), str(mine), "esmc-mlx did not make")
    one_error_line(features(model, sae, mine, "--force"), str(mine), "esmc-mlx did not make")
    one_error_line(attention(model, mine), str(mine), "esmc-mlx did not make")
    one_error_line(attention(model, mine, "--force"), str(mine), "esmc-mlx did not make")
    assert snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == [
        "sequence_contacts.npy",
        "summary.csv",
    ]


def test_features_and_attention_do_not_take_each_others_folders(inputs_unchanged, tmp_path):
    model, sae = inputs_unchanged
    maps, feats = tmp_path / "maps", tmp_path / "feats"
    assert attention(model, maps).exit_code == 0
    assert features(model, sae, feats).exit_code == 0
    assert json.loads((maps / outputs.MARKER).read_text())["kind"] == "attention"
    assert json.loads((feats / outputs.MARKER).read_text())["kind"] == "features"
    before = {p: snapshot(p) for p in (maps, feats)}
    one_error_line(features(model, sae, maps), "holds an esmc-mlx attention")
    one_error_line(features(model, sae, maps, "--force"), "holds an esmc-mlx attention")
    one_error_line(attention(model, feats), "holds an esmc-mlx features")
    one_error_line(cli("scan", model, "--sequence", SEQ, "-o", feats, "--no-plot"), "holds an esmc-mlx features")
    one_error_line(attention(model, feats / "maps"), f"is inside {feats}")
    assert {p: snapshot(p) for p in before} == before and debris(tmp_path, maps, feats) == []


def test_a_users_file_dropped_into_a_features_folder_survives_force(inputs_unchanged, tmp_path):
    model, sae = inputs_unchanged
    out = tmp_path / "feats"
    assert features(model, sae, out).exit_code == 0
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    one_error_line(features(model, sae, out, "--force"), "--force will not clear", "notes.txt")
    assert snapshot(out) == before and debris(out, tmp_path) == []


# --- inside an input, inside another esmc-mlx output --------------------------------------------
def test_nothing_is_written_inside_the_model_or_the_sae(inputs_unchanged, tmp_path):
    model, sae = inputs_unchanged
    one_error_line(features(model, sae, sae / "features"), "inside the input")
    one_error_line(features(model, sae, model / "features"), "inside the input")
    one_error_line(features(model, sae, sae), "is the input")
    one_error_line(attention(model, model / "maps"), "inside the input")
    one_error_line(attention(model, model), "is the input")
    one_error_line(cli("quantize-sae", sae, "-o", sae / "bf16", "--q", "bf16", "--no-validate"), "is inside the input")
    one_error_line(
        cli("quantize-sae", sae, "-o", model / "sae", "--q", "bf16", "--no-validate"), f"is inside {model}", "a model"
    )
    assert not (sae / "features").exists() and not (model / "maps").exists()


def test_quantize_sae_force_replaces_only_an_sae_esmc_mlx_wrote(inputs_unchanged, tmp_path):
    model, sae = inputs_unchanged
    mine = users_folder(tmp_path / "mine", **{"config.json": "{}"})
    before = snapshot(mine)
    one_error_line(cli("quantize-sae", sae, "-o", mine, "--q", "bf16", "--no-validate"), "already exists")
    one_error_line(
        cli("quantize-sae", sae, "-o", mine, "--q", "bf16", "--no-validate", "--force"), "esmc-mlx did not write it"
    )
    assert snapshot(mine) == before
    models = snapshot(model)  # an esmc-mlx output of another kind
    one_error_line(
        cli("quantize-sae", sae, "-o", model, "--q", "bf16", "--no-validate", "--force"),
        "--force will not replace",
        "holds an esmc-mlx model, not an sae",
    )
    assert snapshot(model) == models
    out = tmp_path / "bf16"
    assert cli("quantize-sae", sae, "-o", out, "--q", "bf16", "--no-validate").exit_code == 0
    assert json.loads((out / outputs.MARKER).read_text())["kind"] == "sae"
    result = cli("quantize-sae", sae, "-o", out, "--q", "fp16", "--no-validate", "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16" and debris(tmp_path) == []


def test_an_attention_run_that_fails_leaves_nothing(inputs_unchanged, tmp_path, monkeypatch):
    model, _ = inputs_unchanged

    def save(file, array, *args, **kwargs):  # numpy's writer on a full disk
        file.write(b"\x93NUMPY" + b"\0" * 64)
        raise OSError("8000 requested and 3040 written")

    monkeypatch.setattr(np, "save", save)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 100, 0))
    out = tmp_path / "new" / "maps"
    one_error_line(attention(model, out), "the disk is full", str(out / "sequence_contacts.npy"))
    assert not (tmp_path / "new").exists() and debris(tmp_path) == []


def test_a_killed_attention_runs_leftover_is_known_by_its_mark(inputs_unchanged, tmp_path):
    model, _ = inputs_unchanged
    out = tmp_path / "maps"
    assert attention(model, out).exit_code == 0
    dead = outputs.make_staging(out, "files", "tmp")
    marker = json.loads((dead / outputs.MARKER).read_text())
    moved = dead.rename(dead.with_name(dead.name.replace(f"-{marker['pid']}-", "-999999999-")))
    (moved / outputs.MARKER).write_text(json.dumps(dict(marker, pid=999999999, staged_as=moved.name)))
    look_alike = users_folder(out.parent / ".maps.tmp-1-abcdef", **{"keep.txt": "mine"})  # no mark: the user's
    result = attention(model, out, "--force")
    assert result.exit_code == 0 and "removed" in result.output and moved.name in result.output, result.output
    assert not moved.exists() and (look_alike / "keep.txt").read_text() == "mine"


# --- fine-tuning and predictions ---------------------------------------------------------------
finetune_extra = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None, reason="fine-tuning needs the finetune extra (mlx-lm)"
)


@pytest.fixture
def train_csv(tmp_path):
    rng = np.random.default_rng(0)
    rows = ["".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), 12)) for _ in range(8)]
    path = tmp_path / "data" / "train.csv"
    path.parent.mkdir()
    path.write_text("sequence,label\n" + "".join(f"{s},{'ab'[i % 2]}\n" for i, s in enumerate(rows)))
    return path


def finetune(model, train, out, *extra):
    return cli("finetune", model, "--train", train, "-o", out, "--epochs", "1", *extra)


@finetune_extra
def test_finetune_refuses_a_users_folder_an_input_and_another_kind(inputs_unchanged, train_csv, tmp_path):
    model, _ = inputs_unchanged
    mine = users_folder(tmp_path / "mine", **{"adapter_config.json": "{}", "notes.md": "mine"})
    before = snapshot(mine)
    one_error_line(finetune(model, train_csv, mine), str(mine), "esmc-mlx did not make")
    one_error_line(finetune(model, train_csv, mine, "--force"), str(mine), "esmc-mlx did not make")
    assert snapshot(mine) == before
    one_error_line(finetune(model, train_csv, model / "adapter"), "inside the input")
    one_error_line(finetune(model, train_csv, train_csv.parent), "contains the input")
    maps = tmp_path / "maps"
    assert attention(model, maps).exit_code == 0
    one_error_line(finetune(model, train_csv, maps), "holds an esmc-mlx attention")
    assert visible(train_csv.parent) == ["train.csv"] and debris(tmp_path, train_csv.parent) == []


@finetune_extra
def test_a_finetune_that_fails_before_its_first_checkpoint_leaves_nothing(
    inputs_unchanged, train_csv, tmp_path, monkeypatch
):
    from esmc_mlx.errors import JobError
    from esmc_mlx.finetune import train

    def broken(self, rows):
        raise JobError("the step failed")

    monkeypatch.setattr(train.Trainer, "train_step", broken)
    model, _ = inputs_unchanged
    one_error_line(finetune(model, train_csv, tmp_path / "new" / "adapter"), "the step failed")
    assert not (tmp_path / "new").exists() and debris(tmp_path) == []


@pytest.fixture
def adapter(inputs_unchanged, train_csv, tmp_path):
    model, _ = inputs_unchanged
    out = tmp_path / "adapter"
    result = finetune(model, train_csv, out)
    assert result.exit_code == 0, result.output
    marker = json.loads((out / outputs.MARKER).read_text())
    assert marker["kind"] == "adapter" and "checkpoint.safetensors" not in marker["entries"]
    return out


@finetune_extra
def test_predict_and_fuse_write_only_where_they_may(adapter, train_csv, tmp_path):
    before = snapshot(adapter), snapshot(train_csv)
    one_error_line(cli("predict", adapter, "--csv", train_csv, "-o", train_csv), "is the input")
    one_error_line(cli("predict", adapter, "--csv", train_csv, "-o", adapter / "p.csv"), "inside the input")
    one_error_line(cli("predict", adapter, "--fuse", adapter / "fused"), "inside the input")
    one_error_line(cli("predict", adapter, "--csv", train_csv, "-o", tmp_path / "no" / "p.csv"), "no such directory")
    assert (snapshot(adapter), snapshot(train_csv)) == before and not (tmp_path / "no").exists()
    mine = users_folder(tmp_path / "fused", **{"notes.md": "mine"})
    before = snapshot(mine)
    one_error_line(cli("predict", adapter, "--fuse", mine, "--force"), "esmc-mlx did not write it")
    assert snapshot(mine) == before
    out = tmp_path / "p.csv"
    assert cli("predict", adapter, "--csv", train_csv, "-o", out).exit_code == 0
    assert out.read_text().startswith("sequence,label,prediction") and debris(tmp_path, adapter) == []
    assert cli("predict", adapter, "--sequence", SEQ, "-o", "/dev/null").exit_code == 0  # a device: written in place


@finetune_extra
def test_finetune_force_clears_only_what_it_wrote(adapter, train_csv, inputs_unchanged):
    model, _ = inputs_unchanged
    (adapter / "my-notes.md").write_text("mine")
    before = snapshot(adapter)
    one_error_line(finetune(model, train_csv, adapter, "--force"), "--force will not clear", "my-notes.md")
    assert snapshot(adapter) == before and debris(adapter, adapter.parent) == []


# --- push: the artifact's own files, for every kind ---------------------------------------------
@finetune_extra
def test_push_of_an_adapter_or_an_sae_sends_only_its_own_files(adapter, inputs_unchanged, tmp_path, monkeypatch):
    model, sae = inputs_unchanged
    monkeypatch.setattr(push, "is_offline_mode", lambda: True)  # a dry run from the artifact alone
    copy = tmp_path / "sae-copy"
    shutil.copytree(sae, copy)
    for folder in (adapter, copy):
        (folder / "private.fasta").write_text(">mine\nMKT\n")
        (folder / "drafts").mkdir()
        (folder / "drafts" / "plan.docx").write_text("plan")
    sent = {path for path, _ in push.artifact_files(adapter)}
    assert sent == {"adapter_config.json", "adapters.safetensors", "head.safetensors", "metrics.json", "README.md"} | (
        {"metrics.png"} if (adapter / "metrics.png").exists() else set()
    )
    assert {path for path, _ in push.artifact_files(copy)} == {"config.json", "layer_1.safetensors"}
    # a link leading out of the folder, named with --include, is refused; a token in a named file too
    (copy / "outside.txt").symlink_to(tmp_path / "data" / "train.csv")
    with pytest.raises(HubError, match="leads outside"):
        push.artifact_files(copy, include=["outside.txt"])
    (copy / "setup.sh").write_text("export HF_TOKEN=hf_" + "a" * 34 + "\n")
    with pytest.raises(HubError, match="setup.sh holds an access token"):
        push.push_artifact(copy, "alice/sae", dry_run=True, allow_unvalidated=True, include=["setup.sh"])
    result = push.push_artifact(copy, "alice/sae", dry_run=True, allow_unvalidated=True)
    assert {path for path, _ in result.files} == {"config.json", "layer_1.safetensors", "README.md"}


@finetune_extra
def test_an_incomplete_sae_or_adapter_is_refused(adapter, inputs_unchanged, tmp_path):
    _, sae = inputs_unchanged
    copy = tmp_path / "sae-copy"
    shutil.copytree(sae, copy)
    (copy / "layer_1.safetensors").unlink()
    with pytest.raises(HubError, match="incomplete artifact, .*layer_1.safetensors is missing"):
        push.artifact_files(copy)
    (adapter / "head.safetensors").unlink()
    with pytest.raises(HubError, match="incomplete artifact, .*head.safetensors missing"):
        push.artifact_files(adapter)
