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

import math
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path, tree_unflatten

from . import kernels

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
    # tables, because the dequantize differs: "cuda" for weights of kernels.MIN_VALUES values
    # or more (this project's kernel; the 6B's, measured on the 6B), "cuda-small" for smaller
    # ones (mx.dequantize; measured on the 300M, all of whose weights are smaller). 32 is the
    # smallest count measured, except the 6B's mxfp4 at 16 (0.59 of quantized_matmul's time
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
# packed weight: no bf16 copy) replaces the table's path, per backend and mode: "cuda" for
# weights of kernels.MIN_VALUES values or more (the 6B's, but o_proj), "cuda-small" for smaller
# ones (the 300M's). Each window is the token counts at which whole forwards at B=1, every
# supported block weight through each path and the sides interleaved, had the fused kernel
# ahead of the path the tables give there (python -m benchmarks.crossover_forward --model 6B
# / 300M --sides bf16,quantized,dequantize,fused --tokens ...; docs/benchmarks.md, fifteenth
# issue-16 session; raw docs/bench/crossover_*_session15.json). Fused / that path, H200:
# - 6B affine4: 0.71-0.76 at 8-16 tokens (against quantized_matmul), 0.75-0.80 at 32-192,
#   0.81 and 0.97 at 256 (two runs); 0.95-1.14 at 320-384, 1.16-1.33 at 448-512.
# - 6B mxfp4: 0.61 at 8 (quantized_matmul), 0.76-0.80 at 16-128, 0.82 at 192, 0.82-0.91 at
#   256 (three runs); 1.06-1.36 at 320-512.
# - 6B affine8: behind quantized_matmul at 8-16 (1.08-1.10); 0.76-0.81 at 32-64, 0.80-0.88 at
#   128. From 129 tokens the "wg" tile (8 bits since the sixteenth session; before: "2d", 1.00
#   at 192 and 1.05-1.11 at 256): 0.88-0.90 at 192 and 0.89-0.91 at 256 in five of eight (run,
#   count) pairs, 1.07-1.10 in three (three machines); 1.38 at 320, 1.13 at 384 (one run). Fused is
#   GPU-bound there (22-25 ms), dequantize + matmul moves with the host (20-28 ms); in GPU time
#   (Nsight Compute, 4 layers at 1x256) fused is 1.24x dequantize + matmul.
# - 300M affine4: 0.78-0.98 at 32-256, 0.92-1.03 at 512, 0.94-0.95 at 1024, 1.24 at 2048;
#   mxfp4 0.84-0.97 at 32-512, 0.82 and 1.03 at 1024, 1.25 at 2048; affine8 (quantized_matmul
#   below 128 tokens, not timed against fused) 0.83-0.92 at 128-512, 1.02-1.03 at 1024. The
#   300M at B=1 is host-bound (MLX encodes its ops slower than the GPU runs them): one launch a
#   weight instead of a dequantize and a matmul is what it gains.
# Below 8 tokens (6B) and 32 (300M) not measured against quantized_matmul. Never splitting K
# (ESMC_MLX_QMM_WAVES=0: no split_sum launch) did not help the 300M: 0.92-1.31 of the split
# kernel's time at 64-2048 tokens (one run).
FUSED_TOKENS = {
    "cuda": {"affine4": (8, 257), "mxfp4": (8, 257), "affine8": (32, 257)},
    "cuda-small": {"affine4": (32, 1025), "mxfp4": (32, 1025), "affine8": (128, 513)},
}
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


def crossover(mode: str, bits: int | None = None, values: int = 0) -> float:
    """CROSSOVER_TOKENS' entry for a weight of ``values`` values quantized as (mode, bits)."""
    name = backend()
    if name == "cuda" and values < kernels.MIN_VALUES:
        name = "cuda-small"
    table = CROSSOVER_TOKENS[name]
    return table.get(mode_name(mode, bits), table.get(mode, math.inf))


def dequantize_first(tokens: int, mode: str, bits: int | None = None, values: int = 0) -> bool:
    """True when dequantize-then-matmul is the faster path for ``tokens`` rows through a weight
    of ``values`` values quantized as (mode, bits)."""
    forced = os.environ.get(POLICY_ENV, "auto").lower()
    if forced in ("quantized", "dequantize"):
        return forced == "dequantize"
    return tokens >= crossover(mode, bits, values)


def fused_first(tokens: int, mode: str, bits: int | None = None, values: int = 0) -> bool:
    """True when the fused kernel (kernels.quantized_matmul, where it runs) is the faster path
    for ``tokens`` rows through a weight of ``values`` values quantized as (mode, bits)."""
    forced = os.environ.get(POLICY_ENV, "auto").lower()
    if forced != "auto":
        return forced == "fused"
    name = backend()
    if name == "cuda" and values < kernels.MIN_VALUES:
        name = "cuda-small"
    lo, hi = FUSED_TOKENS.get(name, {}).get(mode_name(mode, bits), (0, 0))
    return lo <= tokens < hi


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


class QuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` (same parameters, same files) that picks the faster matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.size // x.shape[-1] if x.shape[-1] else 0
        values = self.weight.size * 32 // self.bits
        packed = (self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode)
        if fused_first(tokens, self.mode, self.bits, values) and kernels.quantized_matmul_supported(x, *packed):
            y = kernels.quantized_matmul(x, *packed)
            return y + self["bias"] if "bias" in self else y
        if not dequantize_first(tokens, self.mode, self.bits, values):
            return super().__call__(x)
        w = dequantized_weight(self, x.dtype).T
        return mx.addmm(self["bias"], x, w) if "bias" in self else x @ w


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
            out_dims, in_dims = m.weight.shape[0], m.weight.shape[1] * 32 // m.bits
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
