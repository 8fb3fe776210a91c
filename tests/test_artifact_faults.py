"""Adapters and SAEs under the rules models follow (docs/reliability.md, "Third battery"): every
file read through the bounded readers with its fields checked and its safetensors through the
header check before MLX or mlx-lm reads it (rule 1); numbers that are not finite stopped where
they enter (2); every job's records checked against memory (3); an input never the output,
however it was found (4). Each case asserts the exit code, the one `Error:` line and the disk
afterwards: digests of the user's files before and after, nothing made, no debris."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest_hub import hub, no_remote_network  # noqa: F401  (fixtures)
from fault_tools import cli, debris, one_error_line, rewrite_header, snapshot

pytest.importorskip("mlx_lm", reason="adapters need the finetune extra (mlx-lm)")
from safetensors.numpy import load_file, save_file  # noqa: E402

from esmc_mlx import load_sae, resolve  # noqa: E402
from esmc_mlx.errors import ConfigError, JobError  # noqa: E402
from esmc_mlx.finetune import finetune, load_adapter  # noqa: E402
from esmc_mlx.finetune import model as finetune_model  # noqa: E402
from esmc_mlx.finetune.data import Labels  # noqa: E402
from esmc_mlx.finetune.model import AdaptedModel, training_base  # noqa: E402
from esmc_mlx.runtime.load import load  # noqa: E402
from esmc_mlx.tasks import scoring  # noqa: E402
from esmc_mlx.testing import random_sequences, tiny_config, write_random_artifact, write_random_sae  # noqa: E402

SEQ = "MKTAYIAKQRQISFVKSHFSRQ"


@pytest.fixture(autouse=True)
def cpu(on_cpu):
    """Training on the CPU, where these runs take seconds."""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_random_artifact(tmp_path_factory.mktemp("base") / "tiny", tiny_config(), mx.float32)


def write_csv(path: Path, rows, header=("sequence", "label")) -> Path:
    path.write_text(",".join(header) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


def labeled(n: int = 16, seed: int = 1) -> list[tuple[str, str]]:
    return [(s, "many_K" if s.count("K") >= 2 else "few_K") for s in random_sequences(n, 12, 40, seed=seed)]


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    return finetune(base, write_csv(root / "train.csv", labeled()), root / "adapter", epochs=1).out


@pytest.fixture
def adapter(trained, tmp_path) -> Path:
    """A copy of a finished adapter to damage (its local base recorded)."""
    return Path(shutil.copytree(trained, tmp_path / "adapter"))


@pytest.fixture(scope="module")
def sae_source(tmp_path_factory) -> Path:
    return write_random_sae(tmp_path_factory.mktemp("sae") / "sae", tiny_config().hidden_size, 64, 4, [1, 2])


@pytest.fixture
def sae(sae_source, tmp_path) -> Path:
    return Path(shutil.copytree(sae_source, tmp_path / "sae"))


@pytest.fixture
def little_memory(monkeypatch):
    """A machine of 1 GiB (what a forward or a training step may use), whatever this one has."""
    monkeypatch.setattr(scoring, "memory_bytes", lambda: 1 << 30)


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def state(*paths: Path) -> dict:
    """Digests (and modes) of every file under ``paths``: the user's files, to compare after."""
    return {str(p): snapshot(p) for p in paths}


def check_untouched(before: dict, *roots: Path) -> None:
    """The user's files byte-identical, and no debris (staging, lock) in ``roots``."""
    assert {k: snapshot(Path(k)) for k in before} == before
    assert debris(*roots) == []


def predict(adapter: Path, out: Path, *extra):
    return cli("predict", adapter, "--sequence", SEQ, "-o", out, *extra)


# --- rule 1: every file read through the bounded readers, every field checked --------------------
ADAPTER_CONFIG_FAULTS = {
    "task-bogus": (lambda c: c["esmc_mlx"]["labels"].update(task="bogus"), "esmc_mlx.labels.task 'bogus'"),
    "classes-null": (lambda c: c["esmc_mlx"]["labels"].update(classes=None), "esmc_mlx.labels.classes"),
    "one-class": (lambda c: c["esmc_mlx"]["labels"].update(classes=["a"]), "at least two distinct labels"),
    "class-twice": (lambda c: c["esmc_mlx"]["labels"].update(classes=["a", "b", "a"]), "lists a label twice"),
    "no-base": (lambda c: c["esmc_mlx"].pop("base"), "esmc_mlx.base must be an object"),
    "base-files-empty": (lambda c: c["esmc_mlx"]["base"].update(files={}), "esmc_mlx.base.files"),
    "base-file-outside": (
        lambda c: c["esmc_mlx"]["base"].update(files={"../x.safetensors": "0" * 64}),
        "esmc_mlx.base.files: '../x.safetensors'",
    ),
    "rank-1e9": (lambda c: c["lora_parameters"].update(rank=10**9), "lora_parameters.rank is 1,000,000,000"),
    "rank-text": (lambda c: c["lora_parameters"].update(rank="8"), "lora_parameters.rank must be a positive integer"),
    "scale-nan": (lambda c: c["lora_parameters"].update(scale=float("nan")), "lora_parameters.scale"),
    "dropout-2": (lambda c: c["lora_parameters"].update(dropout=2), "lora_parameters.dropout"),
    "keys-unknown": (lambda c: c["lora_parameters"].update(keys=["self_attn.evil"]), "'self_attn.evil'"),
    "layers-1e9": (lambda c: c.update(num_layers=10**9), "num_layers is 1,000,000,000, but the base model has 2"),
    "layers-0": (lambda c: c.update(num_layers=0), "num_layers must be a positive integer"),
    "head-conv": (lambda c: c["esmc_mlx"].update(head="conv"), "esmc_mlx.head 'conv'"),
    "complete-text": (lambda c: c["esmc_mlx"].update(complete="yes"), "esmc_mlx.complete"),
    "dora": (lambda c: c.update(fine_tune_type="dora"), "fine_tune_type 'dora'"),
    "training-list": (lambda c: c["esmc_mlx"].update(training=[1, 2]), "esmc_mlx.training must be an object"),
    "best-epoch-text": (lambda c: c["esmc_mlx"].update(best_epoch="1"), "esmc_mlx.best_epoch"),
    "regression-inf-std": (
        lambda c: c["esmc_mlx"]["labels"].update(task="regression", classes=None, mean=0.0, std=float("inf")),
        "esmc_mlx.labels.std must be a finite number",
    ),
}


@pytest.mark.parametrize("fault", sorted(ADAPTER_CONFIG_FAULTS))
def test_a_damaged_adapter_config_is_one_line_naming_the_file_and_field(adapter, tmp_path, fault):
    edit, fragment = ADAPTER_CONFIG_FAULTS[fault]
    edit_json(adapter / "adapter_config.json", edit)
    before = state(adapter)
    out = tmp_path / "p.csv"
    one_error_line(predict(adapter, out), "adapter_config.json", fragment)
    assert not out.exists()
    check_untouched(before, tmp_path)


@pytest.mark.parametrize("how", ["nested", "not-utf8", "not-json", "huge"])
def test_an_unreadable_adapter_config_is_one_line_for_every_command(adapter, tmp_path, how):
    path = adapter / "adapter_config.json"
    text = path.read_text()
    if how == "nested":
        path.write_text('{"esmc_mlx": ' + "[" * 100_000 + "]" * 100_000 + "}")
        fragment = "nested 100001 levels deep"
    elif how == "not-utf8":
        path.write_bytes(text.encode().replace(b'"lora"', b'"lo\xffra"'))
        fragment = "not UTF-8"
    elif how == "not-json":
        path.write_text(text[: len(text) // 2])
        fragment = "not valid JSON"
    else:
        path.write_text(text[:-2] + ', "pad": "' + "x" * (2 << 20) + '"}')
        fragment = "larger than"
    before = state(adapter)
    results = [
        predict(adapter, tmp_path / "p.csv"),
        cli("predict", adapter, "--fuse", tmp_path / "fused"),
        cli("push", adapter, "my-org/adapter", "--dry-run"),
    ]
    for result in results:
        one_error_line(result, "adapter_config.json", fragment)
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "fused").exists()
    check_untouched(before, tmp_path)


def _overlap(header: dict) -> None:
    header["layers.1.self_attn.k_proj.lora_a"]["data_offsets"] = header["layers.1.self_attn.q_proj.lora_a"][
        "data_offsets"
    ]


ADAPTER_WEIGHT_FAULTS = {
    "cut": ("adapters.safetensors", "truncated or corrupt safetensors file"),
    "overlap": ("adapters.safetensors", "corrupt safetensors header"),
    "extra-tensor": ("adapters.safetensors", "tensor layers.0.mlp.extra is not one adapter_config.json describes"),
    "missing-tensor": ("adapters.safetensors", "no tensor layers.0.mlp.down_proj.lora_b"),
    "wrong-shape": ("adapters.safetensors", "tensor layers.0.mlp.up_proj.lora_b has shape (8, 100)"),
    "integer": ("adapters.safetensors", "tensor layers.0.self_attn.o_proj.lora_a is I32, not a float weight"),
    "nan": ("adapters.safetensors", "tensor layers.1.mlp.down_proj.lora_b of", "holds 1 NaN or Inf value"),
    "inf-head": ("head.safetensors", "tensor layers.0.bias of", "holds 1 NaN or Inf value"),
    "head-cut": ("head.safetensors", "truncated or corrupt safetensors file"),
    "head-classes": ("head.safetensors", "tensor layers.0.weight has shape (3, 128)"),
}


def damage_weights(adapter: Path, fault: str) -> None:
    weights, head = adapter / "adapters.safetensors", adapter / "head.safetensors"
    if fault == "cut":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif fault == "head-cut":
        head.write_bytes(head.read_bytes()[:-4])
    elif fault == "overlap":
        rewrite_header(weights, _overlap)
    elif fault == "extra-tensor":
        edit_tensors(weights, lambda t: t.update({"layers.0.mlp.extra": np.zeros(4, np.float32)}))
    elif fault == "missing-tensor":
        edit_tensors(weights, lambda t: t.pop("layers.0.mlp.down_proj.lora_b"))
    elif fault == "wrong-shape":
        edit_tensors(weights, lambda t: t.update({"layers.0.mlp.up_proj.lora_b": np.zeros((8, 100), np.float32)}))
    elif fault == "integer":
        name = "layers.0.self_attn.o_proj.lora_a"
        edit_tensors(weights, lambda t: t.update({name: t[name].astype(np.int32)}))
    elif fault == "nan":
        name = "layers.1.mlp.down_proj.lora_b"
        edit_tensors(weights, lambda t: t[name].__setitem__((0, 0), np.nan))
    elif fault == "inf-head":
        edit_tensors(head, lambda t: t["layers.0.bias"].__setitem__(0, np.inf))
    elif fault == "head-classes":
        edit_tensors(head, lambda t: t.update({"layers.0.weight": np.zeros((3, 128), np.float32)}))


@pytest.mark.parametrize("fault", sorted(ADAPTER_WEIGHT_FAULTS))
def test_damaged_adapter_weights_are_refused_before_mlx_reads_them(adapter, tmp_path, fault):
    damage_weights(adapter, fault)
    name, *fragments = ADAPTER_WEIGHT_FAULTS[fault]
    before = state(adapter)
    out, fused = tmp_path / "p.csv", tmp_path / "fused"
    one_error_line(predict(adapter, out), name, *fragments)
    one_error_line(cli("predict", adapter, "--fuse", fused), name, *fragments)
    with pytest.raises(ConfigError, match=name):
        load_adapter(adapter)
    assert not out.exists() and not fused.exists()
    check_untouched(before, tmp_path)


def test_a_damaged_metrics_file_and_local_base_record_name_the_file(adapter, base, trained, tmp_path):
    (adapter / "metrics.json").write_text('{"epochs": [{"epoch": 1, "train_loss": "low"}]}')
    train = trained.parent / "train.csv"
    before = state(adapter, train)
    result = cli("finetune", base, "--train", train, "-o", adapter, "--epochs", "1", "--no-progress")
    one_error_line(result, "metrics.json", "train_loss is 'low', not a number")
    (adapter / "metrics.json").write_text("[" * 10_000 + "]" * 10_000)
    one_error_line(cli("finetune", base, "--train", train, "-o", adapter, "--epochs", "1"), "metrics.json", "nested")
    shutil.copy(trained / "metrics.json", adapter / "metrics.json")
    (adapter / ".base-model").write_text("x" * 10_000)
    before = state(adapter, train)
    one_error_line(predict(adapter, tmp_path / "p.csv"), ".base-model", "not the path of a model directory")
    check_untouched(before, tmp_path)


@pytest.mark.parametrize("fault", ["cut", "nan", "progress"])
def test_a_damaged_training_checkpoint_is_refused_on_resume(base, tmp_path, monkeypatch, fault):
    from safetensors import safe_open

    from esmc_mlx.finetune.train import Trainer

    train, out = write_csv(tmp_path / "train.csv", labeled(12)), tmp_path / "adapter"
    with monkeypatch.context() as patch:  # a run stopped after its last epoch's checkpoint
        patch.setattr(Trainer, "finish", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            finetune(base, train, out, epochs=2)
    checkpoint = out / "checkpoint.safetensors"
    with safe_open(str(checkpoint), framework="numpy") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if fault == "cut":
        checkpoint.write_bytes(checkpoint.read_bytes()[:-16])
        fragment = "truncated or corrupt safetensors file"
    elif fault == "nan":
        name = next(k for k in tensors if k.startswith("adapters.") and k.endswith("lora_b"))
        tensors[name][0, 0] = np.nan
        save_file(tensors, str(checkpoint), metadata=metadata)
        fragment = "NaN or Inf"
    else:
        save_file(tensors, str(checkpoint), metadata={"progress": "[" * 1000 + "]" * 1000})
        fragment = "progress: JSON nested 1000 levels deep"
    before = state(out, train)
    result = cli("finetune", base, "--train", train, "-o", out, "--epochs", "2", "--no-progress")
    line = one_error_line(result, "unreadable checkpoint", "checkpoint.safetensors", fragment)
    assert "--force" in line
    check_untouched(before, tmp_path)


SAE_CONFIG_FAULTS = {
    "nested": ('{"d_model": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
    "k-text": (lambda c: c.update(k="4"), "k must be a positive integer"),
    "layers-null": (lambda c: c.update(available_layers=None), "available_layers must be a non-empty list"),
    "width-bool": (lambda c: c.update(d_model=True), "d_model must be a positive integer"),
    "residual-text": (lambda c: c.update(use_residual_update_instead_of_states="no"), "must be true or false"),
    "list": ("[1, 2, 3]", "not a JSON object"),
}


@pytest.mark.parametrize("fault", sorted(SAE_CONFIG_FAULTS))
def test_a_damaged_sae_config_is_one_line_for_every_command(base, sae, tmp_path, fault):
    edit, fragment = SAE_CONFIG_FAULTS[fault]
    if isinstance(edit, str):
        (sae / "config.json").write_text(edit)
    else:
        edit_json(sae / "config.json", edit)
    before = state(sae, base)
    feats, quantized = tmp_path / "feats", tmp_path / "sae-bf16"
    results = [
        cli("features", base, "--sae", sae, "--sequence", SEQ, "-o", feats, "--no-progress"),
        cli("quantize-sae", sae, "-o", quantized, "--q", "bf16", "--no-validate"),
        cli("push", sae, "my-org/sae", "--dry-run"),
    ]
    for result in results:
        one_error_line(result, "config.json", fragment)
    assert not feats.exists() and not quantized.exists()
    check_untouched(before, tmp_path)


SAE_LAYER_FAULTS = {
    "overlap": "corrupt safetensors header",
    "cut": "truncated or corrupt safetensors file",
    "nan": "tensor W_enc of",
    "inf-vector": "tensor idf of",
    "integer": "tensor b_dec is I64",
}


@pytest.mark.parametrize("fault", sorted(SAE_LAYER_FAULTS))
def test_damaged_sae_weights_are_refused_where_they_enter(base, sae, tmp_path, fault):
    path = sae / "layer_1.safetensors"
    if fault == "overlap":
        rewrite_header(path, lambda h: h["W_dec"].update(data_offsets=h["W_enc"]["data_offsets"]))
    elif fault == "cut":
        path.write_bytes(path.read_bytes()[:-8])
    elif fault == "nan":
        edit_tensors(path, lambda t: t["W_enc"].__setitem__((3, 5), np.nan))
    elif fault == "inf-vector":
        edit_tensors(path, lambda t: t["idf"].__setitem__(0, -np.inf))
    else:
        edit_tensors(path, lambda t: t.update(b_dec=t["b_dec"].astype(np.int64)))
    before = state(sae, base)
    feats, quantized = tmp_path / "feats", tmp_path / "sae-8"
    for result in (
        cli("features", base, "--sae", sae, "--sequence", SEQ, "-o", feats, "--layer", "1", "--no-progress"),
        cli("quantize-sae", sae, "-o", quantized, "--q", "8", "--no-validate"),
    ):
        one_error_line(result, "layer_1.safetensors", SAE_LAYER_FAULTS[fault])
    with pytest.raises(ConfigError, match="layer_1.safetensors"):
        load_sae(sae).layer(1)
    assert load_sae(sae).layer(2).w_enc.shape == (128, 64)  # the other layer still reads
    assert not feats.exists() and not quantized.exists()
    check_untouched(before, tmp_path)


# --- rule 2: numbers that are not finite are stopped where they enter ---------------------------------
def test_quantize_sae_refuses_a_cast_that_overflows_float16(base, sae, tmp_path):
    edit_tensors(sae / "layer_2.safetensors", lambda t: t["W_dec"].__setitem__((1, 1), 1e6))
    before = state(sae)
    out = tmp_path / "sae-fp16"
    line = one_error_line(
        cli("quantize-sae", sae, "-o", out, "--q", "fp16", "--model", base), "tensor W_dec of", "overflows float16"
    )
    assert "layer_2.safetensors" in line and "1e+06" in line and "--q bf16" in line
    assert not out.exists()
    check_untouched(before, tmp_path)
    done = cli("quantize-sae", sae, "-o", out, "--q", "bf16", "--no-validate")  # bf16 holds it
    assert done.exit_code == 0, done.output
    with pytest.raises(ConfigError, match=r"tensor W_enc of .*layer_1\.safetensors overflows float16"):
        edit_tensors(sae / "layer_1.safetensors", lambda t: t["W_enc"].__setitem__((0, 0), -7e4))
        load_sae(sae, dtype=mx.float16).layer(1)


@pytest.mark.parametrize(
    "labels,fragment",
    [
        (["1e308", "-1e308"], "too wide a spread to scale in float64"),
        (["1.7e308", "1.7e308", "1e308"], "too wide a spread to scale in float64"),
        (["inf", "1"], "'inf' is not a number"),
        (["nan", "1"], "'nan' is not a number"),
    ],
)
def test_regression_targets_that_overflow_are_refused_before_training(base, tmp_path, labels, fragment):
    sequences = random_sequences(8, 10, 20, seed=3)
    rows = [(s, labels[i % len(labels)]) for i, s in enumerate(sequences)]
    train = write_csv(tmp_path / "train.csv", rows)
    before, out = state(train, base), tmp_path / "adapter"
    result = cli("finetune", base, "--train", train, "-o", out, "--task", "regression", "--no-progress")
    one_error_line(result, "train.csv", fragment)
    assert not out.exists()
    check_untouched(before, tmp_path)


def test_a_validation_target_too_far_to_scale_is_refused(base, tmp_path):
    sequences = random_sequences(10, 10, 20, seed=4)
    train = write_csv(tmp_path / "train.csv", [(s, i) for i, s in enumerate(sequences[:8])])
    valid = write_csv(tmp_path / "valid.csv", [(sequences[8], 1), (sequences[9], 1e300)])
    before, out = state(train, valid), tmp_path / "adapter"
    result = cli("finetune", base, "--train", train, "--valid", valid, "-o", out, "--task", "regression")
    one_error_line(result, "valid.csv, line 3", "1e+300 is too far from the training labels")
    assert not out.exists()
    check_untouched(before, tmp_path)


def test_training_that_diverges_stops_and_writes_no_nan_adapter(base, tmp_path):
    train = write_csv(tmp_path / "train.csv", labeled(24))
    out = tmp_path / "adapter"
    result = cli(
        "finetune", base, "--train", train, "-o", out, "--learning-rate", "1e30", "--batch-tokens", "64",
        "--epochs", "2", "--save-every", "0", "--no-progress",
    )  # fmt: skip
    one_error_line(result, "training diverged", "lower --learning-rate (now 1e+30)")
    assert not out.exists() and debris(tmp_path) == []


def test_a_prediction_that_is_not_finite_is_refused(base):
    model, _ = load(base, fuse=False)
    adapted = AdaptedModel(model, Labels("regression", mean=0.0, std=1.0))
    adapted.head.layers[0].bias = mx.array([np.nan], dtype=mx.float32)
    with pytest.raises(JobError, match="sequence 2: the model's output is NaN or Inf"):
        adapted.predict(["MKTAY", "MKTAYIAKQR"] * 1, names=["sequence 1", "sequence 2"])
    adapted = AdaptedModel(model, Labels("regression", mean=1.7e308, std=1.7e308))
    adapted.head.layers[0].bias = mx.array([1e3], dtype=mx.float32)
    with pytest.raises(JobError, match="is not a finite number .*past float64"):
        adapted.predict("MKTAY")


# --- rule 3: every job checks its records against memory before the first one --------------------------
def test_finetune_refuses_a_record_that_cannot_fit_and_leaves_nothing(base, tmp_path, little_memory):
    rows = [*labeled(4), ("MKTAYIAKQR" * 7000, "many_K")]
    train = write_csv(tmp_path / "train.csv", rows)
    before, out = state(train, base), tmp_path / "adapter"
    result = cli("finetune", base, "--train", train, "-o", out, "--no-progress")
    line = one_error_line(result, "train.csv, line 6 (70,000 residues)", "one training step would need about")
    assert "split the sequence" in line and "GiB" in line
    assert not out.exists() and not (tmp_path / ".adapter.lock").exists()
    check_untouched(before, tmp_path)


def test_finetune_says_when_gradient_checkpointing_would_fit(base, tmp_path, monkeypatch):
    train = write_csv(tmp_path / "train.csv", [*labeled(4), ("MKTAYIAKQR" * 120, "many_K")])
    need = scoring.forward_bytes(tiny_config(), 1, 1216, training=True, checkpointing=True)
    monkeypatch.setattr(scoring, "memory_bytes", lambda: need + (1 << 20))  # only a checkpointed step fits
    out, options = tmp_path / "adapter", ["--batch-tokens", "512", "--epochs", "1", "--no-progress"]
    result = cli("finetune", base, "--train", train, "-o", out, *options)
    one_error_line(result, "train.csv, line 6 (1,200 residues)", "pass --gradient-checkpointing (about")
    assert not out.exists() and debris(tmp_path) == []
    result = cli("finetune", base, "--train", train, "-o", out, *options, "--gradient-checkpointing")
    assert result.exit_code == 0, result.output


def test_finetune_refuses_batch_tokens_and_a_validation_record_past_memory(base, tmp_path, little_memory):
    train = write_csv(tmp_path / "train.csv", labeled(6))
    valid = write_csv(tmp_path / "valid.csv", [*labeled(2, seed=3), ("MKTAYIAKQR" * 3000, "few_K")])
    before, out = state(train, valid), tmp_path / "adapter"
    one_error_line(
        cli("finetune", base, "--train", train, "--valid", valid, "-o", out), "valid.csv, line 4 (30,000 residues)"
    )
    result = cli("finetune", base, "--train", train, "-o", out, "--batch-tokens", "100000000")
    one_error_line(
        result, "--batch-tokens 100,000,000", "give a smaller --batch-tokens or pass --gradient-checkpointing"
    )
    assert not out.exists()
    check_untouched(before, tmp_path)


def test_predict_refuses_a_record_that_cannot_fit_and_leaves_nothing(trained, tmp_path, little_memory):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">short\n{SEQ}\n>giant desc\n{'MKTAYIAKQR' * 7000}\n")
    table = write_csv(tmp_path / "in.csv", [(SEQ, 1), ("MKTAYIAKQR" * 7000, 2)], header=("sequence", "n"))
    before, out = state(fasta, table, trained), tmp_path / "p.csv"
    one_error_line(cli("predict", trained, "--fasta", fasta, "-o", out), "in.fa: record 'giant' (70,000 residues)")
    one_error_line(cli("predict", trained, "--csv", table, "-o", out), "in.csv, line 3 (70,000 residues)")
    result = cli("predict", trained, "--sequence", "MKTAYIAKQR" * 7000, "-o", out)
    one_error_line(result, "--sequence (70,000 residues)", "split the record")
    assert not out.exists() and not (tmp_path / ".p.csv.lock").exists()
    check_untouched(before, tmp_path)


def test_attention_refuses_a_record_that_cannot_fit(base, tmp_path, little_memory):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">short\n{SEQ}\n>giant\n{'MKTAYIAKQR' * 3000}\n")
    before, out = state(fasta), tmp_path / "maps"
    result = cli("attention", base, "--fasta", fasta, "-o", out, "--no-plot", "--no-progress")
    one_error_line(result, "in.fa: record 'giant' (30,000 residues)", "split the record")
    assert not out.exists()
    check_untouched(before, tmp_path)


# --- rule 4: an input is never the output, however it was found ----------------------------------------
def test_fuse_onto_the_base_the_adapter_records_is_refused(trained, tmp_path):
    base = Path((trained / ".base-model").read_text().strip())
    before = state(base, trained)
    line = one_error_line(cli("predict", trained, "--fuse", base, "--force"), "is the input", str(base))
    assert f"the base model {trained} records" in line
    one_error_line(cli("predict", trained, "--fuse", base / "fused"), "is inside the input", "records")
    one_error_line(predict(trained, base / "p.csv"), "is inside the input", "records")
    one_error_line(cli("predict", trained, "--fuse", base.parent, "--force"), "contains the input")
    check_untouched(before, tmp_path)
    assert load_adapter(trained).predict(SEQ).values  # the base still loads


def test_fuse_onto_a_base_named_with_base_is_refused(trained, tmp_path):
    base = Path((trained / ".base-model").read_text().strip())
    copy = Path(shutil.copytree(base, tmp_path / "base-copy"))
    before = state(copy)
    line = one_error_line(cli("predict", trained, "--base", copy, "--fuse", copy, "--force"), "is the input")
    assert str(copy) in line
    check_untouched(before, tmp_path)


def test_an_output_in_the_hub_cache_copy_of_an_input_is_refused(hub, base, tmp_path):
    repo = "my-org/esmc-tiny-base"
    hub.state.create_repo(repo)
    hub.state.commit_files(repo, {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()}, "base")
    adapter = finetune(repo, write_csv(tmp_path / "train.csv", labeled(8)), tmp_path / "adapter", epochs=1).out
    cached = resolve.local_copy(repo)
    assert cached is not None and cached.is_dir()
    before = state(cached)
    snapshot_dir = next((cached / "snapshots").iterdir())
    line = one_error_line(cli("predict", adapter, "--fuse", snapshot_dir, "--force"), "is the input")
    assert f"the base model {adapter} records" in line
    line = one_error_line(predict(adapter, snapshot_dir / "p.csv"), "is inside the input")
    assert f"the base model {adapter} records" in line
    (tmp_path / "in.fa").write_text(f">a\n{SEQ}\n")
    line = one_error_line(cli("embed", repo, tmp_path / "in.fa", "-o", snapshot_dir / "emb"), "is inside the input")
    assert f"where {repo} is kept on this machine" in line
    check_untouched(before, tmp_path)


def test_an_output_inside_a_packaged_model_is_refused(base, tmp_path, monkeypatch):
    packaged = Path(shutil.copytree(base, tmp_path / "packaged"))
    monkeypatch.setitem(resolve.LOCAL_ALIASES, "tiny", packaged)
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    before = state(packaged, fasta)
    line = one_error_line(cli("embed", "tiny", fasta, "-o", packaged / "emb"), "is inside the input")
    assert "where tiny is kept on this machine" in line
    one_error_line(cli("quantize", packaged, "-o", packaged / "q4", "--q", "4"), "inside the input")
    check_untouched(before, tmp_path)


# --- the QLoRA base on the CPU ---------------------------------------------------------------------------
def test_a_quantized_base_is_dequantized_for_training_on_the_cpu_when_it_fits(base, tmp_path, monkeypatch):
    from esmc_mlx.convert import quantize_directory

    packed = quantize_directory(base, tmp_path / "q4", "4", progress=False)
    model, _ = load(packed, fuse=False, compile=False)
    assert training_base(model) == "float"
    layer = model.esmc.layers[0].mlp.up_proj
    assert type(layer).__name__ == "Linear" and layer.weight.dtype == mx.float32 and not layer.trainable_parameters()
    monkeypatch.setattr(finetune_model, "FLOAT_BASE_SHARE", 0.0)  # no room: QLoRA stays packed
    model, _ = load(packed, fuse=False, compile=False)
    assert training_base(model) == "packed"
    assert type(model.esmc.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
