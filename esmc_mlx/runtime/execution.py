"""How an ESMC model runs, apart from its math: the fused q/k/v and gate/up layout, compiled
traces, evaluation in chunks of blocks for long inputs, and the weights' fingerprint.

Defaults per backend (docs/decisions.md): on a GPU, fusing q/k/v and gate/up and compiling ran
1.27-1.64x faster than the plain port at B=1 and 1.02-1.23x at 16x256 / 64x512 (H200, bf16);
on the CPU neither measured faster, and a compiled trace there JIT-builds C++: both off.
"""

from __future__ import annotations

import copy
import hashlib
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import ESMCConfig
from ..errors import ScoringError, SequenceError
from . import dispatch

RUNTIME_DEFAULTS = {"gpu": {"fuse": True, "compile": True}, "cpu": {"fuse": False, "compile": False}}

# Activation memory of one forward, bounded for long inputs: evaluating the residual stream
# every few blocks frees each chunk's intermediates before the next runs (a 6B at 1x4096 held
# 9.6 GB above its weights as one graph on the H200). Two chunks (one running, one queued)
# stay within this budget.
ACTIVATION_BUDGET = 1 << 30

# Projections that read the same input and can run as one GEMM: (module, fused name, parts).
FUSIONS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def hash_parameter(digest, name: str, array: mx.array, part: int = 0, parts: int = 1) -> None:
    """Feed ``digest`` (hashlib) what a fingerprint reads of one parameter (part ``part`` of
    ``parts`` stacked along its rows): its name and shape, the whole array when small, else three
    rows (first, middle, last); floats as float32, so the stored precision, not the compute
    dtype of this device, decides the hash."""
    rows = array.shape[0] // parts
    start = part * rows
    if array.size // parts <= 4096:
        sample = array[start : start + rows]
    else:
        sample = array[mx.array([start, start + rows // 2, start + rows - 1])]
    if mx.issubdtype(sample.dtype, mx.floating):
        sample = sample.astype(mx.float32)
    values = np.asarray(sample)
    digest.update(f"{name} {(rows, *array.shape[1:])} {values.dtype}\n".encode())
    digest.update(values.tobytes())


def layer_activation_bytes(config: ESMCConfig, batch: int, length: int, itemsize: int) -> int:
    """An upper estimate of one block's intermediates: q/k/v, attention output, gate/up and
    their product, plus the (B, H, L, L) scores of an unfused attention."""
    d, f = config.hidden_size, config.intermediate_size
    return itemsize * (batch * length * (4 * d + 3 * f) + batch * config.num_attention_heads * length**2)


def layers_per_eval(config: ESMCConfig, batch: int, length: int, itemsize: int) -> int | None:
    """How many blocks to run between evaluations for a (batch, length) input; None when the
    whole forward fits ``ACTIVATION_BUDGET`` (short inputs run as one graph: no syncs)."""
    per_layer = layer_activation_bytes(config, batch, length, itemsize)
    k = max(1, ACTIVATION_BUDGET // (2 * per_layer))
    return None if k >= config.num_hidden_layers else k


class InFlight:
    """Called with each chunk's, layer's or step's results as they are built: queues them
    (``mx.async_eval``) and waits for the ones before, so two are in flight. A GPU holds the
    temporaries of queued work until it finishes: this bounds them, and the device stays busy while
    the host builds the next. Raises ValueError where nothing can be evaluated (under ``mx.grad``)."""

    def __init__(self):
        self.previous = ()

    def __call__(self, *arrays: mx.array) -> None:
        mx.async_eval(*arrays)
        if self.previous:
            mx.eval(*self.previous)
        self.previous = arrays


def _array_keys(module: nn.Module) -> list[str]:
    return sorted(k for k, v in module.items() if isinstance(v, mx.array))


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear computing ``parts`` side by side (output rows concatenated), or None when they
    cannot be fused: different classes, or quantized with different mode/bits/group size.
    Quantization groups run along the input width, so row-concatenating the packed weights,
    scales and biases of identically quantized layers is exact."""
    first = parts[0]
    if any(type(p) is not type(first) or _array_keys(p) != _array_keys(first) for p in parts):
        return None
    kind = ("mode", "bits", "group_size")
    if any(tuple(getattr(p, a, None) for a in kind) != tuple(getattr(first, a, None) for a in kind) for p in parts):
        return None
    fused = copy.copy(first)  # same class and quantization, new arrays
    # What a layer derives from its weight on first use (the plans' view of it, CUTLASS's scales
    # and reordered copy): a part's, not the fused weight's.
    for derived in ("_spec", "_in_range", "cutlass_scales", "cutlass_weight"):
        fused.__dict__.pop(derived, None)
    for key in _array_keys(first):
        fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    return fused


def check_inputs(input_ids: mx.array, attention_mask, sequence_id, vocab_size: int) -> None:
    """SequenceError for inputs the forward would read wrongly or fail on deep in MLX: ids that
    are not integers, an empty batch, ids outside the embedding table (MLX's gather reads past
    it), a mask or sequence_id of another shape than the ids."""
    if input_ids.ndim != 2 or 0 in input_ids.shape:
        raise SequenceError(
            f"input_ids: expected a non-empty (batch, length) array of token ids, got shape {tuple(input_ids.shape)}"
        )
    if not mx.issubdtype(input_ids.dtype, mx.integer):
        raise SequenceError(f"input_ids: token ids must be integers, got {input_ids.dtype}")
    try:
        ids = np.asarray(input_ids)  # the ids are small and usually made from numpy: no device wait
    except ValueError:  # inside the caller's own mx.compile / vmap: values unknown while tracing
        ids = None
    if ids is not None:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise SequenceError(
                f"input_ids: token id {low if low < 0 else high} is outside the vocabulary (ids 0..{vocab_size - 1})"
            )
    for name, value in (("attention_mask", attention_mask), ("sequence_id", sequence_id)):
        if value is not None and tuple(np.shape(value)) != tuple(input_ids.shape):
            raise SequenceError(
                f"{name}: shape {tuple(np.shape(value))} does not match input_ids' {tuple(input_ids.shape)}"
            )


class Execution:
    """ESMC's methods for running it (mixed into runtime.model.ESMC)."""

    def init_execution(self) -> None:
        # Compiled forward functions by key, and the input shapes seen so far; kept out of the
        # parameter tree. Blocks between evaluations: "auto" (layers_per_eval), None, or an int.
        object.__setattr__(self, "_compiled", None)
        object.__setattr__(self, "_seen_shapes", set())
        object.__setattr__(self, "_layers_per_eval", "auto")

    def fuse(self):
        """Run q/k/v and gate/up as one GEMM each. Call it after the weights are loaded (``load``
        does). Parameter names change (``qkv_proj``, ``gate_up_proj``): artifacts keep
        transformers' names; this is a runtime layout. Layers whose parts cannot be fused
        (mixed quantization) stay as they are."""
        for layer in self.esmc.layers:
            for owner_name, fused_name, part_names in FUSIONS:
                owner = layer[owner_name]
                if fused_name in owner or not all(n in owner for n in part_names):
                    continue
                fused = concat_linears([owner[n] for n in part_names])
                if fused is None:
                    continue
                mx.eval(fused.parameters())  # materialize now, so the parts are freed layer by layer
                for n in part_names:
                    owner.pop(n)
                owner[fused_name] = fused
        self.reset_compiled()
        return self

    def optimize(self, fuse: bool | None = None, compile: bool | None = None):
        """Apply the runtime layout and compiling measured faster on the default device
        (RUNTIME_DEFAULTS); ``fuse``/``compile`` override. Call after the weights are loaded."""
        defaults = RUNTIME_DEFAULTS["cpu" if mx.default_device() == mx.cpu else "gpu"]
        if defaults["fuse"] if fuse is None else fuse:
            self.fuse()
        self.compile(defaults["compile"] if compile is None else compile)
        return self

    @property
    def is_fused(self) -> bool:
        return any("qkv_proj" in layer.self_attn or "gate_up_proj" in layer.mlp for layer in self.esmc.layers)

    def compile(self, enabled: bool = True):
        """Trace the plain forward (no hidden states, no attention weights) with ``mx.compile``. A
        trace costs a fraction of a second per input shape, so a shape runs compiled from the
        second time it is seen (the first runs eagerly): one-off lengths pay nothing, repeated
        or bucketed batch shapes get the compiled speed."""
        object.__setattr__(self, "_compiled", {} if enabled else None)
        self._seen_shapes.clear()
        return self

    def chunk_layers(self, every: int | str | None = "auto"):
        """Evaluate the residual stream every ``every`` blocks: ``"auto"`` (the default) chunks
        only inputs whose activations would exceed ``ACTIVATION_BUDGET``; None never chunks.
        Outputs are bit-identical either way; only peak memory and syncs change."""
        if every is not None and every != "auto" and (type(every) is not int or every < 1):
            raise ScoringError(f"chunk_layers(every={every!r}): every must be 'auto', None or a positive int")
        object.__setattr__(self, "_layers_per_eval", every)
        return self

    def chunk_for(self, input_ids: mx.array) -> int | None:
        every = self._layers_per_eval
        if every == "auto":
            B, L = input_ids.shape
            return layers_per_eval(self.config, B, L, self.dtype.size)
        return every if every is None or every < self.config.num_hidden_layers else None

    def reset_compiled(self) -> None:
        if self._compiled is not None:
            self._compiled.clear()
        self._seen_shapes.clear()

    def use_compiled(self, input_ids: mx.array, mask: mx.array | None) -> bool:
        """Whether this call runs a compiled trace: from the second call of a shape under the same
        target (a trace bakes in its plans; a layer prepares CUTLASS's copies on an eager call)."""
        if self._compiled is None:
            return False
        key = (tuple(input_ids.shape), None if mask is None else tuple(mask.shape), dispatch.current())
        if key in self._seen_shapes:
            return True
        if len(self._seen_shapes) > 4096:  # unbounded shape streams: forget, do not grow
            self._seen_shapes.clear()
        self._seen_shapes.add(key)
        return False

    def _logits_and_hidden(self, input_ids: mx.array, mask: mx.array | None) -> tuple[mx.array, mx.array]:
        out = self.forward(input_ids, mask)  # mx.compile traces functions returning arrays
        return out.logits, out.last_hidden_state

    def _compiled_blocks(self, mask: mx.array | None) -> list:
        """One compiled function per block, (x, normed, mask) -> (x, normed), for chunked inputs:
        evaluation cannot happen inside one trace of the whole model, and tracing the blocks one
        by one costs what tracing the model once does."""
        key = ("blocks", mask is None, dispatch.current())
        blocks = self._compiled.get(key)
        if blocks is None:
            pairs = zip(self.esmc.layers, self.next_norms(), strict=True)
            blocks = [self._compile_block(layer, next_norm, mask is None) for layer, next_norm in pairs]
            self._compiled[key] = blocks
        return blocks

    def _compile_block(self, layer: nn.Module, next_norm: nn.Module, no_mask: bool):
        state, ops = [layer.state, next_norm.state], self.ops
        if no_mask:
            fn = mx.compile(lambda x, normed: layer.step(x, normed, None, next_norm, ops=ops)[:2], inputs=state)
            return lambda x, normed, mask: fn(x, normed)
        return mx.compile(lambda x, normed, mask: layer.step(x, normed, mask, next_norm, ops=ops)[:2], inputs=state)

    def compiled_forward(self, input_ids: mx.array, mask: mx.array | None) -> tuple[mx.array, mx.array]:
        chunk = self.chunk_for(input_ids)
        if chunk is not None:
            out = self.forward(input_ids, mask, chunk=chunk, blocks=self._compiled_blocks(mask))
            return out.logits, out.last_hidden_state
        key = (mask is None, dispatch.current())
        fn = self._compiled.get(key)
        if fn is None:
            # Parameters are implicit inputs (not constants): one trace per input shape.
            if mask is None:
                fn = mx.compile(lambda ids: self._logits_and_hidden(ids, None), inputs=self.state)
            else:
                fn = mx.compile(self._logits_and_hidden, inputs=self.state)
            self._compiled[key] = fn
        return fn(input_ids) if mask is None else fn(input_ids, mask)

    def fingerprint(self) -> str:
        """A sha256 naming these weights, whatever their runtime layout: the same for an artifact
        loaded fused or not, on the CPU in float32 or on a GPU in bfloat16 (floats hashed as
        float32), different for another checkpoint, quantization or stored precision. Jobs
        record it so that a rerun resumes only with the same model. It hashes each parameter's
        name and shape, small arrays whole and three rows (first, middle, last) of each matrix:
        enough to tell trained weights apart without reading a 6B's 12 GB."""
        digest = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        for name, array, part, parts in sorted(self._unfused_parameters(), key=lambda t: t[0]):
            hash_parameter(digest, name, array, part, parts)
        return digest.hexdigest()

    def _unfused_parameters(self):
        """(artifact name, array, part, parts) per parameter: a fused q/k/v or gate/up array is
        its parts' rows side by side, so part ``i`` of ``n`` is named as the unfused parameter."""
        fused = {fused_name: part_names for _, fused_name, part_names in FUSIONS}
        for name, array in tree_flatten(self.parameters()):
            keys = name.split(".")
            hit = next((i for i, k in enumerate(keys) if k in fused), None)
            if hit is None:
                yield name, array, 0, 1
                continue
            names = fused[keys[hit]]
            for i, part_name in enumerate(names):
                yield ".".join([*keys[:hit], part_name, *keys[hit + 1 :]]), array, i, len(names)
