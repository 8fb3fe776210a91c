"""Fine-tuning: LoRA / QLoRA with a task head (mlx-lm's LoRA layers), the adapter directory,
resuming a killed run, predictions, fusing, publishing, and the errors of bad CSVs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from click.testing import CliRunner
from conftest_hub import hub, no_remote_network  # noqa: F401  (fixtures)
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm", reason="fine-tuning needs the finetune extra (mlx-lm)")

from esmc_mlx import load, load_adapter  # noqa: E402
from esmc_mlx.cli import main  # noqa: E402
from esmc_mlx.convert import quantize_directory  # noqa: E402
from esmc_mlx.errors import JobError  # noqa: E402
from esmc_mlx.finetune import ADAPTER_FILES, finetune, fuse_adapter  # noqa: E402
from esmc_mlx.finetune.data import Labels  # noqa: E402
from esmc_mlx.finetune.model import AdaptedModel, loss_fn, pack, plain_quantized, token_batches  # noqa: E402
from esmc_mlx.finetune.train import Trainer, training_memory_limit  # noqa: E402
from esmc_mlx.hub.push import push_artifact  # noqa: E402
from esmc_mlx.testing import child_env, console_command, random_sequences, tiny_config, write_random_artifact  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture(autouse=True)
def cpu(on_cpu):
    """Resumed weights are compared bit for bit: on the CPU, where nothing is compiled."""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_random_artifact(tmp_path_factory.mktemp("base") / "tiny", tiny_config(), mx.float32)


def write_csv(path: Path, rows: list[tuple], header=("sequence", "label")) -> Path:
    path.write_text(",".join(header) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


def labeled(n: int = 24, seed: int = 1) -> list[tuple[str, str]]:
    """Sequences labeled by a rule the model can learn: many lysines or not."""
    return [(s, "many_K" if s.count("K") >= 2 else "few_K") for s in random_sequences(n, 12, 40, seed=seed)]


def adapted_model(base_dir: Path, task: str = "classification", classes=("a", "b"), layers: int = 2):
    model, _ = load(base_dir, fuse=False, compile=False)
    plain_quantized(model)
    labels = Labels(task, classes=list(classes)) if task != "regression" else Labels(task, mean=0.0, std=1.0)
    mx.random.seed(0)
    adapted = AdaptedModel(model, labels)
    adapted.add_lora(4, layers, 2.0)
    return adapted


def batch(adapted, sequences, targets):
    encoded, batches = token_batches(sequences, 1 << 20)
    return pack(encoded, batches[0], [targets[i] for i in range(len(sequences))], adapted.labels), batches[0]


# --- the model ----------------------------------------------------------------------------------
def test_a_lora_step_changes_only_adapter_and_head_parameters(base):
    adapted = adapted_model(base, layers=1)  # the top block only: the lower block has no adapters
    sequences = random_sequences(6, 10, 30, seed=3)
    (ids, attention, targets), _ = batch(adapted, sequences, [0, 1, 0, 1, 1, 0])
    before = {k: np.array(v) for k, v in tree_flatten(adapted.parameters())}
    trainable = {k for k, _ in tree_flatten(adapted.trainable_parameters())}
    assert trainable and all(k.startswith("head.") or k.endswith((".lora_a", ".lora_b")) for k in trainable)
    assert not any(k.startswith("base.esmc.layers.0.") for k in trainable)

    optimizer = optim.AdamW(learning_rate=1e-2)
    (loss, _), grads = nn.value_and_grad(adapted, loss_fn)(adapted, ids, attention, targets)
    optimizer.update(adapted, grads)
    after = {k: np.array(v) for k, v in tree_flatten(adapted.parameters())}
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed <= trainable
    assert any(k.endswith(".lora_b") for k in changed) and any(k.startswith("head.") for k in changed)
    assert np.isfinite(loss.item())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_training_forward_is_the_runtime_forward(base, checkpointing):
    adapted = adapted_model(base)
    sequences = random_sequences(5, 8, 50, seed=4)
    (ids, attention, targets), _ = batch(adapted, sequences, [0, 1, 0, 1, 1])
    object.__setattr__(adapted, "gradient_checkpointing", checkpointing)
    trained = adapted.encode(ids, attention)
    runtime = adapted.base(ids, attention_mask=attention).last_hidden_state
    real = np.array(attention).astype(bool)
    np.testing.assert_allclose(np.array(trained)[real], np.array(runtime)[real], rtol=1e-5, atol=1e-5)


def test_the_training_blocks_on_rows_give_the_gradients_of_the_batched_layout(base, monkeypatch):
    """``block`` runs on (tokens, width) rows for fewer graph nodes a step; the loss and every
    gradient are bit for bit those of the same block on (batch, length, width) activations
    (the runtime's modules called as they are in inference)."""
    from esmc_mlx.finetune import model as finetune_model

    def batched_encode(self, ids, attention):
        encoder = self.base.esmc
        mask = finetune_model.additive_mask(finetune_model.attention_mask_for(attention, None), self.base.dtype)
        x = encoder.embed_tokens(ids)
        for layer in encoder.layers:
            attended, _ = layer.self_attn(layer.input_layernorm(x), mask)
            x = x + attended / layer.residual_scale
            x = x + layer.mlp(layer.post_attention_layernorm(x)) / layer.residual_scale
        return encoder.norm(x)

    from mlx.utils import tree_map

    adapted = adapted_model(base)
    mx.random.seed(6)  # every adapter non-zero: gradients reach lora_a too
    adapted.update(tree_map(lambda v: v + 0.05 * mx.random.normal(v.shape), adapted.trainable_parameters()))
    sequences = random_sequences(4, 8, 40, seed=6)
    (ids, attention, targets), _ = batch(adapted, sequences, [0, 1, 1, 0])
    runs = []
    for encode in (AdaptedModel.encode, batched_encode):
        monkeypatch.setattr(AdaptedModel, "encode", encode)
        (loss, _), g = nn.value_and_grad(adapted, loss_fn)(adapted, ids, attention, targets)
        runs.append((np.array(loss), {k: np.array(v) for k, v in tree_flatten(g)}))
    (rows_loss, rows), (batched_loss, batched) = runs
    assert np.array_equal(rows_loss, batched_loss) and rows.keys() == batched.keys()
    assert all(np.array_equal(rows[k], batched[k]) for k in rows), [
        k for k in rows if not np.array_equal(rows[k], batched[k])
    ]
    assert all(np.abs(v).max() > 0 for k, v in rows.items() if k.endswith((".lora_a", ".lora_b")))


def test_gradient_checkpointing_gives_the_same_gradients(base):
    adapted = adapted_model(base)
    sequences = random_sequences(4, 8, 40, seed=5)
    (ids, attention, targets), _ = batch(adapted, sequences, [0, 1, 1, 0])
    adapted.head.layers[0].weight = adapted.head.layers[0].weight + 0.5  # non-zero gradients into the adapters
    grads = {}
    for checkpointing in (False, True):
        object.__setattr__(adapted, "gradient_checkpointing", checkpointing)
        _, g = nn.value_and_grad(adapted, loss_fn)(adapted, ids, attention, targets)
        grads[checkpointing] = dict(tree_flatten(g))
    assert grads[True].keys() == grads[False].keys()
    for k in grads[False]:
        np.testing.assert_allclose(np.array(grads[True][k]), np.array(grads[False][k]), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("compiled", [False, True])
def test_accumulated_batches_make_one_update_of_their_mean_gradient(base, compiled):
    from mlx.utils import tree_map

    from esmc_mlx.finetune.train import Updates

    sequences = random_sequences(6, 8, 40, seed=6)
    parts = [batch(adapted_model(base), sequences[i : i + 3], [0, 1, 1])[0] for i in (0, 3)]
    reference, accumulated = adapted_model(base), adapted_model(base)
    for m in (reference, accumulated):  # non-zero gradients into the adapters
        m.head.layers[0].weight = m.head.layers[0].weight + 0.5
    grads = [nn.value_and_grad(reference, loss_fn)(reference, *p)[1] for p in parts]
    optim.AdamW(learning_rate=1e-2).update(reference, tree_map(lambda a, b: (a + b) / 2, *grads))

    updates = Updates(accumulated, optim.AdamW(learning_rate=1e-2), accumulate=2, compile=compiled)
    before = {k: np.array(v) for k, v in tree_flatten(accumulated.trainable_parameters())}
    updates(*parts[0])
    mx.eval(updates.state)
    assert updates.pending == 1
    unchanged = dict(tree_flatten(accumulated.trainable_parameters()))
    assert all(np.array_equal(before[k], np.array(v)) for k, v in unchanged.items())  # no update yet
    updates(*parts[1])
    mx.eval(updates.state)
    assert updates.pending == 0
    want = dict(tree_flatten(reference.trainable_parameters()))
    for k, v in tree_flatten(accumulated.trainable_parameters()):
        np.testing.assert_allclose(np.array(v), np.array(want[k]), rtol=1e-5, atol=1e-7, err_msg=k)


# --- training, predicting, fusing -----------------------------------------------------------------
def test_finetune_writes_the_adapter_and_predicts(base, tmp_path):
    train = write_csv(tmp_path / "train.csv", labeled(32))
    valid = write_csv(tmp_path / "valid.csv", labeled(12, seed=2))
    out = tmp_path / "adapter"
    summary = finetune(base, train, out, valid=valid, epochs=3, seed=0)
    assert len(summary.history) == 3 and summary.best_epoch in (1, 2, 3)
    assert {p.name for p in out.iterdir()} >= set(ADAPTER_FILES) - {"metrics.png"}
    assert not (out / "checkpoint.safetensors").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["rank"] == 8
    meta = config["esmc_mlx"]
    assert meta["complete"] and meta["labels"]["classes"] == ["few_K", "many_K"]
    assert meta["base"]["repo_id"] is None and meta["base"]["files"]["model.safetensors"]
    assert str(tmp_path) not in (out / "adapter_config.json").read_text()  # no local path in the config
    metrics = json.loads((out / "metrics.json").read_text())["epochs"]
    assert [m["epoch"] for m in metrics] == [1, 2, 3] and "valid_accuracy" in metrics[0]

    model = load_adapter(out)  # the local base found through .base-model, sha256 checked
    result = model.predict([s for s, _ in labeled(5, seed=9)])
    assert result.values and set(result.values) <= {"few_K", "many_K"}
    np.testing.assert_allclose(result.probabilities.sum(-1), 1.0, rtol=1e-5)

    runner = CliRunner()
    pred = tmp_path / "pred.csv"
    done = runner.invoke(main, ["predict", str(out), "--csv", str(valid), "-o", str(pred)])
    assert done.exit_code == 0, done.output
    lines = pred.read_text().splitlines()
    assert lines[0] == "sequence,label,prediction,p_few_K,p_many_K" and len(lines) == 13

    rerun = ["finetune", str(base), "--train", str(train), "--valid", str(valid), "-o", str(out), "--epochs", "3"]
    again = runner.invoke(main, rerun)
    assert again.exit_code == 0 and "already holds this finished run" in again.output
    other = runner.invoke(main, [*rerun, "--lora-rank", "4"])
    assert other.exit_code == 1 and "other settings" in other.output and "lora_parameters.rank" in other.output


def test_fused_model_reproduces_the_adapted_outputs(base, tmp_path):
    train = write_csv(tmp_path / "train.csv", labeled(16))
    out = finetune(base, train, tmp_path / "adapter", epochs=2).out
    adapted = load_adapter(out)
    fused_dir = fuse_adapter(out, tmp_path / "fused")
    fused, tokenizer = load(fused_dir)
    sequences = random_sequences(4, 10, 40, seed=6)
    encoded, batches = token_batches(sequences, 1 << 20)
    ids, attention, _ = pack(encoded, batches[0], None, adapted.labels)
    np.testing.assert_allclose(
        np.array(fused(ids, attention_mask=attention).last_hidden_state),
        np.array(adapted.base(ids, attention_mask=attention).last_hidden_state),
        rtol=1e-4,
        atol=1e-5,
    )
    base_model, _ = load(base)
    assert not np.allclose(  # the adapters did change the encoder
        np.array(base_model(ids, attention_mask=attention).last_hidden_state),
        np.array(adapted.base(ids, attention_mask=attention).last_hidden_state),
        atol=1e-5,
    )


def test_qlora_on_a_4bit_model_keeps_it_packed_trains_and_predicts(base, tmp_path):
    packed = quantize_directory(base, tmp_path / "tiny-4bit", "4", progress=False)
    train = write_csv(tmp_path / "train.csv", labeled(24))
    out = tmp_path / "qlora"
    summary = finetune(packed, train, out, valid=train, epochs=3, patience=0)
    losses = [h["valid_loss"] for h in summary.history]
    assert losses[-1] < losses[0]
    with open(out / "adapters.safetensors", "rb") as f:
        names = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert all(k == "__metadata__" or k.endswith((".lora_a", ".lora_b")) for k in names)
    model = load_adapter(out)
    lora = [m for _, m in model.base.named_modules() if type(m).__name__ == "LoRALinear"]
    assert lora and all(isinstance(m.linear, nn.QuantizedLinear) for m in lora)  # the base stays packed
    assert model.base.esmc.layers[0].mlp.down_proj.linear.weight.dtype == mx.uint32
    assert len(model.predict([s for s, _ in labeled(3, seed=7)]).values) == 3


def test_regression_and_per_residue_tasks(base, tmp_path):
    sequences = random_sequences(16, 10, 30, seed=8)
    reg = write_csv(tmp_path / "reg.csv", [(s, s.count("A") + 0.5) for s in sequences])
    model = load_adapter(finetune(base, reg, tmp_path / "reg", task="regression", epochs=2).out)
    values = model.predict(sequences[:3]).values
    assert all(isinstance(v, float) for v in values)

    strings = write_csv(tmp_path / "ss.csv", [(s, "".join("H" if c in "AEL" else "C" for c in s)) for s in sequences])
    model = load_adapter(finetune(base, strings, tmp_path / "ss", task="per-residue", epochs=2).out)
    predicted = model.predict(sequences[:2]).values
    assert [len(p) for p in predicted] == [len(s) for s in sequences[:2]] and set("".join(predicted)) <= {"H", "C"}

    positions = write_csv(tmp_path / "pos.csv", [(s, '"1,3"') for s in sequences])
    model = load_adapter(finetune(base, positions, tmp_path / "pos", task="per-residue", epochs=1).out)
    assert model.labels.positions and model.labels.classes == ["0", "1"]


# --- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rows, options, message",
    [
        ([("MKTAYIAK", "a"), ("MKV", "b")], ["--label-column", "class"], "no 'class' column"),
        (
            [("MKTAYIAK", "a"), ("MKV", "a")],
            [],
            "every row of the label column is 'a'; classification needs at least two classes",
        ),
        ([("MKTAYIAK", "HHHH"), ("MKV", "HEC")], ["--task", "per-residue"], "line 2: label column: the label has 4"),
        (
            [("MKTAYIAK", "1.5"), ("MKV", "high")],
            ["--task", "regression"],
            "line 3: label column: 'high' is not a number",
        ),
        ([("MKTAYIAK", "a"), ("MK1V", "b")], [], "line 3: sequence column: invalid character '1' at position 3"),
        ([("MKTAYIAK", "HHHH"), ("MKV", "1,9")], ["--task", "per-residue"], "the label has 4 characters"),
    ],
)
def test_bad_csvs_get_one_clear_error_and_leave_nothing(base, tmp_path, rows, options, message):
    train = write_csv(tmp_path / "train.csv", rows)
    out = tmp_path / "adapter"
    result = CliRunner().invoke(main, ["finetune", str(base), "--train", str(train), "-o", str(out), *options])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["train.csv"]


def test_training_runs_under_the_memory_limit_and_restores_mlxs(base, tmp_path, monkeypatch):
    seen, run = [], Trainer.run
    monkeypatch.setattr(Trainer, "run", lambda self, *a: (seen.append(mx.get_memory_limit()), run(self, *a)))
    before = mx.get_memory_limit()
    finetune(base, write_csv(tmp_path / "train.csv", labeled(8)), tmp_path / "a", epochs=1, memory_limit=0.5)
    assert seen == [int(0.5e9)] and mx.get_memory_limit() == before
    finetune(base, write_csv(tmp_path / "train.csv", labeled(8)), tmp_path / "b", epochs=1)
    assert seen[1] == before  # on the CPU: MLX's own


def test_the_default_memory_limit_is_a_share_of_the_gpus_memory():
    gib = 2**30
    metal, cuda = {"memory_size": 16 * gib, "device_name": "Apple M2"}, {"total_memory": 80 * gib}
    # 12.0 GB on the Mac: the limit the 6B QLoRA step was measured under
    assert training_memory_limit(None, metal) == int(0.7 * 16 * gib)
    assert training_memory_limit(None, cuda) == int(0.7 * 80 * gib)
    assert training_memory_limit(None, None) is None and training_memory_limit(None, {}) is None
    assert training_memory_limit(2.5, cuda) == 2_500_000_000


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_bad_memory_limit_is_refused_before_anything_is_written(base, tmp_path, value):
    train = write_csv(tmp_path / "train.csv", labeled(8))
    out = tmp_path / "adapter"
    result = CliRunner().invoke(
        main, ["finetune", str(base), "--train", str(train), "-o", str(out), "--memory-limit", value]
    )
    assert result.exit_code == 2 and "--memory-limit" in result.output and not out.exists(), result.output
    with pytest.raises(JobError, match="memory_limit must be a positive number"):
        finetune(base, train, out, memory_limit=0)
    assert not out.exists()


def test_a_position_outside_the_sequence_is_named(base, tmp_path):
    train = write_csv(tmp_path / "train.csv", [("MKTAYIAK", '"2,9"'), ("MKV", "1")])
    result = CliRunner().invoke(
        main, ["finetune", str(base), "--train", str(train), "-o", str(tmp_path / "o"), "--task", "per-residue"]
    )
    assert result.exit_code == 1 and "line 2: label column: position 9 is outside the sequence" in result.output


# --- resume after SIGKILL -----------------------------------------------------------------------
@pytest.mark.slow  # two runs of a few epochs in child processes
@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(base, tmp_path, accumulate):
    train = write_csv(tmp_path / "train.csv", labeled(48))
    valid = write_csv(tmp_path / "valid.csv", labeled(12, seed=2))
    args = ["finetune", str(base), "--train", str(train), "--valid", str(valid), "--epochs", "6", "--patience", "0"]
    args += ["--batch-tokens", "512", "--save-every", "1", "--no-progress"]
    args += ["--grad-accumulation-steps", str(accumulate)]
    env = child_env()
    whole = tmp_path / "whole"
    subprocess.run(console_command("esmc-mlx") + args + ["-o", str(whole)], env=env, check=True, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(console_command("esmc-mlx") + args + ["-o", str(killed)], env=env)
    checkpoint = killed / "checkpoint.safetensors"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (
            checkpoint.exists()
            and json.loads((killed / "adapter_config.json").read_text())["esmc_mlx"]["complete"] is False
        ):
            metrics = killed / "metrics.json"
            if metrics.exists() and len(json.loads(metrics.read_text())["epochs"]) >= 1:
                break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists(), "the run finished before it could be killed"

    resumed = subprocess.run(
        console_command("esmc-mlx") + args + ["-o", str(killed)], env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at epoch" in resumed.stdout
    for name in ("adapters.safetensors", "head.safetensors", "metrics.json"):
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name


# --- publishing ---------------------------------------------------------------------------------
def host_base(hub, base: Path, repo_id: str = "my-org/esmc-tiny-base") -> str:
    hub.state.create_repo(repo_id)
    hub.state.commit_files(repo_id, {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()}, "base")
    return repo_id


def test_push_publishes_the_adapter_and_it_loads_from_the_hub(hub, base, tmp_path):
    from huggingface_hub import HfApi, ModelCard

    repo = host_base(hub, base)
    train = write_csv(tmp_path / "train.csv", labeled(16))
    out = finetune(repo, train, tmp_path / "adapter", epochs=2).out
    config = json.loads((out / "adapter_config.json").read_text())["esmc_mlx"]["base"]
    assert config["repo_id"] == repo and len(config["revision"]) == 40

    result = CliRunner().invoke(main, ["push", str(out), "my-org/tiny-adapter"])
    assert result.exit_code == 0, result.output
    assert 'load_adapter("my-org/tiny-adapter")' in result.output
    files = set(HfApi().list_repo_files("my-org/tiny-adapter"))
    assert {"README.md", "adapter_config.json", "adapters.safetensors", "head.safetensors", "metrics.json"} <= files
    assert not any(name in (".base-model", ".esmc-mlx") or "checkpoint" in name for name in files)
    card = ModelCard((out / "README.md").read_text())
    assert card.data.base_model == repo and "lora" in card.data.tags
    assert 'load_adapter("my-org/tiny-adapter")' in card.text

    sequences = [s for s, _ in labeled(4, seed=5)]
    np.testing.assert_allclose(
        load_adapter("my-org/tiny-adapter").predict(sequences).probabilities,
        load_adapter(out).predict(sequences).probabilities,
        rtol=1e-6,
    )


def test_push_refuses_an_adapter_whose_base_it_cannot_name(hub, base, tmp_path):
    from esmc_mlx.errors import HubError

    out = finetune(base, write_csv(tmp_path / "train.csv", labeled(12)), tmp_path / "adapter", epochs=1).out
    with pytest.raises(HubError, match="its base model is a local directory"):
        push_artifact(out, "my-org/tiny-adapter", dry_run=True)
    assert not any(r[0] in ("POST", "PUT") for r in hub.state.log)


@pytest.mark.slow  # two fresh interpreters (the benchmark and its MLX side)
def test_the_training_speed_benchmark_records_its_steps_and_provenance(tmp_path):
    """benchmarks/finetune_speed on the CPU, MLX alone under MLX's own memory limit: its JSON
    holds every step's time, the host's share of a step, and the source commit and device that
    ``python -m benchmarks.compare`` reads."""
    import sys

    from esmc_mlx import bench

    command = [sys.executable, "-m", "benchmarks.finetune_speed", "--model", "tiny", "--dtype", "float32"]
    command += ["--shape", "2x16", "--steps", "2", "--warmup", "1", "--device", "cpu", "--no-torch"]
    command += ["--memory-limit", "mlx", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=bench.ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "finetune_speed.json").read_text())
    mlx = record["mlx"]
    assert len(mlx["times_s"]) == 2 and mlx["min_s"] <= mlx["median_s"] and 0 < mlx["host_median_s"]
    assert "torch" not in record and record["job"]["memory_limit"] == "mlx"
    assert record["provenance"]["commit"] == bench.source_commit()[0] and record["provenance"]["backend"] == "cpu"
    assert "all of it queued after" in done.stdout
