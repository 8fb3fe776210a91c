"""ESMC with LoRA adapters (mlx-lm's ``LoRALinear``) and a task head, the differentiable
forward that trains them, the losses and the metrics.

mlx-lm's LoRA layers wrap ``nn.Linear`` and ``nn.QuantizedLinear`` alike, so a quantized base
stays packed (QLoRA). What mlx-lm lacks is written here: a head on pooled or per-residue hidden
states, and a forward through the blocks that gradients can pass (see ``encode``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..errors import JobError, install_hint
from ..runtime.model import ESMC, additive_mask, attention_mask_for
from ..runtime.quantized import QuantizedLinear, dequantize_model
from ..runtime.tokenizer import ESMCTokenizer
from ..tasks.scoring import PAD_MULTIPLE, check_records_memory, encode, length_batches, memory_bytes
from ..tasks.stats import spearman
from ..vocab import as_sequences, check_sequence
from .data import Labels

HEADS = ("linear", "mlp")
POOLS = ("mean", "cls")
# The block projections LoRA adapts: all of them, as mlx-lm does by default (and as
# transformers' names have them, the layout load(fuse=False) keeps).
LORA_KEYS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def lora_module():
    """``mlx_lm.tuner`` (imported here: mlx-lm is the ``finetune`` extra)."""
    try:
        from mlx_lm.tuner import lora, utils
    except ImportError:
        raise JobError("fine-tuning needs mlx-lm's LoRA layers: " + install_hint("finetune")) from None
    return lora, utils


class Head(nn.Module):
    """The task's output layer on hidden states: one linear, or linear-GELU-linear."""

    def __init__(self, dims: int, outputs: int, kind: str = "linear"):
        super().__init__()
        self.layers = (
            [nn.Linear(dims, outputs)] if kind == "linear" else [nn.Linear(dims, dims), nn.Linear(dims, outputs)]
        )

    def __call__(self, x: mx.array) -> mx.array:
        for i, layer in enumerate(self.layers):
            x = layer(nn.gelu(x) if i else x)
        return x


def plain_quantized(model: nn.Module) -> None:
    """Swap the runtime's quantized linears for mlx's own ``nn.QuantizedLinear`` (same arrays):
    the runtime's picks inference kernels per call (on CUDA, custom kernels with no gradient),
    mlx's runs ``mx.quantized_matmul``, whose gradient with respect to the input MLX provides."""
    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            out_dims, packed = m.weight.shape
            plain = nn.QuantizedLinear(
                packed * 32 // m.bits, out_dims, "bias" in m, group_size=m.group_size, bits=m.bits, mode=m.mode
            )
            plain.update(m.parameters())
            plain.freeze()
            swaps.append((path, plain))
    if swaps:
        model.update_modules(tree_unflatten(swaps))


# On the CPU, MLX's quantized matmul, and its transpose for the input gradient, runs at a few
# GFLOP/s against a float32 GEMM's ~200 through OpenBLAS: a QLoRA step took 26x a LoRA step of
# the same model and batch (docs/decisions.md). There the frozen base is dequantized once, when
# its float32 weights take at most this share of the machine's memory.
FLOAT_BASE_SHARE = 0.5


def training_base(model: ESMC) -> str:
    """Ready a loaded base (``load(fuse=False)``) for training adapters on it, frozen: on the
    CPU, a quantized base whose float32 weights fit ``FLOAT_BASE_SHARE`` of the memory is
    dequantized once (``"float"``); else its quantized layers become mlx's own (``plain_quantized``,
    ``"packed"``: QLoRA). Returns which; a float base is ``"float"`` as it is."""
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if not quantized:
        return "float"
    dequantized = sum(4 * m.weight.size * 32 // m.bits for m in quantized)  # float32 bytes
    if mx.default_device() == mx.cpu and dequantized <= FLOAT_BASE_SHARE * memory_bytes():
        dequantize_model(model, mx.float32)
        model.freeze()
        mx.eval(model.parameters())
        return "float"
    plain_quantized(model)
    return "packed"


def block(layer: nn.Module, x: mx.array, mask: mx.array | None, shape: tuple[int, int]) -> mx.array:
    """One ESMC block (pre-LN, scaled residuals) from the layer's own modules, on the residual
    stream as (tokens, width) rows: ``x`` is (B * L, d) for batch and length ``shape``. The
    runtime's ``Layer.step`` computes the same values but fuses each residual add into an
    inference-only CUDA kernel that has no gradient; the runtime's tests hold the two to the
    torch reference. Rows rather than (B, L, d): each linear of a 3-D input is flattened to rows
    and back by MLX, and its gradient again, views that a training step (host-bound on a GPU)
    dispatches; on rows a 300M-shaped block's step has 275 graph nodes instead of 347, with
    bit-identical gradients."""
    batch, length = shape
    attn = layer.self_attn
    q, k, v = attn.qkv(layer.input_layernorm(x))

    def heads(t: mx.array) -> mx.array:  # (B * L, d) -> (B, H, L, head_dim)
        return attn.split_heads(t.reshape(batch, length, -1))

    q, k, v = attn.rope(heads(attn.q_norm(q))), attn.rope(heads(attn.k_norm(k))), heads(v)
    attended = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)
    x = x + attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(batch * length, -1)) / layer.residual_scale
    return x + layer.mlp(layer.post_attention_layernorm(x)) / layer.residual_scale


def checkpointed(layer: nn.Module, shape: tuple[int, int]):
    """``block`` under ``mx.checkpoint``: its activations are recomputed in the backward pass
    instead of kept. (mlx-lm's ``grad_checkpoint`` patches the class's ``__call__`` for every
    instance in the process, inference models included; this wraps one call.)"""

    def inner(params, x, *mask):
        layer.update(params)
        return block(layer, x, mask[0] if mask else None, shape)

    step = mx.checkpoint(inner)
    return lambda x, mask: step(layer.trainable_parameters(), x, *([] if mask is None else [mask]))


class AdaptedModel(nn.Module):
    """An ESMC base (frozen), LoRA adapters in its top blocks and a task head.

    Training (``train()``) runs the blocks through ``block``, optionally checkpointed; in
    ``eval()`` mode the runtime's own forward gives the hidden states (its fast paths apply:
    the adapters are plain modules inside it)."""

    def __init__(self, base: ESMC, labels: Labels, head: str = "linear", pool: str = "mean"):
        super().__init__()
        self.base = base
        self.head = Head(base.config.hidden_size, labels.outputs, head)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "gradient_checkpointing", False)

    def add_lora(self, rank: int, layers: int, scale: float) -> None:
        """Freeze the base and put rank-``rank`` adapters on the block projections of the top
        ``layers`` blocks (mlx-lm's ``linear_to_lora_layers``)."""
        _, utils = lora_module()
        self.base.freeze()
        utils.linear_to_lora_layers(self.base.esmc, layers, lora_parameters(rank, scale))

    def encode(self, ids: mx.array, attention: mx.array) -> mx.array:
        """The final hidden states (B, L, d) through ``block`` (checkpointed when
        ``gradient_checkpointing``). ``attention``: 1 on tokens, 0 on padding."""
        encoder = self.base.esmc
        mask = additive_mask(attention_mask_for(attention, None), self.base.dtype)
        shape = ids.shape
        x = encoder.embed_tokens(ids).reshape(shape[0] * shape[1], -1)
        for layer in encoder.layers:
            if self.gradient_checkpointing:
                x = checkpointed(layer, shape)(x, mask)
            else:
                x = block(layer, x, mask, shape)
        return encoder.norm(x).reshape(*shape, -1)

    def __call__(self, ids: mx.array, attention: mx.array) -> mx.array:
        """The head's outputs: (B, outputs) per sequence, or (B, L, outputs) per token."""
        if self.training:
            h = self.encode(ids, attention)
        else:
            h = self.base(ids, attention_mask=attention).last_hidden_state
        h = h.astype(mx.float32)
        if self.labels.task != "per-residue":
            h = h[:, 0] if self.pool == "cls" else _residue_mean(h, attention)
        return self.head(h)

    def predict(
        self, sequences: str | Sequence[str], batch_tokens: int = 4096, names: Sequence[str] | None = None
    ) -> Predictions:
        """Predictions for ``sequences`` (one string or a list): a label per sequence
        (classification, with the probability of every class), a value (regression), or a
        label per residue (per-residue). ``names``: how errors name each sequence (a FASTA ID,
        a CSV line). Raises SequenceError for an invalid sequence, ScoringError for a sequence
        or batch too large for this machine's memory (checked before any forward), JobError
        for a prediction that is not a finite number."""
        sequences = [check_sequence(s, label="sequence") for s in as_sequences(sequences)]
        names = list(names) if names is not None else [f"sequence {i + 1}" for i in range(len(sequences))]
        encoded, batches = token_batches(sequences, batch_tokens)
        check_records_memory(self.base.config, [len(e) - 2 for e in encoded], batch_tokens, names.__getitem__)
        labels, values, scores = self.labels, [None] * len(sequences), [None] * len(sequences)
        was_training = self.training
        self.eval()
        try:
            for rows in batches:
                ids, attention, _ = pack(encoded, rows, None, labels)
                out = self(ids, attention)
                if labels.task == "classification":
                    out = mx.softmax(out, axis=-1)
                out = np.array(out)
                lengths = np.array([len(encoded[r]) - 2 for r in rows])
                for k, (r, n) in enumerate(zip(rows, lengths)):
                    used = out[k, 1 : 1 + n] if labels.task == "per-residue" else out[k]
                    if not np.isfinite(used).all():
                        raise JobError(
                            f"{names[r]}: the model's output is NaN or Inf, not a prediction: the adapter or its base "
                            "model computes non-finite values for it"
                        )
                for k, (r, p) in enumerate(zip(rows, batch_predictions(labels, out, lengths))):
                    if labels.task == "regression":
                        values[r] = float(p) * labels.std + labels.mean
                    elif labels.task == "classification":
                        values[r], scores[r] = labels.classes[int(p)], out[k]
                    else:
                        values[r] = "".join(labels.classes[int(c)] for c in p)
        finally:
            self.train(was_training)
        bad = [k for k, v in enumerate(values) if isinstance(v, float) and not math.isfinite(v)]
        if bad:  # a finite output scaled past float64 (labels.std)
            raise JobError(
                f"{names[bad[0]]}: the prediction {values[bad[0]]} is not a finite number (the adapter's target "
                f"scaling, mean {labels.mean:g} and std {labels.std:g}, takes it past float64)"
            )
        probabilities = np.stack(scores) if labels.task == "classification" else None
        return Predictions(labels.task, values, labels.classes, probabilities)


@dataclasses.dataclass
class Predictions:
    """``values``: the predicted class, number, or per-residue label string of each sequence;
    ``probabilities``: (N, classes) for classification."""

    task: str
    values: list
    classes: list[str] | None = None
    probabilities: np.ndarray | None = None


_TOKENIZER = ESMCTokenizer()


def token_batches(sequences: Sequence[str], batch_tokens: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids of each (checked) sequence, and batches of row indices holding at most
    ``batch_tokens`` padded tokens, grouped by length (``tasks.scoring.length_batches``)."""
    encoded = encode(sequences)
    return encoded, length_batches([len(e) for e in encoded], batch_tokens, PAD_MULTIPLE)


def pack(
    encoded: list[np.ndarray], rows: np.ndarray, targets: list | None, labels: Labels
) -> tuple[mx.array, mx.array, mx.array | None]:
    """A batch: right-padded ids (to a multiple of PAD_MULTIPLE: fewer shapes to trace), the
    attention mask, and the targets (per residue: -1 outside the residues)."""
    batch = _TOKENIZER.pad([encoded[r] for r in rows], return_tensors="np", pad_to_multiple_of=PAD_MULTIPLE)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    if targets is None:
        return mx.array(ids), mx.array(attention), None
    if labels.task == "per-residue":
        wanted = np.full(ids.shape, -1, dtype=np.int32)
        for k, r in enumerate(rows):
            wanted[k, 1 : 1 + len(targets[r])] = targets[r]
    elif labels.task == "regression":
        wanted = np.array([targets[r] for r in rows], dtype=np.float32)
    else:
        wanted = np.array([targets[r] for r in rows], dtype=np.int32)
    return mx.array(ids), mx.array(attention), mx.array(wanted)


def lora_parameters(rank: int, scale: float) -> dict:
    """mlx-lm's LoRA settings (its ``adapter_config.json`` field ``lora_parameters``)."""
    return {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(LORA_KEYS)}


def _residue_mean(h: mx.array, attention: mx.array) -> mx.array:
    """Mean over the residues: the tokens between <cls> and <eos>, padding excluded."""
    inside = residue_mask(attention).astype(h.dtype)[..., None]
    return (h * inside).sum(axis=1) / inside.sum(axis=1)


def residue_mask(attention: mx.array) -> mx.array:
    """True on residue tokens: inside the attention mask, neither the first (<cls>) nor the
    last real token (<eos>)."""
    keep = attention.astype(mx.int32)
    lengths = keep.sum(axis=1, keepdims=True)
    positions = mx.arange(keep.shape[1])[None]
    return (positions >= 1) & (positions < lengths - 1)


def loss_fn(model: AdaptedModel, ids: mx.array, attention: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """(loss, the head's outputs): cross-entropy (classification; per residue, over the
    residue tokens) or squared error of the scaled target (regression)."""
    out = model(ids, attention)
    task = model.labels.task
    if task == "regression":
        return ((out[:, 0] - targets) ** 2).mean(), out
    if task == "classification":
        return nn.losses.cross_entropy(out, targets, reduction="mean"), out
    inside = residue_mask(attention)
    losses = nn.losses.cross_entropy(out, mx.maximum(targets, 0), reduction="none")
    return (losses * inside).sum() / inside.sum(), out


def metric(labels: Labels, predictions: list[np.ndarray], targets: list) -> float:
    """Accuracy (classification, per residue: over every residue), or Spearman's rho (regression)."""
    if not predictions:
        return float("nan")
    if labels.task == "regression":
        return spearman(np.concatenate(predictions), np.asarray(targets, dtype=np.float64))
    if labels.task == "classification":
        return float(np.mean(np.concatenate(predictions) == np.asarray(targets)))
    hits = sum(int((p == t).sum()) for p, t in zip(predictions, targets))
    return hits / max(1, sum(len(t) for t in targets))


METRIC_NAMES = {"classification": "accuracy", "regression": "spearman", "per-residue": "residue_accuracy"}


def batch_predictions(labels: Labels, out: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """The head's outputs of a batch as predictions per row: class indices, scaled values, or
    per residue a class index for each residue."""
    if labels.task == "regression":
        return list(out[:, 0])
    if labels.task == "classification":
        return list(out.argmax(-1))
    return [out[k, 1 : 1 + n].argmax(-1) for k, n in enumerate(lengths)]
