"""``esmc-mlx finetune``: train LoRA adapters and a task head on labeled sequences, resumable.

The output directory is an ``outputs.OutputFolder``, as ``esmc-mlx embed``'s is: checked before
any work, written in place under its lock, each file whole and recorded in its marker: a checkpoint (adapters,
head, optimizer state, progress) after every epoch and every ``save_every`` steps, so that a
killed run, started again with the same command, resumes from its last checkpoint and ends
with the weights an uninterrupted run would have (batches are drawn from the seed and the
epoch, and nothing else is random after the adapters are made).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from .._version import __version__
from ..artifact import load_safetensors, read_model_config, safetensors_header, sha256
from ..config import ESMCConfig
from ..errors import JobError
from ..outputs import guarded, held
from ..privacy import public_path
from ..readers import parse_json
from ..resolve import resolve
from ..runtime.load import load
from ..tasks import scoring
from ..tasks.scoring import check_records_memory, forward_bytes, positive_int
from . import adapter as files
from .data import LabeledSet, Labels, read_labeled
from .model import (
    HEADS,
    METRIC_NAMES,
    POOLS,
    AdaptedModel,
    batch_predictions,
    loss_fn,
    metric,
    token_batches,
    training_base,
)
from .model import lora_parameters as lora_settings
from .model import pack as pack_batch

DEFAULTS = {
    "lora_rank": 8,
    "lora_scale": 2.0,
    "learning_rate": 1e-3,
    "epochs": 10,
    "batch_tokens": 4096,
    "patience": 3,
    "save_every": 100,
    "grad_accumulation_steps": 1,
}


# What adapter_config.json records about how the run went, not how it was asked for.
OUTCOME = ("complete", "best_epoch", "stopped_early")


@dataclasses.dataclass
class FinetuneSummary:
    out: Path
    history: list[dict]  # per epoch: train / valid loss and metric
    best_epoch: int | None  # the epoch whose weights were kept (lowest validation loss)
    resumed_from: str | None  # "epoch N, step M" of the checkpoint a rerun started from
    stopped_early: bool
    already_done: bool = False  # OUT held this finished run: nothing was trained


class Running:
    """An epoch's running loss and metric (what the progress bar shows, and metrics.json keeps)."""

    def __init__(self, labels: Labels, state: dict | None = None):
        self.labels = labels
        state = state or {}
        self.loss_sum = state.get("loss_sum", 0.0)
        self.rows = state.get("rows", 0)
        self.hits = state.get("hits", 0)
        self.total = state.get("total", 0)
        self.values = state.get("values", [])  # regression: (prediction, target) pairs
        self.targets = state.get("targets", [])

    def add(self, loss: float, rows: int, predictions: list, targets: list) -> None:
        self.loss_sum += loss * rows
        self.rows += rows
        if self.labels.task == "regression":
            self.values += [float(p) for p in predictions]
            self.targets += [float(t) for t in targets]
        elif self.labels.task == "classification":
            self.hits += int(sum(int(p == t) for p, t in zip(predictions, targets)))
            self.total += len(targets)
        else:
            self.hits += int(sum(int((p == t).sum()) for p, t in zip(predictions, targets)))
            self.total += int(sum(len(t) for t in targets))

    @property
    def loss(self) -> float:
        return self.loss_sum / self.rows if self.rows else math.nan

    @property
    def metric(self) -> float:
        if self.labels.task == "regression":
            return metric(self.labels, [np.array(self.values)], self.targets)
        return self.hits / self.total if self.total else math.nan

    def state(self) -> dict:
        keys = ("loss_sum", "rows", "hits", "total", "values", "targets")
        return {k: getattr(self, k) for k in keys}


# The share of a GPU's memory training lets MLX hold before it waits for queued work (whose
# buffers stay alive until it runs): 12 GB of a 16 GB Mac. A 6B-shaped 4-bit QLoRA step of
# 4,096 tokens peaked at 13.2 GB under a 12 GB limit and at 29.1 GB under MLX's default on an
# 80 GB H100, at 580 and 549 tokens/s (docs/finetune.md).
GPU_MEMORY_SHARE = 0.7


def training_memory_limit(gb: float | None, device_info: dict | None) -> int | None:
    """The memory limit in bytes training runs under: ``gb`` GB if given, else
    ``GPU_MEMORY_SHARE`` of the GPU's memory (``device_info``: ``mx.device_info()`` of the GPU
    training runs on, None on the CPU); None: MLX's own."""
    if gb is not None:
        return int(gb * 1e9)
    info = device_info or {}
    total = info.get("memory_size") or info.get("total_memory")  # Metal's key, CUDA's
    return int(total * GPU_MEMORY_SHARE) if total else None


@contextlib.contextmanager
def under_memory_limit(gb: float | None):
    """Run the block under ``training_memory_limit`` for the default device; MLX's previous
    limit is restored afterwards."""
    limit = training_memory_limit(gb, None if mx.default_device() == mx.cpu else mx.device_info())
    previous = None if limit is None else mx.set_memory_limit(limit)
    try:
        yield
    finally:
        if previous is not None:
            mx.set_memory_limit(previous)


def _check_options(
    lora_rank,
    lora_layers,
    lora_scale,
    head,
    pool,
    epochs,
    learning_rate,
    batch_tokens,
    patience,
    accumulate,
    memory_limit=None,
):
    positive_int(lora_rank, "lora_rank")
    positive_int(accumulate, "grad_accumulation_steps")
    positive_int(epochs, "epochs")
    positive_int(batch_tokens, "batch_tokens")
    if lora_layers != "all":
        positive_int(lora_layers, "lora_layers")
    if head not in HEADS:
        raise JobError(f"--head {head!r}: choose one of {', '.join(HEADS)}")
    if pool not in POOLS:
        raise JobError(f"--pool {pool!r}: choose one of {', '.join(POOLS)}")
    numbers = {"learning_rate": learning_rate, "lora_scale": lora_scale}
    if memory_limit is not None:
        numbers["memory_limit"] = memory_limit
    for name, value in numbers.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise JobError(f"{name} must be a positive number, got {value!r}")
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
        raise JobError(f"patience must be 0 (no early stopping) or a positive integer, got {patience!r}")


def check_training_memory(
    config: ESMCConfig, train: LabeledSet, valid: LabeledSet | None, batch_tokens: int, checkpointing: bool
) -> None:
    """ScoringError, before the output is made, when the longest sequence of the training CSV
    alone, or a batch of ``batch_tokens``, would not fit a training step in this machine's
    memory (the validation CSV: a forward pass): the check ``embed`` makes before its first
    forward (``scoring.check_records_memory``), for a step whose backward needs the forward's
    activations. Says whether --gradient-checkpointing would make it fit."""
    lengths = [len(s) for s in train.sequences]
    fits = forward_bytes(config, 1, max(lengths, default=0) + 2, training=True, checkpointing=True)
    if not checkpointing and fits <= scoring.memory_bytes():
        fix_record = f"pass --gradient-checkpointing (about {fits / 2**30:,.1f} GiB: each block recomputed)"
    else:
        fix_record = "attention grows with the square of the length: split the sequence or leave it out of the CSV"
    check_records_memory(
        config,
        lengths,
        batch_tokens,
        lambda i: train.table.where[i].rstrip(": "),
        fix_record=fix_record,
        fix_batch="give a smaller --batch-tokens" + ("" if checkpointing else " or pass --gradient-checkpointing"),
        training=True,
        checkpointing=checkpointing,
    )
    if valid is not None:
        check_records_memory(
            config,
            [len(s) for s in valid.sequences],
            batch_tokens,
            lambda i: valid.table.where[i].rstrip(": "),
            fix_record="attention grows with the square of the length: split the sequence or leave it out of the CSV",
        )


def _data_record(path: Path, data: LabeledSet) -> dict:
    return {"file": public_path(path), "sha256": sha256(path), "rows": len(data.sequences)}


@guarded("out", "adapter", "folder", inputs=("model", "train", "valid"))
def finetune(
    model: str | Path,
    train: str | Path,
    out: str | Path,
    *,
    valid: str | Path | None = None,
    task: str = "classification",
    sequence_column: str = "sequence",
    label_column: str = "label",
    lora_rank: int = DEFAULTS["lora_rank"],
    lora_layers: int | str = "all",
    lora_scale: float = DEFAULTS["lora_scale"],
    head: str = "linear",
    pool: str = "mean",
    epochs: int = DEFAULTS["epochs"],
    learning_rate: float = DEFAULTS["learning_rate"],
    batch_tokens: int = DEFAULTS["batch_tokens"],
    seed: int = 0,
    patience: int = DEFAULTS["patience"],
    gradient_checkpointing: bool = False,
    grad_accumulation_steps: int = DEFAULTS["grad_accumulation_steps"],
    save_every: int = DEFAULTS["save_every"],
    memory_limit: float | None = None,
    revision: str | None = None,
    force: bool = False,
    progress: bool = False,
) -> FinetuneSummary:
    """Fine-tune ``model`` (an alias, Hub repo id or MLX directory; float or quantized) on the
    CSV ``train`` and write the adapter directory ``out`` (see ``finetune.adapter``).

    ``task``: classification (one label per sequence), regression (a number per sequence) or
    per-residue (a label string as long as the sequence, or 1-based positions "3,17" of class
    "1"). LoRA of rank ``lora_rank`` on every block projection of the top ``lora_layers``
    blocks ("all"), a ``head`` (linear, mlp) on the ``pool``-ed final hidden state (mean over
    residues, or the <cls> token). AdamW at ``learning_rate``; batches of at most
    ``batch_tokens`` padded tokens, grouped by length and shuffled per epoch from ``seed``.
    With ``valid``, the weights kept are those of the epoch with the lowest validation loss,
    and training stops after ``patience`` epochs without improvement (0: never).
    ``gradient_checkpointing``: recompute each block's activations in the backward pass
    (less memory for long inputs, about a third more compute). ``grad_accumulation_steps``:
    batches whose gradients are averaged into one AdamW update (mlx-lm's option): updates of
    that many batches at the memory of one. ``memory_limit``: GB MLX may hold before it waits
    for queued GPU work (``mx.set_memory_limit``, restored afterwards); default 0.7 x the
    GPU's memory (12 GB on a 16 GB Mac), MLX's own on the CPU. It does not change the results.

    A rerun with the same settings, data and base resumes from OUT's checkpoint (a finished
    run: nothing to do); other settings are refused unless ``force``, which starts over.
    Raises JobError (bad CSV, options, an OUT holding something else), SequenceError,
    ConvertError / HubError (the model).
    """
    _check_options(
        lora_rank,
        lora_layers,
        lora_scale,
        head,
        pool,
        epochs,
        learning_rate,
        batch_tokens,
        patience,
        grad_accumulation_steps,
        memory_limit,
    )
    save_every = int(save_every)
    out, train = Path(out), Path(train)
    train_set, labels = read_labeled(train, task, sequence_column, label_column)
    valid_set = read_labeled(valid, task, sequence_column, label_column, labels)[0] if valid is not None else None
    source = resolve(str(model), revision)
    if source.is_pth or not source.path.is_dir():
        raise JobError(f"{model}: not an MLX model directory; convert it first with esmc-convert")
    base_config = read_model_config(source.path)[1]  # bounded, checked against the weights' headers
    check_training_memory(base_config, train_set, valid_set, batch_tokens, gradient_checkpointing)
    base = files.base_identity(source)
    layers_total = base_config.num_hidden_layers
    num_layers = layers_total if lora_layers == "all" else min(int(lora_layers), layers_total)
    training = {
        "epochs": epochs,
        "learning_rate": learning_rate,
        "optimizer": "AdamW (mlx.optimizers, default betas and weight decay)",
        "batch_tokens": batch_tokens,
        "seed": seed,
        "patience": patience,
        "gradient_checkpointing": gradient_checkpointing,
        "grad_accumulation_steps": grad_accumulation_steps,
    }
    config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": lora_settings(lora_rank, lora_scale),
        "esmc_mlx": {
            "format": files.FORMAT,
            "version": __version__,
            "base": base,
            "labels": labels.to_dict(),
            "head": head,
            "pool": pool,
            "sequence_column": sequence_column,
            "training": training,
            "data": {
                "train": _data_record(train, train_set),
                "valid": _data_record(Path(valid), valid_set) if valid_set is not None else None,
            },
            "complete": False,
        },
    }
    existing = _open_output(out, config, force, source.path if base["repo_id"] is None else None)
    if existing is not None and existing["esmc_mlx"].get("complete"):
        meta = existing["esmc_mlx"]
        return FinetuneSummary(out, files._read_metrics(out), meta.get("best_epoch"), None, False, already_done=True)

    base_model, _ = load(source.path, fuse=False, compile=False)
    training_base(base_model)
    mx.random.seed(seed)
    adapted = AdaptedModel(base_model, labels, head, pool)
    adapted.add_lora(lora_rank, num_layers, lora_scale)
    object.__setattr__(adapted, "gradient_checkpointing", gradient_checkpointing)
    optimizer = optim.AdamW(learning_rate=learning_rate)
    optimizer.init(adapted.trainable_parameters())
    updates = Updates(adapted, optimizer, grad_accumulation_steps)
    trainer = Trainer(updates, train_set, valid_set, out, config, batch_tokens, seed, patience)
    resumed = trainer.restore()
    with under_memory_limit(memory_limit):
        trainer.run(epochs, save_every, progress)
    return FinetuneSummary(out, trainer.history, trainer.best_epoch, resumed, trainer.stopped)


def _open_output(out: Path, config: dict, force: bool, local_base: Path | None) -> dict | None:
    """Check that OUT (an adapter folder the output guard holds: new, empty or esmc-mlx's)
    holds this same run (returned), or start it there; ``force`` first clears what esmc-mlx
    wrote there (never a folder holding anything else). JobError for another run's settings."""
    folder = held(out)
    if force:
        folder.clear()
    elif folder.owns(files.CONFIG) and (out / files.CONFIG).is_file():
        existing = files.read_adapter_config(out, complete=False)
        differ = _differences(existing, config)
        if differ:
            raise JobError(
                f"{out} holds a fine-tuning run with other settings ({'; '.join(differ[:4])}); "
                "use another output directory, or --force to start over"
            )
        return existing
    _write_json(out / files.CONFIG, config)
    if local_base is not None:
        with folder.file(files.LOCAL_BASE) as f:
            f.write(f"{local_base}\n")
    return None


def _differences(existing: dict, config: dict) -> list[str]:
    """What differs between two runs' settings (the version and progress aside)."""

    def flat(c):
        meta = {k: v for k, v in c["esmc_mlx"].items() if k not in ("version", *OUTCOME)}
        rest = {k: v for k, v in c.items() if k != "esmc_mlx"}
        return dict(tree_flatten({**rest, **meta}))

    a, b = flat(existing), flat(config)
    return [f"{k}: {a.get(k)!r} there, {b.get(k)!r} now" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _write_json(path: Path, data) -> None:
    """``path`` in the adapter folder, written whole through its guard (recorded as esmc-mlx's)."""
    text = json.dumps(data, indent=2, allow_nan=False)  # NaN or Infinity is not JSON: stopped where they enter
    with held(path.parent).file(path.name) as f:
        f.write(text + "\n")


def _write_arrays(path: Path, arrays: dict[str, mx.array], metadata: dict | None = None) -> None:
    """A safetensors file of the adapter folder, written whole through its guard (MLX's writer
    takes only a path)."""
    from safetensors.numpy import save

    payload = save({k: np.array(v) for k, v in arrays.items()}, metadata=metadata)
    with held(path.parent).file(path.name, "wb") as f:
        f.write(payload)


class Updates:
    """Training steps of the adapters and the head: ``self(ids, attention, targets) -> (loss,
    outputs)`` for one batch. With ``accumulate`` 1 each batch is one AdamW update (gradient and
    update in one step); with more, the gradients of that many batches are averaged into one
    update (as mlx-lm's ``grad_accumulation_steps``), so an update holds several batches' tokens
    at the memory of one. ``pending``: batches whose gradients await their update. ``compile``
    (default: on a GPU, as ``load`` compiles the forward there; on the CPU a trace JIT-builds
    C++ and measured no faster): trace each step with ``mx.compile``."""

    def __init__(
        self, model: AdaptedModel, optimizer: optim.Optimizer, accumulate: int = 1, compile: bool | None = None
    ):
        self.model, self.optimizer, self.accumulate = model, optimizer, accumulate
        self.grads, self.pending = None, 0
        loss_and_grad = nn.value_and_grad(model, loss_fn)

        def step(ids, attention, targets):
            (loss, outputs), grads = loss_and_grad(model, ids, attention, targets)
            optimizer.update(model, grads)
            return loss, outputs

        def gradient(ids, attention, targets):
            (loss, outputs), grads = loss_and_grad(model, ids, attention, targets)
            return loss, outputs, grads

        if compile is None:
            compile = mx.default_device() != mx.cpu
        if compile:
            # the model's state as output too: value_and_grad leaves its traced parameters in it
            step = mx.compile(step, inputs=[model.state, optimizer.state], outputs=[model.state, optimizer.state])
            gradient = mx.compile(gradient, inputs=model.state, outputs=model.state)
        self.step, self.gradient = step, gradient

    @property
    def state(self) -> list:
        """What a step changes: for ``mx.eval``."""
        return [self.model.state, self.optimizer.state] + ([self.grads] if self.grads is not None else [])

    def __call__(self, ids, attention, targets):
        if self.accumulate == 1:
            return self.step(ids, attention, targets)
        loss, outputs, grads = self.gradient(ids, attention, targets)
        self.grads = grads if self.grads is None else tree_map(mx.add, self.grads, grads)
        self.pending += 1
        if self.pending == self.accumulate:
            self.flush()
        return loss, outputs

    def flush(self) -> None:
        """Apply the update of the pending batches (fewer than ``accumulate`` at an epoch's end)."""
        if self.pending:
            self.optimizer.update(self.model, tree_map(lambda g: g / self.pending, self.grads))
            self.grads, self.pending = None, 0


def _set_leaves(tree, items) -> None:
    """Put each (dotted name, array) into ``tree`` where ``tree_flatten`` found it, in place:
    the optimizer's state keeps its structure (empty branches included, which flattening loses)."""
    for name, value in items:
        *path, last = name.split(".")
        node = tree
        for key in path:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value


class Trainer:
    """The loop: epochs of shuffled length-grouped batches, validation, early stopping, the
    checkpoint, and the final files."""

    def __init__(self, updates, train_set, valid_set, out, config, batch_tokens, seed, patience):
        self.updates, self.model, self.optimizer = updates, updates.model, updates.optimizer
        self.train_set, self.valid_set = train_set, valid_set
        self.out, self.config = out, config
        self.labels = self.model.labels
        self.seed, self.patience = seed, patience
        self.train_encoded, self.train_batches = token_batches(train_set.sequences, batch_tokens)
        self.valid_batches = token_batches(valid_set.sequences, batch_tokens) if valid_set is not None else None
        self.metric_name = METRIC_NAMES[self.labels.task]
        self.history: list[dict] = []
        self.epoch, self.batch, self.running = 0, 0, Running(self.labels)
        self.best_loss, self.best_epoch, self.stale, self.stopped = math.inf, None, 0, False

    # --- checkpoint ---------------------------------------------------------------------------
    def _weights(self) -> dict[str, dict[str, mx.array]]:
        return {
            "adapters": dict(tree_flatten(self.model.base.esmc.trainable_parameters())),
            "head": dict(tree_flatten(self.model.head.parameters())),
        }

    def save_checkpoint(self) -> None:
        arrays = {f"{part}.{k}": v for part, values in self._weights().items() for k, v in values.items()}
        arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(self.optimizer.state)})
        progress = {
            "epoch": self.epoch,
            "batch": self.batch,
            "running": self.running.state(),
            "history": self.history,
            "best_loss": self.best_loss if math.isfinite(self.best_loss) else None,
            "best_epoch": self.best_epoch,
            "stale": self.stale,
        }
        _write_arrays(self.out / files.CHECKPOINT, arrays, {"progress": json.dumps(progress)})
        held(self.out).commit()  # a run to resume from: kept if this one fails later

    def restore(self) -> str | None:
        """Load OUT's checkpoint, if any; returns where it resumes ("epoch N, step M")."""
        path = self.out / files.CHECKPOINT
        if not path.exists():
            return None
        try:  # header checked, values finite, progress bounded: the checkpoint is read as any artifact
            arrays = load_safetensors(path, JobError)
            metadata = safetensors_header(path).get("__metadata__") or {}
            progress = parse_json(metadata.get("progress", ""), f"{path}: progress", JobError)
            self.check_progress(progress)
        except JobError as e:  # a file damaged since (a checkpoint is written whole)
            raise JobError(f"unreadable checkpoint: {e}; use --force to start over") from None
        part = lambda p: [(k[len(p) + 1 :], v) for k, v in arrays.items() if k.startswith(p + ".")]  # noqa: E731
        adapters = part("adapters")
        expected = {k for k, _ in tree_flatten(self.model.base.esmc.trainable_parameters())}
        if {k for k, _ in adapters} != expected:
            raise JobError(f"{path}: its adapters do not match this run's LoRA layers; use --force to start over")
        self.model.base.esmc.load_weights(adapters, strict=False)  # the frozen base is not in it
        self.model.head.load_weights(part("head"), strict=True)
        _set_leaves(self.optimizer.state, part("optimizer"))
        self.epoch, self.batch = progress["epoch"], progress["batch"]
        self.running = Running(self.labels, progress["running"])
        self.history = progress["history"]
        self.best_loss = progress["best_loss"] if progress["best_loss"] is not None else math.inf
        self.best_epoch, self.stale = progress["best_epoch"], progress["stale"]
        mx.eval(self.model.parameters(), self.optimizer.state)
        return f"epoch {self.epoch + 1}, step {self.batch}"

    @staticmethod
    def check_progress(progress) -> None:
        """JobError unless ``progress`` holds what ``save_checkpoint`` writes."""
        keys = ("epoch", "batch", "running", "history", "best_loss", "best_epoch", "stale")
        if not (isinstance(progress, dict) and all(k in progress for k in keys)):
            raise JobError(f"its progress record lacks {', '.join(k for k in keys if k not in (progress or {}))}")
        counts = [progress[k] for k in ("epoch", "batch", "stale")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            raise JobError("its progress record's epoch, batch and stale are not counts")
        if not (isinstance(progress["running"], dict) and isinstance(progress["history"], list)):
            raise JobError("its progress record's running totals or history are damaged")

    def save_weights(self) -> None:
        weights = self._weights()
        _write_arrays(self.out / files.ADAPTERS, weights["adapters"])
        _write_arrays(self.out / files.HEAD, weights["head"])

    # --- the loop -----------------------------------------------------------------------------
    def run(self, epochs: int, save_every: int, progress: bool) -> None:
        from tqdm.auto import tqdm

        while self.epoch < epochs and not self.stopped:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.train_batches))
            bar = tqdm(
                total=len(order),
                initial=self.batch,
                desc=f"epoch {self.epoch + 1}/{epochs}",
                unit="batch",
                disable=not progress,
                dynamic_ncols=True,
            )
            saved = self.batch
            with bar:
                self.model.train()
                while self.batch < len(order):
                    rows = self.train_batches[order[self.batch]]
                    self.train_step(rows)
                    self.batch += 1
                    bar.update(1)
                    bar.set_postfix(loss=f"{self.running.loss:.4f}", **{self.metric_name: f"{self.running.metric:.3f}"})
                    due = save_every and self.batch - saved >= save_every and self.batch < len(order)
                    if due and not self.updates.pending:  # a checkpoint holds no half-made update
                        self.save_checkpoint()
                        saved = self.batch
            self.updates.flush()
            self.end_epoch()
        self.finish()

    def train_step(self, rows: np.ndarray) -> None:
        ids, attention, targets = pack_batch(self.train_encoded, rows, self.train_set.targets, self.labels)
        loss, outputs = self.updates(ids, attention, targets)
        mx.eval(loss, outputs, self.updates.state)
        if not math.isfinite(loss.item()):  # the weights it updated hold NaN from here on: keep none of it
            raise JobError(
                f"training diverged: the loss of epoch {self.epoch + 1}, step {self.batch + 1} is {loss.item()}; "
                f"lower --learning-rate (now {self.optimizer.learning_rate.item():g}) and run again with --force"
            )
        lengths = np.array([len(self.train_encoded[r]) - 2 for r in rows])
        predictions = batch_predictions(self.labels, np.array(outputs), lengths)
        self.running.add(loss.item(), len(rows), predictions, [self.train_set.targets[r] for r in rows])

    def evaluate(self) -> tuple[float, float]:
        encoded, batches = self.valid_batches
        running = Running(self.labels)
        self.model.eval()
        for rows in batches:
            ids, attention, targets = pack_batch(encoded, rows, self.valid_set.targets, self.labels)
            loss, outputs = loss_fn(self.model, ids, attention, targets)
            lengths = np.array([len(encoded[r]) - 2 for r in rows])
            predictions = batch_predictions(self.labels, np.array(outputs), lengths)
            running.add(loss.item(), len(rows), predictions, [self.valid_set.targets[r] for r in rows])
        self.model.train()
        return running.loss, running.metric

    def end_epoch(self) -> None:
        row = {
            "epoch": self.epoch + 1,
            "train_loss": self.running.loss,
            f"train_{self.metric_name}": self.running.metric,
        }
        if self.valid_set is not None:
            loss, value = self.evaluate()
            row.update({"valid_loss": loss, f"valid_{self.metric_name}": value})
            if loss < self.best_loss:
                self.best_loss, self.best_epoch, self.stale = loss, self.epoch + 1, 0
                self.save_weights()
            else:
                self.stale += 1
                self.stopped = bool(self.patience) and self.stale >= self.patience
        self.history.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()})
        self.epoch, self.batch, self.running = self.epoch + 1, 0, Running(self.labels)
        _write_json(self.out / files.METRICS, {"metric": self.metric_name, "epochs": self.history})
        self.save_checkpoint()

    def finish(self) -> None:
        if self.valid_set is None:
            self.save_weights()
        meta = self.config["esmc_mlx"]
        meta.update(complete=True, best_epoch=self.best_epoch, stopped_early=self.stopped)
        folder = held(self.out)
        if not files.write_curves(folder.claim(files.CURVES), self.history, self.metric_name):
            folder.remove(files.CURVES)  # (no matplotlib)
        _write_json(self.out / files.CONFIG, self.config)
        with folder.file(files.CARD) as f:
            f.write(files.render_card(self.out))
        folder.remove(files.CHECKPOINT)
