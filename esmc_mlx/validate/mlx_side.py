"""The artifact as the MLX runtime runs it: ``load()`` and ``model(...)``, or layer by layer.

``full`` is what users run (``esmc_mlx.load``). ``layered`` builds the runtime's own modules
(``runtime.model.Layer``, ``MaskedLMHead``; quantized exactly where the artifact is, by the
rule of ``runtime.quantized.quantize_modules``) one layer at a time and runs ``ESMC.__call__``'s
loop, so that a 6B artifact is checked without holding it whole in fp32. ``layered_steps`` is
that loop as a generator, stepped in the same sweep as the torch references.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..artifact import FLOAT_DTYPES
from ..runtime.load import load
from ..runtime.model import Layer, MaskedLMHead, attention_mask_for
from ..runtime.quantized import quantize_modules
from .panel import Batch
from .reference import Outputs, collect, drain, unpad
from .weights import ArtifactWeights

# MLX's CUDA backend runs float32 matmuls as TF32 unless MLX_ENABLE_TF32=0. Measured on the
# H200 (mlx 0.32.4): a 512x2560 @ 2560x2560 fp32 matmul is 2.9e-4 from float64 with TF32 and
# 5.2e-7 without; on a random 6B mxfp4 artifact, fidelity_logits was 1.0e-3 with TF32 and 3.7e-6
# without (bound 1e-5). The torch reference runs fp32 with TF32 off, so validation does too.
TF32_ENV = "MLX_ENABLE_TF32"


def compute_dtype(artifact: ArtifactWeights, override: str | None = None) -> mx.Dtype:
    """The MLX compute dtype of a validation: float32 (TF32 off) unless overridden, the
    reference's own precision, so that fidelity measures the runtime's function and not bf16
    rounding: a random 80-layer 6B computed in bf16 is 2.4e-2 from fp32 (measured), above the
    2e-2 bound of bf16 compute, while in fp32 MLX and torch agree to 3.7e-6. ``artifact`` is
    unused: the stored dtype does not decide it (the CPU computes in fp32 anyway)."""
    dtype = FLOAT_DTYPES[override] if override else mx.float32
    if dtype == mx.float32:
        os.environ.setdefault(TF32_ENV, "0")  # read by MLX at its first float32 matmul
    return dtype


def _unpad(batch: Batch, logits: mx.array, hidden: mx.array, sink: dict) -> None:
    unpad(batch, np.array(logits.astype(mx.float32)), np.array(hidden.astype(mx.float32)), sink)


def _call_args(batch: Batch) -> dict:
    if batch.sequence_id is not None:
        return {"sequence_id": mx.array(batch.sequence_id)}
    return {"attention_mask": mx.array(batch.attention_mask)}


def run_full(
    artifact: ArtifactWeights,
    batches: list[Batch],
    n_inputs: int,
    dtype: mx.Dtype,
    on_step: Callable[[], None] | None = None,
) -> Outputs:
    model, _ = load(artifact.directory, dtype=dtype)
    sink: dict[int, tuple] = {}
    for batch in batches:
        out = model(mx.array(batch.input_ids), **_call_args(batch))
        mx.eval(out.logits, out.last_hidden_state)
        _unpad(batch, out.logits, out.last_hidden_state, sink)
        if on_step:
            on_step()
    del model
    mx.clear_cache()
    return collect(sink, n_inputs)


class _Holder(nn.Module):
    """Gives a lone module (embedding, final norm) its path in the artifact, so that it is
    quantized by the same rule as everything else if the artifact quantized it."""

    def __init__(self, **modules):
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)


def _materialize(
    module: nn.Module, artifact: ArtifactWeights, prefix: str, dtype: mx.Dtype, select: str | None = None
) -> nn.Module:
    """Quantize ``module`` where the artifact holds quantized tensors, load its weights, cast.
    ``module``'s paths are artifact names less ``prefix``; ``select`` narrows the names read."""
    names = artifact.stored_names(select or prefix)

    if artifact.record:  # the runtime's own swap, with the record's per-layer keys made relative
        record = {k: v for k, v in artifact.record.items() if not isinstance(v, dict)}
        record.update(
            {k[len(prefix) :]: v for k, v in artifact.record.items() if isinstance(v, dict) and k.startswith(prefix)}
        )
        quantize_modules(module, record, lambda path: artifact.has(f"{prefix}{path}.scales"))
    weights = artifact.raw_many(names)
    module.load_weights([(n[len(prefix) :], w) for n, w in weights.items()], strict=True)
    module.set_dtype(dtype)
    mx.eval(module.parameters())
    return module


def run_layered(
    artifact: ArtifactWeights,
    batches: list[Batch],
    n_inputs: int,
    dtype: mx.Dtype,
    on_step: Callable[[], None] | None = None,
) -> Outputs:
    return drain(layered_steps(artifact, batches, n_inputs, dtype), on_step)


def layered_steps(artifact: ArtifactWeights, batches: list[Batch], n_inputs: int, dtype: mx.Dtype):
    """``run_layered`` as a generator: yields after the embedding and after each layer, returns
    the Outputs (the same steps as ``reference.layered_steps``)."""
    config = artifact.config
    embed = _materialize(
        _Holder(embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size)),
        artifact,
        "esmc.",
        dtype,
        select="esmc.embed_tokens.",
    ).embed_tokens
    states, masks = [], []
    for batch in batches:
        args = _call_args(batch)
        masks.append(attention_mask_for(args.get("attention_mask"), args.get("sequence_id")))
        states.append(embed(mx.array(batch.input_ids)))
    mx.eval(states)
    del embed
    yield
    for i in range(config.num_hidden_layers):
        layer = _materialize(Layer(config), artifact, f"esmc.layers.{i}.", dtype)
        for b in range(len(batches)):
            states[b], _ = layer(states[b], masks[b])
            mx.eval(states[b])
        del layer
        mx.clear_cache()
        yield
    norm = _materialize(
        _Holder(norm=nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=False)),
        artifact,
        "esmc.",
        dtype,
        select="esmc.norm.",
    ).norm
    head = _materialize(MaskedLMHead(config), artifact, "lm_head.", dtype)
    sink: dict[int, tuple] = {}
    for b, batch in enumerate(batches):
        hidden = norm(states[b])
        logits = head(hidden)
        mx.eval(logits, hidden)
        _unpad(batch, logits, hidden, sink)
        states[b] = None
    mx.clear_cache()
    return collect(sink, n_inputs)
