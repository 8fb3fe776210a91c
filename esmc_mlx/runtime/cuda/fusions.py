"""The fusible steps of a block on a CUDA GPU (load() hands them to the model there). Each runs
the kernel its plan names (runtime/dispatch.py), else MLX's ops; the values are the same:

- ``heads``: the QK LayerNorm, RoPE and head layout of the fused q/k/v projection in one kernel
  (rows.qkv_heads).
- ``add_norm``: a residual add and the LayerNorm after it. Where CUTLASS runs the product in
  split-K slabs, the kernel that sums the slabs also adds the residual stream and normalizes it;
  else one kernel for the add and the LayerNorm (rows.add_layer_norm), from a size on.
- ``block``: a block's weights that take dequantize + matmul dequantized by one launch instead
  of one each (dequantize.dequantize_together), each layer's ``w.T`` a view of its output.
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx

from .. import dispatch
from ..model import Ops
from ..quantized import QuantizedLinear, dtype_name, token_count
from . import cutlass_qmm, dequantize, rows


def transposed_views(values: mx.array, shapes: list[tuple]) -> list[mx.array]:
    """``w.T`` of each weight of ``shapes`` whose values lie in ``values`` (1-D) one weight after
    another, row-major: strided views, no copy (one graph node each)."""
    views, offset = [], 0
    for shape in shapes:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        views.append(mx.as_strided(values, shape[::-1], strides[::-1], offset))
        offset += math.prod(shape)
    return views


class CudaOps(Ops):
    def heads(self, attn, x):
        if "qkv_proj" in attn:
            plan = dispatch.attention_heads(attn.head_dim, True, dtype_name(x.dtype), dispatch.current())
            if plan.path == "qkv_heads":
                qkv = attn.qkv_proj(x)  # lazy: left unevaluated (free) when the kernel does not take it
                args = (qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, attn.rope_theta, attn.num_heads)
                if rows.qkv_heads_supported(*args):
                    return rows.qkv_heads(*args)
        return super().heads(attn, x)

    def add_norm(self, x, linear, h, scale, norm):
        if norm is None:
            return super().add_norm(x, linear, h, scale, norm)
        if isinstance(linear, QuantizedLinear) and x.dtype == h.dtype and "bias" not in linear:
            plan = linear.plan(token_count(h), h.dtype, added=True)
            if plan.path == "cutlass" and plan.splits > 1:
                return cutlass_qmm.matmul(linear, h, plan.tile, plan.splits, residual=x, scale=scale, norm=norm)
        y = linear(h)
        plan = dispatch.residual_norm(x.size, dtype_name(x.dtype), dispatch.current())
        weight, bias = norm.weight, norm.get("bias")
        if plan.path == "add_layer_norm" and rows.add_layer_norm_supported(x, y, weight, bias, norm.eps):
            return rows.add_layer_norm(x, y, scale, weight, bias, norm.eps)
        x = x + y / scale
        return x, norm(x)

    @contextlib.contextmanager
    def block(self, layer, x):
        target = dispatch.current()
        if not target.allows("dequantize"):
            yield
            return
        tokens, groups = token_count(x), {}
        for _, m in layer.named_modules():
            if isinstance(m, QuantizedLinear) and m.plan(tokens, x.dtype).path == "dequantize":
                groups.setdefault((m.mode, m.bits, m.group_size, m["scales"].dtype), []).append(m)
        given, blocks = [], target.device.sms * target.tuning.dequantize_blocks_per_sm
        for (mode, bits, group_size, _), members in groups.items():
            if len(members) < target.tuning.together_min_weights:
                continue
            packed = [(m["weight"], m["scales"], m.get("biases")) for m in members]
            values = dequantize.dequantize_together(packed, group_size, bits, mode, x.dtype, blocks)
            if values is None:
                continue
            shapes = [dequantize.dequantized_shape(w, bits) for w, _, _ in packed]
            for m, wt in zip(members, transposed_views(values, shapes), strict=True):
                object.__setattr__(m, "given_transposed", wt)
                given.append(m)
        try:
            yield
        finally:
            for m in given:
                object.__setattr__(m, "given_transposed", None)


CUDA = CudaOps()
