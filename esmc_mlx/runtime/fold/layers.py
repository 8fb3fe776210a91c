"""The small layers every part of ESMFold2 shares (transformers' ``modeling_esmfold2`` twins).

Attribute names are transformers' own, so checkpoint names need no mapping. Norms compute in
float32 and return their input's dtype, as the reference's do; its float32-pinned weights
(``_keep_in_fp32_modules_strict``) stay float32 in every artifact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

# Pair work is built a chunk at a time, each chunk evaluated before the next, where the pair is large
# (at least PIECEWISE_ELEMENTS: batch * L * L * width, 384 residues at width 256) and the memory left
# to MLX would not hold LAYER_PAIR_SIZES copies of it. A pair-update layer's temporaries take about
# 23 pair sizes lazily (CPU); a GPU also holds about 15 per layer it has queued and not finished, and
# PairUpdateStack keeps two in flight: 64 leaves a margin. Otherwise pairs stay one lazy graph a step
# (no sync per chunk, which costs a GPU about half its speed at 512 residues).
PIECEWISE_ELEMENTS = 384 * 384 * 256
LAYER_PAIR_SIZES = 64
NORM_ROWS = 64  # the rows of a pair a piecewise LayerNorm takes at a time


def memory_left() -> int:
    """The bytes MLX may still allocate before its memory limit (``mx.set_memory_limit``)."""
    return mx.get_memory_limit() - mx.get_active_memory()


def piecewise(x: mx.array) -> bool:
    """Whether work on ``x`` is evaluated a piece at a time: ``x`` has ``PIECEWISE_ELEMENTS`` or more
    and ``LAYER_PAIR_SIZES`` copies of it would not fit in ``memory_left``."""
    return x.size >= PIECEWISE_ELEMENTS and LAYER_PAIR_SIZES * x.nbytes > memory_left()


def join_chunks(part: Callable[[slice], mx.array], n: int, step: int, axis: int, evaluate: bool) -> mx.array:
    """``part(rows)`` for each ``step`` rows of ``range(n)``, joined along ``axis``: concatenated, or,
    with ``evaluate``, each written into one array and evaluated before the next is built, so that
    one chunk's temporaries exist at a time and the joined array exists once."""
    chunks = [slice(i, i + step) for i in range(0, n, step)]
    if not evaluate:
        parts = [part(rows) for rows in chunks]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)
    out = None
    for rows in chunks:
        chunk = part(rows)
        if out is None:
            out = mx.zeros((*chunk.shape[:axis], n, *chunk.shape[axis + 1 :]), chunk.dtype)
        out[(slice(None),) * axis + (rows,)] = chunk
        mx.eval(out)
    return out


class LayerNorm(nn.Module):
    """LayerNorm computed in float32 (weights float32), returning the input's dtype. A ``piecewise``
    pair ([B, L, L, d]) is normed ``NORM_ROWS`` rows at a time: its float32 copies never exist whole."""

    def __init__(self, dims: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))
        if bias:
            self.bias = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.bias if "bias" in self else None

        def norm(x: mx.array) -> mx.array:
            return mx.fast.layer_norm(x.astype(mx.float32), self.weight, bias, self.eps).astype(x.dtype)

        if x.ndim != 4 or not piecewise(x):
            return norm(x)
        return join_chunks(lambda rows: norm(x[:, rows]), x.shape[1], NORM_ROWS, 1, True)


def plain_layer_norm(x: mx.array, eps: float = 1e-5) -> mx.array:
    """Weightless LayerNorm in float32 (the result stays float32)."""
    return mx.fast.layer_norm(x.astype(mx.float32), None, None, eps)


def rms_norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """Weightless RMSNorm in float32, returning the input's dtype."""
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class SwiGLU(nn.Module):
    """``down(up * silu(gate))`` with gate and up fused in ``gate_up_proj`` (gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(up * nn.silu(gate))


class Transition(nn.Module):
    """LayerNorm + SwiGLU residual, ``chunk_size`` rows of axis 1 at a time (None: all at once), each
    chunk evaluated before the next where the input is ``piecewise``."""

    def __init__(self, hidden_size: int, intermediate_size: int, chunk_size: int | None):
        super().__init__()
        self.norm = LayerNorm(hidden_size)
        self.mlp = SwiGLU(hidden_size, intermediate_size)
        self.chunk_size = chunk_size

    def __call__(self, x: mx.array) -> mx.array:
        n = x.shape[1]
        step = self.chunk_size or n
        if step >= n:
            return x + self.mlp(self.norm(x))
        return join_chunks(lambda rows: x[:, rows] + self.mlp(self.norm(x[:, rows])), n, step, 1, piecewise(x))


class AdaptiveLayerNorm(nn.Module):
    """adaLN-Zero: ``sigmoid(gate(c)) * LN(x) + shift(c)`` with ``c`` the normed conditioning."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.cond_norm = LayerNorm(hidden_size, eps=eps, bias=False)
        self.gate_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.shift_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def __call__(self, x: mx.array, single: mx.array) -> mx.array:
        normed = plain_layer_norm(x, self.eps)  # float32: the affine below rounds once
        cond = self.cond_norm(single)
        return (mx.sigmoid(self.gate_proj(cond)) * normed + self.shift_proj(cond)).astype(x.dtype)


class FourierEmbedding(nn.Module):
    """``cos(2 pi (t * frequencies + phases))`` with fixed (stored, not learned) float32 buffers."""

    def __init__(self, dims: int):
        super().__init__()
        self.frequencies = mx.zeros((dims,))
        self.phases = mx.zeros((dims,))

    def __call__(self, t: mx.array) -> mx.array:
        return mx.cos(2.0 * math.pi * (t[:, None] * self.frequencies[None, :] + self.phases[None, :]))
