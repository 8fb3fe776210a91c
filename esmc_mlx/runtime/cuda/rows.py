"""Row kernels, one block per token row in MLX's layer_norm layout (layer_norm_rows.cuh), each
MLX's ops bit for bit:

- ``qkv_heads``: the attention's QK LayerNorm, RoPE and head layout from the fused q/k/v
  projection in one pass (MLX: copies of the strided q/k views, two LayerNorms, two transposes,
  two ropes). q and k are written (B, L, H, 64), the projection's own row layout, and handed on
  as (B, H, L, 64) views, as torch hands its attention; v is a view of the projection.
- ``add_layer_norm``: ESMC's scaled residual add and the LayerNorm after it, reading x and h
  once and writing both (MLX: an add, then a LayerNorm that reads the sum back).

The arithmetic repeats mlx/backend/cuda/layer_norm.cu and rope.cu (0.32.x) as the same
expressions: fp32 sums in layer_norm's thread and warp order, mean then the variance as a second
pass, ``rsqrt(var / d + eps)``, ``w * T(norm) + T(b)`` in the input dtype; RoPE's
``inv_freq = exp2(-(p / 32) * log2(base))`` with log2(base) rounded to fp32 on the host as MLX
does. tests/test_kernels.py holds them to MLX's ops bit for bit on the GPU.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from . import source
from .kernel_cache import Kernel

HEAD_DIM = 64
GRID_X_THREADS = 2**31 - 1  # the most threads along a grid's x axis (an int32)
MAX_THREADS = 1024  # per block
FLOATS = (mx.bfloat16, mx.float16, mx.float32)
ROW_HEADER = "layer_norm_rows.cuh"


def _per_thread(dtype: mx.Dtype) -> int:
    """Columns per thread in MLX's layer_norm layout (N_READS = 16 / itemsize)."""
    return 16 // dtype.size


def _row_launch(rows: int, width: int, dtype: mx.Dtype) -> dict:
    """Grid and block for one block per row: a 2D grid of blocks once the row count times the
    block would pass the grid's int32 width (the kernels skip the last row's spare blocks)."""
    threads = -(-width // _per_thread(dtype) // 32) * 32
    nx = min(rows, GRID_X_THREADS // threads)
    return {"grid": (nx * threads, -(-rows // nx), 1), "threadgroup": (threads, 1, 1)}


def fits_a_block(width: int, dtype: mx.Dtype) -> bool:
    """Whether a row of ``width`` values fits the layout's one block a row (at most MAX_THREADS
    threads of 16 bytes each): these kernels and CUTLASS's split-K sum with its LayerNorm."""
    return width % _per_thread(dtype) == 0 and width <= _per_thread(dtype) * MAX_THREADS


def _f32_bits(x: float) -> int:
    """The fp32 bit pattern of x as a signed int (a kernel template argument)."""
    return int(np.array(x, np.float32).view(np.int32))


def rope_log2_base(base: float) -> float:
    """log2(base) as mx.fast.rope's CUDA path passes it to its kernel: ``std::log2`` of the
    fp32 base, in fp32 (here the exact log2 rounded once to fp32)."""
    return float(np.float32(math.log2(float(np.float32(base)))))


@functools.cache
def _kernel(name: str, inputs: tuple, outputs: tuple) -> Kernel:
    return Kernel(
        name=f"esmc_{name}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=source.bodies("rows.cu")[name],
        header=source.text(ROW_HEADER),
    )


def qkv_heads_supported(qkv, q_norm_weight, k_norm_weight, eps: float, rope_theta: float, num_heads: int) -> bool:
    """Whether the kernel takes these arguments. eps and log2(rope_theta) reach it as the bits of
    positive fp32 values (template integers, part of the kernel's name: no minus sign)."""
    d = num_heads * HEAD_DIM
    return (
        qkv.ndim == 3
        and qkv.shape[-1] == 3 * d
        and qkv.dtype in FLOATS
        and q_norm_weight.dtype == qkv.dtype
        and k_norm_weight.dtype == qkv.dtype
        and q_norm_weight.shape == (d,)
        and k_norm_weight.shape == (d,)
        and fits_a_block(d, qkv.dtype)
        and qkv.size > 0
        and 0 < eps < math.inf
        and 1 < rope_theta < math.inf
    )


def qkv_heads(qkv, q_norm_weight, k_norm_weight, eps: float, rope_theta: float, num_heads: int):
    """q, k, v as (B, H, L, 64) from the fused projection output (B, L, 3d):
    ``rope(layer_norm(q) * w_q)``, the same for k, and v; the caller checked ``qkv_heads_supported``."""
    B, L, _ = qkv.shape
    rows = (B, L, num_heads, HEAD_DIM)
    q, k = _kernel("qkv_heads", ("qkv", "q_weight", "k_weight"), ("q", "k"))(
        inputs=[qkv, q_norm_weight, k_norm_weight],
        template=[
            ("T", qkv.dtype),
            ("HEADS", num_heads),
            ("EPS_BITS", _f32_bits(eps)),
            ("LOG2_BASE_BITS", _f32_bits(rope_log2_base(rope_theta))),
        ],
        output_shapes=[rows] * 2,
        output_dtypes=[qkv.dtype] * 2,
        **_row_launch(B * L, num_heads * HEAD_DIM, qkv.dtype),
    )
    v = qkv[..., 2 * num_heads * HEAD_DIM :].reshape(rows)
    return tuple(a.transpose(0, 2, 1, 3) for a in (q, k, v))


def add_layer_norm_supported(x, h, weight, bias, eps: float) -> bool:
    """Whether the kernel takes these arguments."""
    d = x.shape[-1] if x.ndim else 0
    return (
        x.shape == h.shape
        and x.dtype in FLOATS
        and h.dtype == x.dtype
        and weight.dtype == x.dtype
        and weight.shape == (d,)
        and (bias is None or (bias.dtype == x.dtype and bias.shape == (d,)))
        and fits_a_block(d, x.dtype)
        and x.size > 0
        and 0 < eps < math.inf
    )


def add_layer_norm(x, h, scale: float, weight, bias, eps: float) -> tuple[mx.array, mx.array]:
    """``x + h / scale`` and ``mx.fast.layer_norm`` of it from one kernel; ``scale`` rounded to
    x's dtype as MLX rounds a Python scalar, the bias zero when None (as mx.fast.layer_norm adds
    it). The caller checked ``add_layer_norm_supported``."""
    d = x.shape[-1]
    rows = x.size // d
    residual, normed = _kernel("add_layer_norm", ("x", "h", "scale", "weight", "bias"), ("residual", "normed"))(
        inputs=[
            x.reshape(rows, d),
            h.reshape(rows, d),
            mx.array([scale], dtype=x.dtype),
            weight,
            mx.zeros((d,), x.dtype) if bias is None else bias,
        ],
        template=[("T", x.dtype), ("D", d), ("EPS_BITS", _f32_bits(eps))],
        output_shapes=[(rows, d)] * 2,
        output_dtypes=[x.dtype] * 2,
        **_row_launch(rows, d, x.dtype),
    )
    return residual.reshape(x.shape), normed.reshape(x.shape)
