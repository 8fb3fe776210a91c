"""ESMC in MLX: pre-LN transformer with QK-LayerNorm, RoPE, SwiGLU and an MLM head.

Module and parameter names mirror transformers' ``EsmcForMaskedLM`` (``esmc.layers.0.self_attn.
q_proj.weight`` ...), so an artifact's tensor names read the same in both worlds. The numerics
follow ``modeling_esmc.py``; see docs/numerics.md for each choice.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import TRAINED_LENGTH, TRAINED_TOKENS, ESMCConfig
from ..errors import EsmcMlxWarning, ScoringError, SequenceError
from . import cutlass_qmm, kernels, quantized

# Set to 0 to run the QK LayerNorm, RoPE and head layout as separate MLX ops on a CUDA GPU
# instead of kernels.qkv_heads (one kernel reading the fused q/k/v projection once).
FUSED_QKV_ENV = "ESMC_MLX_FUSED_QKV"
# Set to 0 to run each residual add and the LayerNorm after it as MLX ops on a CUDA GPU instead
# of kernels.add_layer_norm (one kernel).
FUSED_NORM_ENV = "ESMC_MLX_FUSED_NORM"


def fused_qkv_enabled() -> bool:
    return os.environ.get(FUSED_QKV_ENV, "1") != "0"


def fused_norm_enabled() -> bool:
    return os.environ.get(FUSED_NORM_ENV, "1") != "0"


def kernel_choices() -> tuple:
    """What a compiled trace bakes in besides the shapes: the forced quantized-matmul path, the
    forced warp tile and split waves of the fused kernel, CUTLASS's forced use, schedule, slab count
    and weight layout, and which custom kernels are on."""
    return (
        os.environ.get(quantized.POLICY_ENV, "auto"),
        os.environ.get(cutlass_qmm.ENV, ""),
        os.environ.get(cutlass_qmm.SCHEDULE_ENV, ""),
        os.environ.get(cutlass_qmm.SPLITS_ENV, ""),
        os.environ.get(cutlass_qmm.REORDER_ENV, ""),
        os.environ.get(kernels.QMM_TILE_ENV, ""),
        os.environ.get(kernels.QMM_WAVES_ENV, ""),
        fused_qkv_enabled(),
        fused_norm_enabled(),
    )


def residual_norm(
    x: mx.array, linear: nn.Module, h: mx.array, scale: float, norm: nn.LayerNorm
) -> tuple[mx.array, mx.array]:
    """The residual stream ``x + linear(h) / scale`` and ``norm`` of it, on a CUDA GPU with fewer
    launches, the same values: a quantized linear whose CUTLASS call splits K adds x, and
    normalizes the sum, in the kernel that sums its slabs (QuantizedLinear.added_to); else
    kernels.add_layer_norm, one kernel instead of an add and a LayerNorm reading it back."""
    fused = fused_norm_enabled()
    added = linear.added_to(x, h, scale, norm) if fused and isinstance(linear, quantized.QuantizedLinear) else None
    if added is not None:
        return added
    add_norm = kernels.add_layer_norm if fused else kernels.add_layer_norm_reference
    return add_norm(x, linear(h), scale, norm.weight, norm.get("bias"), norm.eps)


@dataclasses.dataclass
class ESMCOutput:
    logits: mx.array  # (B, L, vocab_size)
    last_hidden_state: mx.array  # (B, L, d), after the final LayerNorm
    # embeddings, then each block's output; the last entry is last_hidden_state (as transformers)
    hidden_states: tuple[mx.array, ...] | None = None
    attentions: tuple[mx.array, ...] | None = None  # each (B, H, L, L)


def attention_mask_for(attention_mask: mx.array | None, sequence_id: mx.array | None) -> mx.array | None:
    """Boolean mask broadcastable to (B, H, L, L); True where a query may attend to a key.

    ``sequence_id`` (chain ids, -1 on padding) wins over ``attention_mask``, as in transformers:
    tokens attend only within their own chain. ``attention_mask`` masks padded keys only.
    """
    if sequence_id is not None:
        return sequence_id[:, None, :, None] == sequence_id[:, None, None, :]
    if attention_mask is not None:
        return attention_mask.astype(mx.bool_)[:, None, None, :]
    return None


def additive_mask(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """A boolean keep-mask as an additive bias (0 / dtype's lowest), same shape.

    MLX's CUDA attention takes only additive masks: a boolean one is expanded to the full
    (B, H, L, L) before the fused kernel (measured at L=4096: 1 GB extra for 15 heads, against
    8 MB with this (B, 1, 1, L) bias). On the CPU both cost the same."""
    return mx.where(mask, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))


def check_inputs(input_ids: mx.array, attention_mask, sequence_id, vocab_size: int) -> None:
    """SequenceError for inputs the forward would read wrongly without a word or fail on deep in
    MLX: ids that are not integers, an empty batch, ids outside the embedding table (MLX's
    gather reads past it: NaN logits for id 100, another token's row for -1), a mask or
    sequence_id of another shape than the ids (an all-ones mask of the wrong width was
    dropped as "no padding")."""
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


def _no_padding(attention_mask) -> bool:
    """True when the mask keeps every position (then no mask is needed at all)."""
    return bool(np.all(np.asarray(attention_mask)))


class Attention(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        # QK LayerNorm spans the whole hidden width (all heads at once), without bias.
        self.q_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, bias=False)

    def _heads(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def _rope(self, x: mx.array) -> mx.array:
        # Non-interleaved (half split) rotation, absolute positions from 0; MLX computes the
        # angles in fp32 whatever x's dtype.
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=0)

    def _qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "qkv_proj" in self:  # fused at load time (ESMC.fuse): one GEMM instead of three
            return tuple(mx.split(self.qkv_proj(x), 3, axis=-1))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _fused_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array] | None:
        """q, k, v heads from kernels.qkv_heads (same values), or None where it does not
        apply: unfused projections, head_dim other than 64, not a CUDA GPU, other dtypes."""
        if "qkv_proj" not in self or self.head_dim != kernels.QKV_HEAD_DIM or not fused_qkv_enabled():
            return None
        qkv = self.qkv_proj(x)  # lazy: left unevaluated (free) when the kernel does not apply
        # q_norm and k_norm share config.layer_norm_eps
        args = (qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.rope_theta, self.num_heads)
        return kernels.qkv_heads(*args) if kernels.qkv_heads_supported(*args) else None

    def __call__(self, x: mx.array, mask: mx.array | None, return_weights: bool = False):
        out, weights = self.attend(x, mask, return_weights)
        return self.o_proj(out), weights

    def attend(self, x: mx.array, mask: mx.array | None, return_weights: bool = False):
        """The heads' attention output (B, L, d) before o_proj, and the weights (or None)."""
        B, L, _ = x.shape
        heads = None if return_weights else self._fused_heads(x)
        if heads is not None:
            q, k, v = heads
        else:
            q, k, v = self._qkv(x)
            q = self._rope(self._heads(self.q_norm(q)))
            k = self._rope(self._heads(self.k_norm(k)))
            v = self._heads(v)
        weights = None
        if mask is not None and mask.dtype == mx.bool_:
            mask = additive_mask(mask, q.dtype)
        if return_weights:
            scores = (q * self.scale) @ k.transpose(0, 1, 3, 2)
            if mask is not None:
                scores = scores + mask
            weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
            out = weights @ v
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1), weights


class MLP(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.gated(x))

    def gated(self, x: mx.array) -> mx.array:
        """SwiGLU's product, the input of down_proj."""
        if "gate_up_proj" in self:  # fused at load time (ESMC.fuse)
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return nn.silu(gate) * up


class Layer(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.residual_scale = config.residual_scale

    def __call__(self, x: mx.array, mask: mx.array | None, return_weights: bool = False):
        x, _, weights = self.step(x, self.input_layernorm(x), mask, None, return_weights)
        return x, weights

    def step(
        self, x: mx.array, normed: mx.array, mask: mx.array | None, next_norm=None, return_weights: bool = False
    ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """The block on the residual stream ``x`` given ``normed = input_layernorm(x)``: the
        new stream, ``next_norm`` of it (the next block's input LayerNorm or the final one,
        computed with the residual add; None when ``next_norm`` is None) and the attention
        weights. ESMC's residual adds are scaled: ``x + h / residual_scale``."""
        attn, mlp, scale = self.self_attn, self.mlp, self.residual_scale
        with quantized.dequantized_together(self, normed):
            out, weights = attn.attend(normed, mask, return_weights)
            x, y = residual_norm(x, attn.o_proj, out, scale, self.post_attention_layernorm)
            h = mlp.gated(y)
            if next_norm is None:
                return x + mlp.down_proj(h) / scale, None, weights
            x, normed = residual_norm(x, mlp.down_proj, h, scale, next_norm)
        return x, normed, weights


class Encoder(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=False)


class MaskedLMHead(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        d = config.hidden_size
        self.dense = nn.Linear(d, d)
        self.layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(d, config.vocab_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.decoder(self.layer_norm(nn.gelu(self.dense(x))))  # nn.gelu is the erf form


# What load() does per backend (docs/benchmarks.md has the measurements behind each choice).
# GPU (H200, bf16): fusing q/k/v and gate/up and compiling together were 1.27-1.64x faster
# than the plain port at B=1 and 1.02-1.23x at 16x256 / 64x512 (fusing alone loses ~2% on
# the largest 6B shape, kept for the rest). CPU (fp32, OpenBLAS): neither measured faster
# within the noise of the 2-core host, and a compiled trace there JIT-builds C++: both off.
RUNTIME_DEFAULTS = {"gpu": {"fuse": True, "compile": True}, "cpu": {"fuse": False, "compile": False}}

# Activation memory of one forward, bounded for long inputs. A lazy graph over every layer,
# evaluated once, let the GPU hold many layers' intermediates at a time (H200, 6B at 1x4096:
# 9.6 GB above the weights); evaluating the residual stream every few layers frees each chunk's
# intermediates before the next chunk runs. On the CPU the whole graph already ran in one
# layer's memory and per-layer evaluation cost nothing measurable (8 layers, d=256, L=2048:
# 4.83 s chunked, 4.88 s whole). Chunks are sized so that two of them (one running, one being
# queued behind it) stay within this budget.
ACTIVATION_BUDGET = 1 << 30


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


# Projections that read the same input and can run as one GEMM: (module, fused name, parts).
FUSIONS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def _array_keys(module: nn.Module) -> list[str]:
    return sorted(k for k, v in module.items() if isinstance(v, mx.array))


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear computing ``parts`` side by side (output rows concatenated), or None when
    they cannot be fused: different classes, or quantized with different mode/bits/group
    size. Quantization groups run along the input width, so row-concatenating the packed
    weights, scales and biases of identically quantized layers is exact."""
    first = parts[0]
    if any(type(p) is not type(first) or _array_keys(p) != _array_keys(first) for p in parts):
        return None
    settings = ("mode", "bits", "group_size")
    if any(
        tuple(getattr(p, a, None) for a in settings) != tuple(getattr(first, a, None) for a in settings) for p in parts
    ):
        return None
    fused = copy.copy(first)  # same class and settings (quantization, policy), new arrays
    for key in _array_keys(first):
        fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    return fused


class ESMC(nn.Module):
    """ESMC masked language model. Call it with token ids from ``ESMCTokenizer``."""

    def __init__(self, config: ESMCConfig):
        super().__init__()
        self.config = config
        self.esmc = Encoder(config)
        self.lm_head = MaskedLMHead(config)
        # Compiled forward functions, one per (has mask, quant policy), and the input shapes
        # seen so far; kept out of the parameter tree.
        object.__setattr__(self, "_compiled", None)
        object.__setattr__(self, "_seen_shapes", set())
        # Blocks between evaluations: "auto" (layers_per_eval), None (one graph), or an int.
        object.__setattr__(self, "_layers_per_eval", "auto")

    def fuse(self) -> ESMC:
        """Run q/k/v and gate/up as one GEMM each (fewer, larger matmuls). Call it after the
        weights are loaded (``load`` does). Parameter names change (``qkv_proj``,
        ``gate_up_proj``): artifacts keep transformers' names; this is a runtime layout.
        Layers whose parts cannot be fused (mixed quantization) stay as they are."""
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

    def optimize(self, fuse: bool | None = None, compile: bool | None = None) -> ESMC:
        """Apply the runtime optimizations measured faster on the default device (see
        RUNTIME_DEFAULTS); ``fuse``/``compile`` override. Call after the weights are loaded."""
        defaults = RUNTIME_DEFAULTS["cpu" if mx.default_device() == mx.cpu else "gpu"]
        if defaults["fuse"] if fuse is None else fuse:
            self.fuse()
        self.compile(defaults["compile"] if compile is None else compile)
        return self

    @property
    def is_fused(self) -> bool:
        return any("qkv_proj" in layer.self_attn or "gate_up_proj" in layer.mlp for layer in self.esmc.layers)

    def compile(self, enabled: bool = True) -> ESMC:
        """Trace the plain forward (no hidden states, no attention weights) with ``mx.compile``:
        elementwise work is fused and graph building is skipped on repeated shapes. A trace
        costs a fraction of a second per input shape, so a shape runs compiled from the
        second time it is seen (the first runs eagerly): one-off lengths pay nothing, repeated
        or bucketed batch shapes get the compiled speed."""
        object.__setattr__(self, "_compiled", {} if enabled else None)
        self._seen_shapes.clear()
        return self

    def chunk_layers(self, every: int | str | None = "auto") -> ESMC:
        """Evaluate the residual stream every ``every`` blocks: ``"auto"`` (the default) chunks
        only inputs whose activations would exceed ``ACTIVATION_BUDGET``; None never chunks.
        Outputs are bit-identical either way; only peak memory and syncs change."""
        if every is not None and every != "auto" and (type(every) is not int or every < 1):
            raise ScoringError(f"chunk_layers(every={every!r}): every must be 'auto', None or a positive int")
        object.__setattr__(self, "_layers_per_eval", every)
        return self

    def _chunk_for(self, input_ids: mx.array) -> int | None:
        every = self._layers_per_eval
        if every == "auto":
            B, L = input_ids.shape
            return layers_per_eval(self.config, B, L, self.dtype.size)
        return every if every is None or every < self.config.num_hidden_layers else None

    def reset_compiled(self) -> None:
        if self._compiled is not None:
            self._compiled.clear()
        self._seen_shapes.clear()

    def _use_compiled(self, input_ids: mx.array, mask: mx.array | None) -> bool:
        if self._compiled is None:
            return False
        # New kernel choices make a new trace: its first call runs eagerly too (cutlass_qmm
        # prepares its layers' scales on an eager call).
        key = (tuple(input_ids.shape), None if mask is None else tuple(mask.shape), *kernel_choices())
        if key in self._seen_shapes:
            return True
        if len(self._seen_shapes) > 4096:  # unbounded shape streams: forget, do not grow
            self._seen_shapes.clear()
        self._seen_shapes.add(key)
        return False

    def _forward(
        self,
        input_ids: mx.array,
        mask: mx.array | None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        chunk: int | None = None,
        blocks=None,
    ) -> ESMCOutput:
        """The forward as one lazy graph, or (``chunk``) evaluated every ``chunk`` blocks.
        ``blocks``: per-block callables (x, mask) -> x replacing the blocks (compiled ones)."""
        x = self.esmc.embed_tokens(input_ids)
        hidden = [x] if output_hidden_states else None
        weights = [] if output_attentions else None
        layers = self.esmc.layers
        # Each block also computes the LayerNorm that follows it (the next block's input norm,
        # the final norm after the last): normed is that norm of x.
        normed = layers[0].input_layernorm(x) if layers else self.esmc.norm(x)
        queued = None
        for i, (layer, next_norm) in enumerate(zip(layers, self._next_norms(), strict=True)):
            if blocks is not None:
                (x, normed), w = blocks[i](x, normed, mask), None
            else:
                x, normed, w = layer.step(x, normed, mask, next_norm, output_attentions)
            if hidden is not None:
                hidden.append(x)
            if weights is not None:
                weights.append(w)
            if chunk is not None and (i + 1) % chunk == 0:
                # Queue this chunk, then wait for the previous one: at most two chunks' work
                # is in flight (bounded memory), and the device never idles while the next
                # chunk's graph is built (a plain mx.eval per chunk would idle it).
                try:
                    mx.async_eval(x, normed)
                except ValueError:  # under mx.grad / vmap: the backward pass keeps every
                    chunk = None  # intermediate anyway, and evaluation is not allowed
                    continue
                if queued is not None:
                    mx.eval(queued)
                queued = (x, normed)
        x = normed
        if hidden is not None:
            hidden[-1] = x
        return ESMCOutput(
            logits=self.lm_head(x),
            last_hidden_state=x,
            hidden_states=tuple(hidden) if hidden is not None else None,
            attentions=tuple(weights) if weights is not None else None,
        )

    def _next_norms(self) -> list[nn.LayerNorm]:
        """The LayerNorm after each block: the next block's input norm, then the final norm."""
        layers = self.esmc.layers
        return [layer.input_layernorm for layer in layers[1:]] + [self.esmc.norm]

    def _logits_and_hidden(self, input_ids: mx.array, mask: mx.array | None) -> tuple[mx.array, mx.array]:
        out = self._forward(input_ids, mask)  # mx.compile traces functions returning arrays
        return out.logits, out.last_hidden_state

    def _compiled_blocks(self, mask: mx.array | None) -> list:
        """One compiled function per block, (x, normed, mask) -> (x, normed) as Layer.step, for
        chunked inputs: evaluation cannot happen inside one trace of the whole model, and
        tracing 80 blocks one by one costs what tracing the model once does (one trace per
        block and input shape)."""
        key = ("blocks", mask is None, *kernel_choices())
        blocks = self._compiled.get(key)
        if blocks is None:
            pairs = zip(self.esmc.layers, self._next_norms(), strict=True)
            blocks = [self._compile_block(layer, next_norm, mask is None) for layer, next_norm in pairs]
            self._compiled[key] = blocks
        return blocks

    @staticmethod
    def _compile_block(layer: Layer, next_norm: nn.LayerNorm, no_mask: bool):
        state = [layer.state, next_norm.state]
        if no_mask:
            fn = mx.compile(lambda x, normed: layer.step(x, normed, None, next_norm)[:2], inputs=state)
            return lambda x, normed, mask: fn(x, normed)
        return mx.compile(lambda x, normed, mask: layer.step(x, normed, mask, next_norm)[:2], inputs=state)

    def _compiled_forward(self, input_ids: mx.array, mask: mx.array | None) -> tuple[mx.array, mx.array]:
        chunk = self._chunk_for(input_ids)
        if chunk is not None:
            out = self._forward(input_ids, mask, chunk=chunk, blocks=self._compiled_blocks(mask))
            return out.logits, out.last_hidden_state
        # A trace bakes in the quantized layers' matmul choice and the kernel choices: key it
        # by them too.
        key = (mask is None, *kernel_choices())
        fn = self._compiled.get(key)
        if fn is None:
            # Parameters are implicit inputs (not constants): one trace per input shape.
            if mask is None:
                fn = mx.compile(lambda ids: self._logits_and_hidden(ids, None), inputs=self.state)
            else:
                fn = mx.compile(self._logits_and_hidden, inputs=self.state)
            self._compiled[key] = fn
        return fn(input_ids) if mask is None else fn(input_ids, mask)

    def _warn_long(self, residues: int) -> None:
        """Before the first pass over an input longer than ESMC's training crop: say so, and
        what the quadratic attention will cost (every command inherits this; once per length)."""
        message = (
            f"an input of {residues:,} residues is longer than the {TRAINED_LENGTH:,} residues ({TRAINED_TOKENS:,} "
            "tokens) ESMC was trained on; its outputs are extrapolation"
        )
        if residues + 2 > 4 * TRAINED_TOKENS:
            scores = self.config.num_attention_heads * (residues + 2) ** 2 * 4  # fp32 scores, one layer, one row
            message += (
                f". Attention grows with the square of the length: expect this to be slow and to need "
                f"about {scores / 2**30:,.1f} GB per sequence for attention alone"
            )
        warnings.warn(message, EsmcMlxWarning, stacklevel=3)

    def fingerprint(self) -> str:
        """A sha256 naming these weights, whatever their runtime layout: the same for an artifact
        loaded fused or not, on the CPU in float32 or on a GPU in bfloat16 (float values are
        hashed as float32), different for another checkpoint, quantization or stored precision.
        ``embed_fasta`` and ``scan_job`` record it so that a rerun resumes only with the same
        model. It hashes each parameter's name and shape, small arrays whole and three rows
        (first, middle, last) of each matrix: hashing a 6B's 12 GB would take seconds, and
        three rows of every matrix already tell trained weights apart."""
        digest = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        for name, array, part, parts in sorted(self._unfused_parameters(), key=lambda t: t[0]):
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
        return digest.hexdigest()

    def _unfused_parameters(self):
        """(artifact name, array, part, parts) per parameter: a fused q/k/v or gate/up array is
        its parts' rows side by side (``concat_linears``), so part ``i`` of ``n`` is named as
        the unfused parameter it came from."""
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

    @property
    def dtype(self) -> mx.Dtype:
        return self.esmc.norm.weight.dtype

    def hidden_states_at(
        self,
        input_ids: mx.array,
        layers,
        attention_mask: mx.array | None = None,
        sequence_id: mx.array | None = None,
    ) -> dict[int, mx.array]:
        """``{N: hidden_states[N]}`` for each N of ``layers`` (0 = token embeddings, i = after
        block i, n_layers = after the final norm), as the full forward's ``hidden_states``
        would give them, running the blocks only up to the deepest N asked for (lazy arrays;
        inputs as ``__call__``'s, batched (B, L)). Raises SequenceError for bad inputs and
        ScoringError for an N outside 0..n_layers."""
        n = self.config.num_hidden_layers
        wanted = set()
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i <= n:
                raise ScoringError(f"hidden state {i!r}: this model has hidden states 0..{n}")
            wanted.add(int(i))
        input_ids = mx.array(input_ids)
        check_inputs(input_ids, attention_mask, sequence_id, self.config.vocab_size)
        mask = attention_mask_for(
            None if attention_mask is None else mx.array(attention_mask),
            None if sequence_id is None else mx.array(sequence_id),
        )
        mask = None if mask is None else additive_mask(mask, self.dtype)
        x = self.esmc.embed_tokens(input_ids)
        out = {0: x} if 0 in wanted else {}
        blocks, norms = self.esmc.layers, self._next_norms()
        normed = blocks[0].input_layernorm(x) if blocks else self.esmc.norm(x)
        chunk = self._chunk_for(input_ids)
        for i in range(max(wanted, default=0)):
            x, normed, _ = blocks[i].step(x, normed, mask, norms[i])
            if i + 1 in wanted:
                out[i + 1] = normed if i + 1 == n else x
            if chunk is not None and (i + 1) % chunk == 0:
                mx.eval(x, normed)  # bounded activation memory, as the full forward's chunks
        return out

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array | None = None,
        sequence_id: mx.array | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> ESMCOutput:
        """Logits and hidden states for (B, L) token ids, right padded.

        ``attention_mask`` (B, L): 1 for tokens, 0 for padding. ``sequence_id`` (B, L): chain
        ids, -1 for padding; tokens attend only within their chain (``attention_mask`` is then
        ignored). Positions are absolute from 0 across chains. Raises SequenceError for ids that
        are not integers in the vocabulary, an empty batch, a mask of another shape.
        """
        input_ids = mx.array(input_ids)
        if input_ids.ndim == 1:  # one unbatched sequence: its mask and chain ids too
            input_ids = input_ids[None]
            attention_mask = None if attention_mask is None else mx.array(attention_mask).reshape(1, -1)
            sequence_id = None if sequence_id is None else mx.array(sequence_id).reshape(1, -1)
        check_inputs(input_ids, attention_mask, sequence_id, self.config.vocab_size)
        if input_ids.shape[-1] - 2 > TRAINED_LENGTH:
            # the longest real row (batches may be padded wider than their longest sequence)
            tokens = input_ids.shape[-1] if attention_mask is None else int(np.asarray(attention_mask).sum(-1).max())
            if tokens - 2 > TRAINED_LENGTH:
                self._warn_long(tokens - 2)
        if sequence_id is None and attention_mask is not None and _no_padding(attention_mask):
            attention_mask = None  # no mask at all lets the fused attention kernels run
        mask = attention_mask_for(
            None if attention_mask is None else mx.array(attention_mask),
            None if sequence_id is None else mx.array(sequence_id),
        )
        if mask is not None:
            mask = additive_mask(mask, self.dtype)  # once, not per layer
        if not output_hidden_states and not output_attentions and self._use_compiled(input_ids, mask):
            logits, x = self._compiled_forward(input_ids, mask)
            return ESMCOutput(logits=logits, last_hidden_state=x)
        return self._forward(input_ids, mask, output_hidden_states, output_attentions, self._chunk_for(input_ids))
