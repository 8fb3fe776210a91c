"""Running quantized layers fast on every backend.

``mx.quantized_matmul`` reads the packed weights directly: the fastest choice for a few tokens
(it moves 2-8x fewer bytes than a float matmul). For many tokens it can lose badly: on MLX's
CPU backend it runs at a few GFLOP/s against ~200 for fp32 BLAS, and on CUDA it is slower
than a bf16 GEMM at large batch. There, dequantizing the weight (per call, into a temporary
that is freed right after) and running the float matmul is faster. The choice is made per
call from the token count, with the measured crossovers in CROSSOVER_TOKENS
(benchmarks/quant_matmul.py, docs/quantization.md). On CUDA a third path,
``kernels.quantized_matmul`` (a fused tensor-core kernel that dequantizes the packed weight in
registers, no bf16 copy), takes the token windows in FUSED_TOKENS where whole forwards
measured it ahead.

The dequantized weight is not cached: keeping it would cost the float model's memory, which is
what quantization was for. ``dequantize_model`` does that on purpose, for users who have the
memory and want float speed at every token count (and for validation: the same model with
the dequantized weights in place).
"""

from __future__ import annotations

import contextlib
import math
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path, tree_unflatten

from . import cutlass_qmm, kernels

# Token count (rows of x, all batch dims flattened) from which dequantize-then-matmul is used
# instead of quantized_matmul, per backend and mode ("affine4": affine at 4 bits; "affine":
# every affine width without its own entry). math.inf: always quantized_matmul.
CROSSOVER_TOKENS = {
    # Measured on this project's 2-core x86 CPU host, mlx 0.32.4 + OpenBLAS
    # (benchmarks/quant_matmul.py, docs/quantization.md). Dequantizing the fp4 formats is
    # ~3x slower than affine on the CPU, so they switch later.
    "cpu": {"affine": 8, "mxfp8": 4, "mxfp4": 32, "nvfp4": 32},
    # Measured on an H200, mlx 0.32.4, bf16, in whole forwards at batch 1 with every block
    # weight through one path, then the other (python -m benchmarks.crossover_forward --model
    # 6B / 300M; the smallest of 32..4096 tokens from which dequantize + matmul took at most
    # 1.03x the time of quantized_matmul at every larger count; docs/quantization.md). Two
    # tables (SMALL_WIDTH below splits them): "cuda" for the 6B's weights, measured on the 6B,
    # "cuda-small" for the 300M's, measured on the 300M. 32 is the smallest count measured,
    # except the 6B's mxfp4 at 16 (0.59 of quantized_matmul's time
    # there, ninth issue-16 session; ahead at 8 too in one tenth-session run) and affine4 at 16
    # (quantized_matmul ahead in two tenth-session runs: 32 stands). Timing one weight in
    # bursts of calls (benchmarks.dequant_kernels) had put these at 64-1024 tokens: a 6B
    # forward at 1x256 then took 33.7 ms in affine8, against 20.2 ms with this table. Every
    # entry is from forwards of 32-1024 tokens or more.
    "cuda": {
        **{"affine2": 32, "affine3": 32, "affine4": 32, "affine5": 32, "affine6": 32, "affine8": 32},
        **{"mxfp4": 16, "mxfp8": 32, "nvfp4": 32},
    },
    "cuda-small": {
        **{"affine2": 64, "affine3": 32, "affine4": 32, "affine5": 32, "affine6": 32, "affine8": 128},
        **{"mxfp4": 32, "mxfp8": 32, "nvfp4": 512},
    },
    # Not measured here: Metal's quantized kernels are what mlx-lm runs at every batch size.
    "metal": {"affine": math.inf, "mxfp8": math.inf, "mxfp4": math.inf, "nvfp4": math.inf},
}
# Token windows [lo, hi) in which kernels.quantized_matmul (the fused kernel that reads the
# packed weight: no bf16 copy) replaces the table's path, per table (SMALL_WIDTH) and mode.
# Each window is the token counts at which whole forwards at B=1, every supported block weight
# through each path and the sides interleaved, had the fused kernel ahead of the path the
# tables give there (python -m benchmarks.crossover_forward --model 6B / 300M --sides
# bf16,shipped,fused --tokens ...; docs/benchmarks.md, fifteenth and twentieth issue-16
# sessions; raw docs/bench/crossover_*_session15.json, crossover_*_session20.json). Fused /
# that path, H200, since the fused kernels' x copies were cut to a pointer a thread (twentieth
# session, one run each):
# - 6B: affine4 0.96 / 0.85 at 384 / 512 tokens, mxfp4 0.76 / 0.72, affine8 0.89 / 0.86; from
#   576 tokens (a third 256-token tile) 1.23-1.41 in every mode. At 8-256 tokens the fifteenth
#   and sixteenth sessions' figures stand (affine4 0.71-0.97, mxfp4 0.61-0.91, affine8 behind
#   quantized_matmul below 32 tokens and 0.76-0.91 at 32-256 in most runs).
# - 300M: affine4 0.77 at 1536 tokens, 0.86 and 0.99 at 2048 (two runs), 1.08 at 4096; mxfp4
#   0.85 at 1536, 1.00-1.01 at 2048 (a tie: kept), 1.05 at 4096; affine8 0.81 at 1024, 1.16 at
#   1536, 1.34-1.61 at 2048-4096. At 1024 tokens, inside the affine4 / mxfp4 windows already,
#   the same path on both sides read 0.98-1.01: the runs' noise. Before (fifteenth session):
#   affine4 / mxfp4 0.78-1.03 at 32-1024, affine8 0.83-0.92 at 128-512. The 300M at B=1 is
#   host-bound (MLX encodes its ops slower than the GPU runs them): one launch a
#   weight instead of a dequantize and a matmul is what it gains.
# Twenty-third session, with a block's dequantizes in one launch (kernels.dequantize_together,
# which made dequantize + matmul faster on the 300M's and the 600M's weights), fused / that
# path, two runs on the 300M and one on the 600M (crossover_forward --sides
# bf16,shipped,dequantize; raw docs/bench/crossover_*_session23.json): at 2048 tokens affine4
# 1.19 / 1.18 / 1.17 and mxfp4 1.21 / 1.13 / 1.10, so those windows end at 2048; affine8 at 1024
# 1.06 / 1.06 / 1.10, so its window ends at 1024; fused ahead or tied below that (affine4 0.81
# at 1536, 0.86-0.96 at 1024; mxfp4 1.02 at 1536, 0.84-1.04 at 1024; affine8 0.97 at 768). The
# same path on both sides (affine8 at 1536-2048) read 0.98-1.02.
# Twenty-seventh session: dequantize + matmul had come to take a third less time on the 6B at
# 384-512 tokens since the twentieth (one launch a block, views, this project's dequantize for
# the o_proj): mxfp4 and affine8 20.0-22.7 ms against 30.1-33.7, the fused kernel 23.3-27.6
# against 24.2-27.9. Fused / dequantize + matmul, three runs (crossover_forward --sides
# dequantize,fused; raw docs/bench/crossover_*_session27*.json):
# - 6B: 0.86-0.99 at 192-256 tokens; 1.10-1.39 at 264-320 (a second 256-token tile); 1.07-1.30
#   at 384-512, but for affine4 in one run (0.99, 0.90): the 6B's windows end at 256.
# - 300M and 600M (their table), on three machines, which disagreed. On the second (300M bf16
#   at 1x256 in 3.4-3.9 ms), dequantize + matmul won from 96 tokens in every mode: fused / it
#   1.00-1.12 at 96, 1.01-1.35 at 128-512 (48 of 48 cells), 0.84-1.00 at 32-64. On the first,
#   the fused kernel won affine8 at 128-256 in 18 of 32 cells (0.84-0.99; the rest 1.00-1.12);
#   on a third, slower (300M bf16 at 1x128 in 6.8 ms), it won at 128-512 in every mode measured,
#   0.80-0.90 in 13 of 13 cells.
#   Moved only where the first two agree: affine8's window is 32-383 (it took 0.68-0.96 of
#   quantized_matmul's time, the table's path below 128, at 32-96 tokens in 16 of 18 cells;
#   at 384-768, 1.00-1.46 of dequantize + matmul's in 24 of 28 cells), and the 4-bit windows
#   end at 1024 (there 1.07-1.16 in 12 of 12 cells on the second machine, 0.83-1.13 in 12 on
#   the first, 0.96 in the twenty-sixth session's; 1.02-1.28 at 1280-1536 in both sessions but
#   one cell, 0.87).
#   Inside the windows the better path follows the host's speed (a slow host favours the
#   fused kernel's one launch a weight), so they stay as they were. The new ends favour fast
#   hosts: the third machine had the fused kernel ahead at 512 too, and was not timed at 384
#   or 1024.
# Below 8 tokens (6B) and 32 (300M) not measured against quantized_matmul. Never splitting K
# (ESMC_MLX_QMM_WAVES=0: no split_sum launch) did not help the 300M: 0.92-1.31 of the split
# kernel's time at 64-2048 tokens (one run).
FUSED_TOKENS = {
    "cuda": {"affine4": (8, 257), "mxfp4": (8, 257), "affine8": (32, 257)},
    "cuda-small": {"affine4": (32, 1024), "mxfp4": (32, 1024), "affine8": (32, 384)},
}
# Weights whose smaller dimension is under this take the "cuda-small" tables. A block weight's
# smaller dimension is its model's hidden size (q/k/v, o, gate/up and down alike): 960 for the
# 300M and 1152 for the 600M (the 300M's tables), 2560 for the 6B (the 6B's). The split was
# kernels.MIN_VALUES (8M values, then also where this project's dequantize took over) until
# the 300M's affine8 window reached 1024 tokens: the 6B's o_proj (2560x2560, 6.6M values) then ran the
# fused kernel's "2d" tile at 1x1024 and the affine8 forward took 1.40-1.43x bf16 against
# 1.25-1.26x. 6B forwards with the o_proj on the 6B's tables against the 300M's (one run, H200,
# twentieth issue-16 session; docs/benchmarks.md): affine8 0.90 at 1x1024, affine4 0.97, mxfp4
# 1.00; 1.00-1.02 at 1x256, where the o_proj runs the fused kernel either way. No split by
# values keeps each model on one table: the 600M's gate/up (6144x1152, 7.1M) is larger than
# the 6B's o_proj. (python -m benchmarks.min_values_ab --gate small-width times another split.)
SMALL_WIDTH = 2048
# The most tokens at which a call the tables give to dequantize + matmul goes to CUTLASS's
# mixed-input GEMM instead (runtime/cutlass_qmm: where it is built, affine 4/8-bit and mxfp4), per
# table.
# Whole forwards, H200, quantized / bf16 time with dequantize + matmul -> with CUTLASS, affine4
# and affine8, the sides interleaved (thirty-second issue-16 session, exp runs and
# python -m benchmarks.cutlass_qmm_ab; docs/benchmarks.md):
# - 6B: 512 tokens 1.22 -> 1.03 and 1.19 -> 1.02; 1024 tokens 1.18 -> 1.15 and 1.22 -> 1.15,
#   again 1.21 -> 1.19 and 1.23 -> 1.16; 2048 (2x1024) 1.11 -> 1.17 and 1.14 -> 1.18; 4096
#   (16x256) 1.04 -> 1.09 and 1.06 -> 1.08, 1.05 -> 1.11 and 1.09 -> 1.13; 32768 (64x512)
#   1.00 -> 1.03 and 1.01 -> 1.05. The 6B's end then: 1024.
# - 300M: 1024 tokens 1.14 -> 0.91 and 1.07 -> 0.86; 4096 (16x256) 1.09 -> 0.97 and
#   1.08 -> 1.00, (4x1024) 1.06 -> 1.00 and 1.07 -> 0.96; 512 (affine8; affine4's 512 is in
#   the fused window) 1.13 -> 0.87; 32768 (64x512) 1.06 -> 1.10 and 1.06 -> 1.12. The 300M's
#   end: 4096; 4097-32767 not measured. The 600M shares the 300M's table, not measured.
# Thirty-third session, with stream-K where the tiles leave the SMs' last wave short
# (cutlass_qmm.schedule's stream-K, first by the fill alone; python -m benchmarks.cutlass_qmm_ab): 6B 1x512
# 1.16 -> 0.99 and 1.29 -> 1.17; 1x1024 1.21 -> 1.13 and 1.23 -> 1.11; 2048 (1x2048) 1.12 -> 1.07
# and 1.11 -> 1.07; 4096 (16x256) 1.07 -> 1.09 and 1.07 -> 1.08. With the iteration floor:
# 1x1024 1.21 -> 1.12 and 1.23 -> 1.11, 1x2048 1.11 -> 1.06 and 1.11 -> 1.06; on a second
# machine 1x1024 1.19 -> 1.14 and 1.21 -> 1.11, 1x2048 1.11 -> 1.12 and 1.10 -> 1.09. The 6B's
# end: 2048 (ahead there in three cells of four).
# mxfp4 (--modes mxfp4 --sides dequantize,cutlass, one run a machine): 6B 1536 tokens 1.12 ->
# 1.07; 2048 1.01 -> 1.04 and 0.99 -> 1.01 (thirty-sixth, thirty-seventh sessions: it ended at
# 1536 then). With its k-block decode by shifts and masks (thirty-ninth session, two machines):
# 1536 1.08 -> 0.98; 1792 1.04 -> 1.02; 2048 1.01 -> 1.00 and 1.02 -> 1.02; 2x1024 1.03 -> 1.03.
# Every mode now ends where affine's does.
CUTLASS_TOKENS = {"cuda": 2048, "cuda-small": 4096}
# Per table, (fewest tokens, least fill): from that many tokens CUTLASS also takes the calls of
# the fused kernel's windows (FUSED_TOKENS) for a weight whose tiles keep at least that share of
# the SMs busy, each counted once per slab where split-K cuts K (cutlass_qmm.sm_fill); on a table
# not named, never. CUTLASS's tile runs near an SM's peak but leaves the other SMs idle; the
# fused kernel splits K to fill them, at a slower pace. Whole forwards at B=1, H200, the time
# with CUTLASS / with the fused kernel, affine4 and affine8, the sides interleaved (thirty-fifth
# issue-16 session, python -m benchmarks.cutlass_qmm_ab --sides dequantize,fused,cutlass;
# docs/benchmarks.md):
# - 300M and 600M ("cuda-small"), every weight: from 128 tokens CUTLASS was ahead in 19 of 22
#   cells (geometric means 0.87 and 0.94 on the 300M, 0.97 and 0.92 on the 600M; the three
#   behind 1.01-1.04, at 256 and 768 tokens); at 32-96 in 7 of 12 (0.83-1.20 of the time).
# - 6B, every weight: 1.04-1.08 at 64 and 128 tokens, 0.99 and 1.05 at 256 (one run). Weight by
#   weight (fortieth session): its q/k/v (60 tiles at up to 256 tokens: 0.45 of 132 SMs) and
#   gate/up (108: 0.82) go to CUTLASS, its o_proj and down_proj (20: 0.15) keep the fused
#   kernel. Per kernel (Nsight Compute, one call at a time; python -m
#   benchmarks.cutlass_schedules), us, fused -> CUTLASS as cutlass_qmm.schedule picks (affine4 /
#   mxfp4 / affine8):
#   - 256 tokens: q/k/v 32.1 / 31.9 / 35.0 -> 26.9 / 27.1 / 26.1; gate/up 44.5 / 45.4 / 51.2 ->
#     30.9 / 30.9 / 30.8; o_proj 18.2 / 18.1 / 25.6 against 25.4 / 26.0 / 24.7; down_proj 29.4 /
#     29.7 / 31.9 against 41.9 / 41.4 / 42.1 (cuBLAS on bf16: 17.2, 27.3, 8.2, 17.4).
#   - 128 tokens: q/k/v 29.7 / 32.9 / 33.8 -> 25.7 / 26.0 / 25.1; gate/up 48.3 / 51.9 / 55.8 ->
#     26.4 / 27.0 / 26.1. 64 tokens: q/k/v 19.5 against 25.6, gate/up 31.2 against 32.1
#     (affine4): the fused kernel, hence 128.
#   Whole 6B forwards, quantized / bf16, the fused kernel -> this (cutlass_qmm_ab --sides
#   fused,shipped, one process a machine, host-bound: bf16 15-21 ms): 1x256 0.90 -> 0.88, 1.00
#   -> 0.94, 1.00 -> 0.94, again 0.91 -> 0.89, 0.99 -> 0.93, 1.02 -> 0.98; 1x128 1.19 -> 0.99,
#   0.97 -> 0.90, 0.98 -> 0.90 (mxfp4, affine4, affine8).
# - With split-K (forty-third session) the o_proj and down_proj's 20 tiles run in 5 and 6 slabs
#   (0.76 and 0.91 of the SMs) and CUTLASS takes them too: at 256 tokens o_proj 18.1 / 25.2 /
#   18.1 -> 15.9 / 16.0 / 15.8 us, down_proj 29.9 / 32.1 / 29.7 -> 22.8 / 22.9 / 22.5 (affine4 /
#   affine8 / mxfp4). Four 6B layers' kernels at 1x256 1.23 / 1.33 / 1.23 -> 1.15 / 1.18 / 1.15x
#   bf16's (1.12 / 1.15 / 1.14 with the 128 x 128 tile, cutlass_qmm.NARROW_TILES); whole
#   forwards on two machines (cutlass_qmm_ab --sides no-split,shipped; host-bound: the quantized
#   forwards 14.0-19.6 ms) took 0.89-0.99 of the time before at 1x128 and 1x256.
CUTLASS_OVER_FUSED = {"cuda-small": (128, 0.0), "cuda": (128, 0.4)}
# ESMC_MLX_QUANT_MATMUL=quantized|dequantize|fused forces one path (benchmarks, debugging;
# fused where kernels.quantized_matmul runs, else the table); "auto" or unset uses the tables.
POLICY_ENV = "ESMC_MLX_QUANT_MATMUL"


def backend() -> str:
    """'cpu', 'cuda' or 'metal': where the default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def mode_name(mode: str, bits: int | None) -> str:
    """A quantization's name as CROSSOVER_TOKENS and the benchmarks key it: "affine4", "mxfp4"."""
    return f"affine{bits}" if mode == "affine" else mode


def table_name(width: int) -> str:
    """The key of CROSSOVER_TOKENS and FUSED_TOKENS here for a weight whose smaller dimension is
    ``width``."""
    name = backend()
    return "cuda-small" if name == "cuda" and width < SMALL_WIDTH else name


def crossover(mode: str, bits: int | None = None, width: int = 0) -> float:
    """CROSSOVER_TOKENS' entry for a weight of smaller dimension ``width`` quantized as (mode, bits)."""
    table = CROSSOVER_TOKENS[table_name(width)]
    return table.get(mode_name(mode, bits), table.get(mode, math.inf))


def forced_path() -> str:
    """POLICY_ENV's path ("quantized", "dequantize" or "fused"), or "auto": the tables'."""
    return os.environ.get(POLICY_ENV, "auto").lower()


def dequantize_first(tokens: int, mode: str, bits: int | None = None, width: int = 0) -> bool:
    """True when dequantize-then-matmul is the faster path for ``tokens`` rows through a weight
    of smaller dimension ``width`` quantized as (mode, bits)."""
    forced = forced_path()
    if forced in ("quantized", "dequantize"):
        return forced == "dequantize"
    return tokens >= crossover(mode, bits, width)


def fused_first(tokens: int, mode: str, bits: int | None = None, width: int = 0) -> bool:
    """True when the fused kernel (kernels.quantized_matmul, where it runs) is the faster path
    for ``tokens`` rows through a weight of smaller dimension ``width`` quantized as (mode, bits)."""
    forced = forced_path()
    if forced != "auto":
        return forced == "fused"
    lo, hi = FUSED_TOKENS.get(table_name(width), {}).get(mode_name(mode, bits), (0, 0))
    return lo <= tokens < hi


def mlx_quantized_matmul_fails(in_dims: int, group_size: int) -> bool:
    """True where ``mx.quantized_matmul`` must not run: on CUDA, for a weight whose input width
    is no more than one group. Measured on the H200 with mlx 0.32.4 (thirtieth issue-16
    session, benchmarks/qmm_widths_probe.py; docs/benchmarks.md): for affine 4- and 8-bit
    weights with k <= group_size (k = 64, 128) and more than one row of x, it returned outputs
    that changed from call to call (NaN in some), in float32, bfloat16 and float16 alike, and
    at k = 128 it never returned; at one row, and for k > group_size, it agreed with dequantize
    + matmul. Read from MLX's source: those are the calls its Hopper kernel (qmm_sm90) takes.
    No ESMC weight is that narrow (960 wide and up); small test models and custom configs are.
    Every mode is kept off it: such a weight's dequantize costs next to nothing."""
    return backend() == "cuda" and in_dims <= group_size


def dequantized_weight(module: nn.Module, dtype: mx.Dtype) -> mx.array:
    """The float weight of a quantized linear or embedding (kernels.dequantize: MLX's own
    dequantize, or on CUDA a faster kernel with the same output)."""
    return kernels.dequantize(
        module["weight"],
        module["scales"],
        module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
        dtype=dtype,
    )


def token_count(x: mx.array) -> int:
    """Rows of ``x`` through a linear (every dim but the last): what the tables are keyed by."""
    return x.size // x.shape[-1] if x.shape[-1] else 0


class QuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` (same parameters, same files) that picks the faster matmul."""

    # The weight, transposed (``w.T``), dequantized with its block's others while
    # ``dequantized_together`` runs (set with object.__setattr__: an array set as a module
    # attribute would become a parameter).
    given_transposed: mx.array | None = None

    def policy(self, tokens: int) -> tuple[bool, bool]:
        """(fused, dequantize) for ``tokens`` rows through this layer: whether they lie in the
        fused kernel's window, and whether the tables send them by dequantize + matmul (the
        path outside the window, and inside it for a call the fused kernel cannot take; and
        always where MLX's quantized_matmul fails, whatever the tables or POLICY_ENV say)."""
        width = kernels.weight_width(self["weight"], self.bits)
        in_dims = kernels.dequantized_shape(self["weight"], self.bits)[-1]
        dequantize = dequantize_first(tokens, self.mode, self.bits, width)
        return (
            fused_first(tokens, self.mode, self.bits, width),
            dequantize or mlx_quantized_matmul_fails(in_dims, self.group_size),
        )

    def path(self, tokens: int, dtype: mx.Dtype = mx.bfloat16) -> str:
        """How ``tokens`` rows of ``dtype`` go through this layer: "fused" (kernels.quantized_matmul;
        a call it cannot take goes by ``table_path``), "cutlass", "dequantize" (+ matmul) or
        "quantized" (MLX's quantized_matmul)."""
        fused, dequantize = self.policy(tokens)
        table = self._outside_window(dequantize, tokens, dtype)
        if fused and not (table == "cutlass" and self.cutlass_over_fused(tokens)):
            return "fused"
        return table

    def table_path(self, tokens: int, dtype: mx.Dtype = mx.bfloat16) -> str:
        """The path outside the fused kernel's window: "quantized" below the tables' crossover,
        else "cutlass" where it takes the call, else "dequantize"."""
        return self._outside_window(self.policy(tokens)[1], tokens, dtype)

    def _outside_window(self, dequantize: bool, tokens: int, dtype: mx.Dtype) -> str:
        if not dequantize:
            return "quantized"
        return "cutlass" if dtype == mx.bfloat16 and self.takes_cutlass(tokens) else "dequantize"

    def takes_cutlass(self, tokens: int) -> bool:
        """True when this layer's dequantize + matmul calls of ``tokens`` rows go to CUTLASS's
        mixed-input GEMM instead, for bfloat16 inputs (cutlass_qmm: on a Hopper GPU, where it
        is built; up to CUTLASS_TOKENS)."""
        if backend() != "cuda" or not cutlass_qmm.enabled() or not cutlass_qmm.eligible(self):
            return False
        width = kernels.weight_width(self["weight"], self.bits)
        return cutlass_qmm.forced() or tokens <= CUTLASS_TOKENS[table_name(width)]

    def cutlass_over_fused(self, tokens: int) -> bool:
        """True when CUTLASS, where it takes this layer's calls of ``tokens`` rows, takes them
        from the fused kernel's window too, when the tables decide: from CUTLASS_OVER_FUSED's
        count on its table, where this weight's tiles fill enough of the SMs."""
        if forced_path() != "auto":
            return False
        width = kernels.weight_width(self["weight"], self.bits)
        fewest, fill = CUTLASS_OVER_FUSED.get(table_name(width), (math.inf, 0.0))
        rows, k = kernels.dequantized_shape(self["weight"], self.bits)
        return tokens >= fewest and cutlass_qmm.sm_fill(rows, tokens, k, cutlass_qmm.split_unit(self)) >= fill

    def takes_dequantize(self, tokens: int, dtype: mx.Dtype = mx.bfloat16) -> bool:
        """True when ``tokens`` rows of ``dtype`` through this layer go by dequantize + matmul
        (a call the fused kernel cannot take falls back in ``__call__`` and dequantizes its
        own weight)."""
        return self.path(tokens, dtype) == "dequantize"

    def added_to(
        self, residual: mx.array, x: mx.array, scale: float, norm: nn.Module
    ) -> tuple[mx.array, mx.array] | None:
        """``residual + self(x) / scale`` (ESMC's scaled residual add after a projection) and
        ``norm`` (an nn.LayerNorm) of it, from the kernel that sums CUTLASS's split-K slabs, where
        this call runs it (cutlass_qmm.adds_residual; the LayerNorm there too where
        cutlass_qmm.norms_in_sum): MLX's values bit for bit, without a launch of its own for the
        add or the LayerNorm. None for any other call: the caller adds."""
        tokens = token_count(x)
        if residual.dtype != x.dtype or self.path(tokens, x.dtype) != "cutlass":
            return None
        if not cutlass_qmm.adds_residual(self, tokens):
            return None
        return cutlass_qmm.matmul(self, x, tokens, residual, scale, norm)

    def __call__(self, x: mx.array) -> mx.array:
        tokens = token_count(x)
        chosen = self.path(tokens, x.dtype)
        packed = (self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode)
        if chosen == "fused":
            if kernels.quantized_matmul_supported(x, *packed):
                y = kernels.quantized_matmul(x, *packed)
                return y + self["bias"] if "bias" in self else y
            chosen = self.table_path(tokens, x.dtype)
        if chosen == "quantized":
            return super().__call__(x)
        if chosen == "cutlass":
            return cutlass_qmm.matmul(self, x, tokens)
        wt = self.given_transposed
        if wt is None or wt.dtype != x.dtype:
            wt = dequantized_weight(self, x.dtype).T
        return mx.addmm(self["bias"], x, wt) if "bias" in self else x @ wt


def transposed_views(values: mx.array, shapes: list[tuple]) -> list[mx.array]:
    """``w.T`` of each weight of ``shapes`` whose values lie in ``values`` (1-D) one weight after
    another, row-major: strided views, no copy (one graph node each)."""
    views, offset = [], 0
    for shape in shapes:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        views.append(mx.as_strided(values, shape[::-1], strides[::-1], offset))
        offset += math.prod(shape)
    return views


@contextlib.contextmanager
def dequantized_together(module: nn.Module, x: mx.array):
    """While it runs, ``module``'s quantized linears that take dequantize + matmul for the rows
    of ``x`` (``takes_dequantize``) use weights, in x's dtype, dequantized by one launch
    (``kernels.dequantize_together``) instead of one each: a block's four in one call, bit for
    bit the same values (the 300M's forward at 16x256 spends 0.32 ms of GPU time in them
    instead of 1.39; the kernel's section has the measurements), each layer's ``w.T`` a view
    of the call's one output. Those quantized alike go together; where the kernel does not
    run, each layer dequantizes its own as before."""
    if backend() != "cuda":  # the kernel runs on CUDA only; spare the uncompiled forwards the walk
        yield
        return
    tokens = token_count(x)
    linears = [
        m for _, m in module.named_modules() if isinstance(m, QuantizedLinear) and m.takes_dequantize(tokens, x.dtype)
    ]
    groups: dict[tuple, list[QuantizedLinear]] = {}
    for m in linears:
        groups.setdefault((m.mode, m.bits, m.group_size, m["scales"].dtype), []).append(m)
    given = []
    for (mode, bits, group_size, _), group in groups.items():
        packed = [(m["weight"], m["scales"], m.get("biases")) for m in group]
        values = kernels.dequantize_together(packed, group_size, bits, mode, x.dtype)
        if values is None:
            continue
        shapes = [kernels.dequantized_shape(w, bits) for w, _, _ in packed]
        for m, wt in zip(group, transposed_views(values, shapes), strict=True):
            object.__setattr__(m, "given_transposed", wt)
            given.append(m)
    try:
        yield
    finally:
        for m in given:
            object.__setattr__(m, "given_transposed", None)


def quantize_modules(model: nn.Module, record: dict, is_quantized) -> None:
    """Replace, in place, the layers the artifact holds quantized: linears by QuantizedLinear,
    the embedding (only with --quantize-head) by nn.QuantizedEmbedding.

    ``record`` is config.json's ``quantization`` (defaults + per-layer overrides, mlx-lm's
    convention); ``is_quantized(path)`` says whether the weights hold ``{path}.scales``. A
    layer is quantized when the record names it or its scales are present (mlx-lm's rule).
    """
    default = {k: record[k] for k in ("group_size", "bits")}
    default["mode"] = record.get("mode", "affine")

    def swap(path, module):
        params = record.get(path)
        if params is None and hasattr(module, "to_quantized") and is_quantized(path):
            params = default
        if not isinstance(params, dict):  # not quantized (or a non-layer key of the record)
            return module
        params = {"mode": "affine", **params}
        if isinstance(module, nn.Linear):
            return QuantizedLinear.from_linear(module, **params)  # lazy: the weights replace it
        return module.to_quantized(**params)

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)


def dequantize_model(model: nn.Module, dtype: mx.Dtype | None = None) -> nn.Module:
    """Replace every quantized layer by its float twin holding the dequantized weights
    (``dtype``: default the model's float dtype). Costs the float model's memory."""
    dtype = dtype or getattr(model, "dtype", mx.float32)
    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            out_dims, in_dims = kernels.dequantized_shape(m.weight, m.bits)
            layer = nn.Linear(in_dims, out_dims, bias="bias" in m)
            layer.weight = dequantized_weight(m, dtype)
            if "bias" in m:
                layer.bias = m.bias.astype(dtype)
            swaps.append((path, layer))
        elif isinstance(m, nn.QuantizedEmbedding):
            w = dequantized_weight(m, dtype)
            layer = nn.Embedding(*w.shape)
            layer.weight = w
            swaps.append((path, layer))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return model
