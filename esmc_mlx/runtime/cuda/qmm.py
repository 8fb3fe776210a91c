"""The fused quantized matmul: ``x @ dequantize(w).T`` with the packed weight dequantized in
registers on its way to the tensor cores (after Frantar et al. 2024, "MARLIN", written from the
paper's ideas), for bf16/fp16 inputs and 4- or 8-bit weights.

- mma.sync m16n8k16 with the weight rows as A and the tokens as B, fp32 sums; a weight value is
  dequantized once per block, in registers, straight into the A fragments, and is exactly
  ``mx.dequantize``'s value (the same octet functions, or the same arithmetic on pairs).
- K in steps of 64 columns, permuted inside a step so that a thread's 16 values of a row are the
  A fragments it needs; x and the packed weight arrive by 16-byte cp.async, 4 steps in flight.
- Tiles: "1d" (a warp 16 weight rows x all of a block's 16-128 tokens), "2d" (a warp 32 rows x
  64 tokens) and, on Hopper, "wg" (warpgroup MMA, 128 rows x 256 tokens a block). K is split
  into fp32 slabs where the tiles leave the SMs idle; ``split_sum`` adds them in slab order.
The products are summed in another order than cuBLAS's, so outputs differ from dequantize +
matmul by fp32 rounding. Which tile, and how many splits, is the plan's (runtime/dispatch.py).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import source
from .kernel_cache import Kernel

BK, STAGES, THREADS, BW = 64, 4, 256, 128  # K a step, steps in flight, threads and weight rows a block
TILE_2D = (64, 2, 1)  # tokens a block, m16 tiles a warp, warps along the tokens
WG_TOKENS = 256
FLOATS = (mx.bfloat16, mx.float16)  # what the tensor-core instruction takes


def _header(tile: str) -> str:
    header = source.text("octets.cuh") + source.text("qmm.cuh")
    return header + source.text("wgmma.cuh") if tile == "wg" else header


def _body(tile: str, variant: str) -> str:
    cu = source.bodies("qmm.cu")
    text = cu[f"{tile}_head"] + cu["setup"] + cu[f"{tile}_tail"] + cu["store"]
    regs, load, octet = (cu[f"{variant}_{part}"] for part in ("regs", "load", "octet"))
    return text.replace("SCALE_REGS", regs).replace("LOAD_SCALES", load).replace("DEQUANT", octet)


def _shared_bytes(bt: int, bw: int, bits: int) -> int:
    stages = STAGES * (bt * BK * 2 + bw * BK * bits // 8)
    return max(stages, bt * (bw + 4) * 4)


def _2d_rows() -> int:
    _, mi, wn = TILE_2D
    return (8 // wn) * 16 * mi


@functools.cache
def _kernel(tile: str, variant: str, bits: int, group_size: int, bt: int) -> Kernel:
    if tile == "1d":
        name, shared = f"esmc_qmm_{variant}_{bits}_{group_size}_{bt}", _shared_bytes(bt, BW, bits)
    elif tile == "2d":
        name, shared = f"esmc_qmm2_{variant}_{bits}_{group_size}_2d", _shared_bytes(TILE_2D[0], _2d_rows(), bits)
    else:  # the swizzle's alignment on top of the 1d tile's buffers
        name, shared = f"esmc_qmmwg_{variant}_{bits}_{group_size}", _shared_bytes(WG_TOKENS, BW, bits) + 1024
    return Kernel(
        name=name,
        input_names=["x", "w", "scales", "biases"] if variant.startswith("affine") else ["x", "w", "scales"],
        output_names=["y"],
        source=_body(tile, variant),
        header=_header(tile),
        shared_memory=shared,
    )


def variant(mode: str, bits: int, x_dtype, scales_dtype, fast: bool = True) -> str:
    """The decode: pairs of values at a time (``fast``) for 4-bit affine with scales in x's
    dtype and for mxfp4 into bf16, else octets (the same values either way)."""
    if mode == "affine":
        return "affine_fast" if fast and bits == 4 and scales_dtype == x_dtype else "affine"
    return "fp_fast" if fast and mode == "mxfp4" and x_dtype == mx.bfloat16 else "fp"


def quantized_matmul(
    x, w, scales, biases, group_size: int, bits: int, mode: str, tile: str, bt: int, splits: int, fast=True
):
    """``x @ dequantize(w, ...).T`` by the fused kernel in ``tile`` ("1d", "2d", "wg"), ``bt``
    tokens a block and K in ``splits`` slabs (the plan's), for ``x`` in bf16 or fp16."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    if tile == "wg":
        bt, bw, extra = WG_TOKENS, BW, []
    elif tile == "2d":
        bt, bw, extra = TILE_2D[0], _2d_rows(), [("MI", TILE_2D[1]), ("WN", TILE_2D[2])]
    else:
        bw, extra = BW, []
    kernel = _kernel(tile, variant(mode, bits, x.dtype, scales.dtype, fast), bits, group_size, bt)
    inputs = [x.reshape(rows, k), w, scales.reshape(n, -1)]
    template = [("O", x.dtype), ("BITS", bits), ("GROUP", group_size), ("BT", bt), ("SPLIT", splits > 1), *extra]
    template.append(("T", scales.dtype) if mode == "affine" else ("MX", int(mode != "nvfp4")))
    if mode == "affine":
        inputs.append(biases.reshape(n, -1))
    (y,) = kernel(
        inputs=inputs,
        template=template,
        grid=(-(-n // bw) * THREADS, -(-rows // bt), splits),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(splits, rows, n) if splits > 1 else (rows, n)],
        output_dtypes=[mx.float32 if splits > 1 else x.dtype],
    )
    if splits > 1:
        y = split_sum(y, x.dtype)
    return y.reshape(*x.shape[:-1], n)


@functools.cache
def _split_sum_kernel() -> Kernel:
    return Kernel(
        name="esmc_split_sum",
        input_names=["parts"],
        output_names=["y"],
        source=source.bodies("qmm.cu")["split_sum"],
        header=source.text("octets.cuh"),
    )


def split_sum(parts: mx.array, dtype: mx.Dtype) -> mx.array:
    """``parts.sum(axis=0).astype(dtype)`` for fp32 partials (S, M, N), N a multiple of 8: the
    slabs added in order and rounded once, in one launch (MLX: a reduce and a cast)."""
    s, m, n = parts.shape
    (y,) = _split_sum_kernel()(
        inputs=[parts.reshape(s, m * n)],
        template=[("O", dtype)],
        grid=(-(-m * n // 8 // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )
    return y


def supported(x, w, group_size: int, bits: int) -> bool:
    """Whether the kernel takes these arrays (the plan checked the weight's kind)."""
    k = x.shape[-1] if x.ndim else 0
    return (
        x.dtype in FLOATS
        and w.ndim == 2
        and k > 0
        and k % BK == 0
        and x.size > 0
        and w.shape[1] * 32 // bits == k
        and w.shape[0] % 8 == 0
        and group_size >= 16
    )
