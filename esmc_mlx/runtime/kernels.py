"""Custom CUDA kernels for MLX's CUDA backend, each written to give the MLX ops it replaces
bit for bit: ``dequantize`` (below), ``qkv_heads`` (the attention's QK LayerNorm, RoPE and
head layout in one pass) and ``add_layer_norm`` (a residual add and the LayerNorm after it);
their docstrings have the details. ``quantized_matmul`` (a fused tensor-core matmul that
dequantizes the packed weight in registers, Marlin-style) gives dequantize's weight values
bit for bit and sums in fp32 in its own order (its section below). Elsewhere they are the MLX ops.
Each is an ``mx.fast.cuda_kernel`` whose compiled form runtime/kernel_cache.py keeps on disk
(MLX would compile it in every process).

A fast dequantize, bit for bit the same as ``mx.dequantize``.

MLX 0.32.4's CUDA dequantize gives every thread one packed byte (or 3/5 bytes) and reloads
the group's scale and bias per byte: on an H200 it reaches 400-750 GB/s of the card's 4.8 TB/s
on the 6B's weights (issue 16). Here a thread takes 8 values at a time (an octet: ``bits``
packed bytes, one aligned load where the address allows), their one scale (and bias: an octet
never straddles a group), and writes them with one 128-bit store from registers (two for
fp32), so that a warp reads 32 x bits consecutive bytes and writes 512 consecutive bytes. A
grid-stride loop over at most MAX_BLOCKS blocks. mxfp4 into bf16 builds the octet two values at
a time (the fused matmul's exact pair arithmetic; ``_BODIES`` has the measurement).

Measured on the H200 (``python -m benchmarks.dequant_kernels --models 6B,300M --against
OLD_kernels.py --max-blocks 1056,0 --skip-matmul``, bf16 out, each weight timed in batches of
20 calls, contenders interleaved; docs/bench/dequant_kernels_h200_octets.json): on the 6B's
weights of 8M values or more (13824x2560 fused gate/up, 6912x2560, 2560x6912, 7680x2560),
29.5-67.3 us, 1.08-3.15x less time than mx.dequantize and 1.08-1.65x less than this module's
previous kernel (32 values a thread), bit-exact for every mode, bit width and shape timed. That
is 860-1690 GB/s in those bursts, which also carry each call's 15-20 us of launch and
dispatch. Timed on the GPU alone (benchmarks.dequant_cost under Nsight Compute) it writes
the 6B's weights at 2.3-2.8 TB/s, in 1.05-1.5x the time MLX takes to fill the same bf16 array
with a constant, and the 300M's at 0.8-2.1 TB/s, in less time than that fill; 1.3-5.0x less
time than ``mx.dequantize``. It runs for the weights of models 1024 wide or wider
(``DEQUANTIZE_MIN_WIDTH`` has why), and ``dequantize_together`` runs its octets for a block's
weights, any width, in one launch. The grid cap changed nothing beyond the noise (1,056
blocks, 4,224, or one thread per octet).

The arithmetic is MLX's CUDA arithmetic (mlx/backend/cuda/quantized/affine_quantize.cu,
fp_quantize.cuh), written as the same expressions so the same compiler makes the same
instructions of them:
- affine: ``T(q) * scale + bias`` in the scales' dtype T (bf16/fp16 operators, or fp32),
  which the CUDA compiler contracts into one fused multiply-add (one rounding): the bf16/fp16
  operators emit ``mul.bf16``/``add.bf16`` PTX without a rounding mode, which ptxas may fuse,
  and does (checked with nvcc 13.0 for sm_90a: that expression assembles to the same machine
  code as ``__hfma``, not as ``__hmul_rn``+``__hadd_rn``; fp32 is ``fma.rn.f32`` in the PTX
  already). Then a cast to the output dtype (``mx.dequantize`` computes in the scales' dtype
  and casts with astype).
  MLX's CPU instead rounds after the multiply and again after the add (two ops), so CPU and
  CUDA differ by one rounding in ~12% of elements with bf16 scales (tests/test_kernels.py).
- mxfp4/mxfp8/nvfp4: ``float(scale) * float(value)`` in fp32 (exact: a power of two or an
  e4m3 times an fp4/fp8 value), one rounding to the output dtype. The e8m0 scale decodes as
  2^(e-127) (e = 0 gives 2^-127, e = 255 NaN), the e4m3 scale and fp8 values as OCP e4m3.
  nvfp4 with a ``global_scale`` goes to ``mx.dequantize`` (MLX divides it by 448*6 in fp32
  first; not worth a second kernel for a path the artifacts do not use).
Everything else (CPU, Metal, other group sizes, odd sizes, fp64) is ``mx.dequantize``.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from .kernel_cache import Kernel

# Blocks of the grid-stride loop: four waves of the H200's 132 SMs x 8 resident blocks of 256.
# Fewer, to leave SMs to GEMMs the dequantize might run beside, is slower: the 6B at 1x1024
# took 1.04-1.05x this grid's time with 132 blocks and 1.40-1.41x with 33 (mxfp4, affine8;
# benchmarks.min_values_ab --gate max-blocks, twenty-fifth issue-16 session): whatever overlap
# MLX's CUDA graph allows (a dequantize depends on no earlier node) does not hide its time.
MAX_BLOCKS = 132 * 8 * 4
# Below this many values of add_layer_norm's input MLX's own ops are as fast or faster (a
# custom kernel call carries 15-20 us of launch and dispatch): whole forwards with
# add_layer_norm at every size were 5-11% slower at 3.9M values or fewer per call (6B at 1x256,
# 1x1024; 300M up to 16x256) and 4-7% faster from 10M (6B 16x256, 64x512; 300M 64x512). The
# 300M's forward at 16x256 spends 1.35-1.40 ms of GPU time in it against 0.74 ms in MLX's
# LayerNorm and ~0.46 ms in its add (Nsight Compute, twenty-second issue-16 session).
MIN_VALUES = 8 << 20
# Weights whose smaller dimension (their model's hidden size) is under this go to
# mx.dequantize: the 300M's (960); the 600M's (1152) and the 6B's (2560) come here. Until the
# twenty-second issue-16 session the gate was MIN_VALUES (8M values: the 6B's weights but its
# o_proj), from bursts of calls that time the host's dispatch as much as the kernel. H200,
# bf16 out (python -m benchmarks.dequant_cost): on the GPU alone (Nsight Compute) this kernel
# takes 1.3-3.7x less time than mx.dequantize on every 300M weight (2.2-4.8 against 3.1-17.1
# us) and 2.7-5.0x less on the 6B's; but its host dispatch costs more: 12-15 us a call
# against 8-9 us in a compiled graph (27-33 against 9-11 us eager; the 300M's 120 weights;
# 10-12.5 against 9-10.5 compiled since the twenty-third session handed the kernel its arrays
# without reshapes). Inside a block, the weights that take dequantize + matmul go through
# dequantize_together below whatever their width; this gate decides for the rest.
# Whole forwards, every weight here against the 8M-values gate (benchmarks.min_values_ab, one
# process, logits identical; docs/benchmarks.md, twenty-second session):
# - 600M: 0.95 / 0.90 / 0.90 at 16x256 (affine4 / mxfp4 / affine8), affine8 0.87
#   at 1x2048;
# - 6B (its o_proj): 0.96-0.99 at 1x1024, 0.98-1.00 at 16x256;
# - 300M, host-bound (its kernels take 5.7-8.9 ms of GPU time in 8-11 ms forwards): 0.92-1.09
#   at 16x256 over two runs, affine8 1.11-1.14 at 2048 tokens (three rows), where the GPU time
#   it saves (0.8 ms of 6.5 at 1x2048) is hidden and the host time it adds is not.
DEQUANTIZE_MIN_WIDTH = 1024
THREADS_PER_BLOCK = 256
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}  # mode -> (bits, group)
FLOATS = (mx.bfloat16, mx.float16, mx.float32)

_HEADER = """
// The 8 values of one octet: BITS bytes of the little-endian bit stream, one aligned load
// when the address allows (BITS = 2, 4, 8), else byte loads.
template <int B>
__device__ __forceinline__ uint64_t load_octet(const uint8_t* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if constexpr (B == 8) {
    if ((a & 7) == 0) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      return uint64_t(v.x) | (uint64_t(v.y) << 32);
    }
  } else if constexpr (B == 4) {
    if ((a & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (B == 2) {
    if ((a & 1) == 0) return *reinterpret_cast<const uint16_t*>(p);
  }
  uint64_t v = 0;
#pragma unroll
  for (int k = 0; k < B; ++k) v |= uint64_t(p[k]) << (8 * k);
  return v;
}

__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t bits16(__half x) { return __half_as_ushort(x); }

// Store 8 outputs with 128-bit stores, from registers (out is a fresh, aligned buffer and
// every octet starts at a multiple of 8 values).
template <typename O>
__device__ __forceinline__ void store8(O* p, const O (&v)[8]) {
  if constexpr (sizeof(O) == 2) {
    *reinterpret_cast<uint4*>(p) = make_uint4(
        bits16(v[0]) | (bits16(v[1]) << 16), bits16(v[2]) | (bits16(v[3]) << 16),
        bits16(v[4]) | (bits16(v[5]) << 16), bits16(v[6]) | (bits16(v[7]) << 16));
  } else {
    reinterpret_cast<uint4*>(p)[0] = make_uint4(
        __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
    reinterpret_cast<uint4*>(p)[1] = make_uint4(
        __float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
  }
}

// Round through fp32 into the output dtype (exact when O == float or the value fits).
template <typename O, typename T>
__device__ __forceinline__ O to_out(T x) {
  if constexpr (cuda::std::is_same_v<O, T>) return x;
  else return static_cast<O>(static_cast<float>(x));
}

// OCP e4m3 (fp8 values, nvfp4 scales) to float, exact.
__device__ __forceinline__ float e4m3(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float mag;
  if (e == 0) mag = float(m) * 0.001953125f;  // m * 2^-9
  else if (e == 15 && m == 7) mag = __int_as_float(0x7fc00000);
  else mag = __int_as_float(int(((e + 120u) << 23) | (m << 20)));
  return (b & 0x80u) ? -mag : mag;
}

// e8m0 (mx scales) to float: 2^(e-127); 0 is 2^-127, 255 NaN.
__device__ __forceinline__ float e8m0(uint32_t e) {
  if (e == 255u) return __int_as_float(0x7fc00000);
  if (e == 0u) return __int_as_float(0x00400000);
  return __int_as_float(int(e << 23));
}

// e2m1 (fp4 values) to float, built from its bits (a table would sit in local memory).
__device__ __forceinline__ float e2m1(uint32_t b) {
  const uint32_t e = (b >> 1) & 3u, m = b & 1u;
  const float mag = e == 0 ? (m ? 0.5f : 0.0f) : __int_as_float(int(((e + 126u) << 23) | (m << 22)));
  return (b & 8u) ? -mag : mag;
}

// One octet of an affine weight: T(q) * scale + bias in the scales' dtype, then to O.
template <int BITS, typename T, typename O>
__device__ __forceinline__ void affine_octet(uint64_t q, T scale, T bias, O (&v)[8]) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const T r = static_cast<T>(static_cast<int>(uint32_t(q >> (i * BITS)) & MASK)) * scale + bias;
    v[i] = to_out<O>(r);
  }
}

// One octet of an mxfp4/mxfp8/nvfp4 weight: float(scale) * float(value), one rounding to O.
template <int BITS, int MX, typename O>
__device__ __forceinline__ void fp_octet(uint64_t q, uint8_t s, O (&v)[8]) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const float scale = MX ? e8m0(s) : e4m3(s) * 1.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t d = uint32_t(q >> (i * BITS)) & MASK;
    v[i] = static_cast<O>(scale * (BITS == 8 ? e4m3(d) : e2m1(d)));
  }
}

// PTX prmt in its default mode, written out because a selector nibble's msb matters here: it
// fills the result byte with bit 7 of the byte it picks. __byte_perm is documented to use only
// each nibble's low 3 bits.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

// Values 2p, 2p+1 of an mxfp4 octet in bf16: e2m1 exactly, by byte permutes from tables of its
// 8 magnitudes' bf16 bytes (low bytes 00 00 80 C0 00 40 80 C0, high bytes 00 3F 3F 3F 40 40 40
// 40), the sign bits moved in by prmt's sign-replicating selectors (a selector nibble's msb
// copies bit 7 of the byte it picks; q << 4 puts each low value's sign at bit 7), then times the
// e8m0 scale in bf16. 23 PTX instructions an octet where the shifts and masks took ~44; whole
// 6B forwards with every weight fused ran 0.98x (0.976-0.983) the shifts' time, bit for bit
// the same (benchmarks.kernels_ab both ways round; docs/experiments/prmt_emulation.py derives
// the selectors).
__device__ __forceinline__ void mxfp4_pairs_bf16(uint32_t q, uint32_t scale2, uint32_t* out) {
  const uint32_t m = q & 0x77777777u;  // magnitudes: selectors without their msb
  const uint32_t lo03 = __byte_perm(0xC0800000u, 0xC0804000u, m), hi03 = __byte_perm(0x3F3F3F00u, 0x40404040u, m);
  const uint32_t m47 = m >> 16;
  const uint32_t lo47 = __byte_perm(0xC0800000u, 0xC0804000u, m47), hi47 = __byte_perm(0x3F3F3F00u, 0x40404040u, m47);
  const uint32_t s = q << 4;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int a = 2 * (p & 1);  // the pair's first value among its four
    const uint32_t word = __byte_perm(p < 2 ? lo03 : lo47, p < 2 ? hi03 : hi47,
                                      a | ((4 + a) << 4) | ((a + 1) << 8) | ((5 + a) << 12));
    const uint32_t sign = prmt(s, q, ((8 | p) << 4) | ((12 | p) << 12)) & 0x80008000u;
    const uint32_t v = word | sign;
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                     *reinterpret_cast<const __nv_bfloat162*>(&scale2));
    out[p] = *reinterpret_cast<const uint32_t*>(&r);
  }
}

// e8m0 as a bf16 (exact: bf16 has fp32's exponent range; 0 is the subnormal 2^-127).
__device__ __forceinline__ uint32_t e8m0_bf16(uint32_t e) {
  const uint32_t b = e == 255u ? 0x7FC0u : e == 0u ? 0x0040u : (e << 7);
  return b | (b << 16);
}
"""

# The octet's 8 values (v), stored with one 128-bit store (two for fp32); or, for mxfp4 into
# bf16 ("fp_pairs"), the same values built two at a time with the fused matmul's pair
# arithmetic, bit for bit the same. H200, whole 6B forwards (python -m benchmarks.kernels_ab):
# mxfp4 0.952x the octet body's time at 1x256 and 0.964x at 1x1024 (16x256: 1.006x, noise),
# logits identical; with the pairs built by byte permutes (nineteenth issue-16 session) the
# dequantize's share of a 6B mxfp4 forward did not move (1.007-1.009x, within the A/B's
# bias). The same for 4-bit affine (affine4_pairs) gained nothing (0.997-1.001x)
# and ran 7-13% slower per weight, so affine keeps the octet body.
_BODIES = {
    "affine": """
    O v[8];
    affine_octet<BITS, T, O>(q, scales[g], biases[g], v);
    store8<O>(out + o * 8, v);
""",
    "fp": """
    O v[8];
    fp_octet<BITS, MX, O>(q, scales[g], v);
    store8<O>(out + o * 8, v);
""",
    "fp_pairs": """
    uint32_t v[4];
    mxfp4_pairs_bf16(uint32_t(q), e8m0_bf16(scales[g]), v);
    *reinterpret_cast<uint4*>(out + o * 8) = make_uint4(v[0], v[1], v[2], v[3]);
""",
}


def _body(mode: str, dtype) -> str:
    """The ``_BODIES`` entry for ``mode`` into ``dtype``: two values at a time for mxfp4 into bf16."""
    if mode == "affine":
        return "affine"
    return "fp_pairs" if mode == "mxfp4" and dtype == mx.bfloat16 else "fp"


# One weight's octets in the grid-stride loop: index i runs over every weight's octets, weight
# k's after weight k-1's (endk: where its octets end), and its values go to the one output at
# 8 * i. Each w is handed as MLX holds it (no reshape: each would be one more graph node to
# encode), so its size comes from its shape.
_WEIGHT_OCTETS = """\
    if (i < end%K) {  // weight %K
      const size_t o = i - end%J;
      const uint8_t* packed = reinterpret_cast<const uint8_t*>(w%K);
      const auto* scales = scales%K;
      const auto* biases = biases%K;
      auto* out = values + end%J * 8;  // the output holds every weight's values, in order
      const uint64_t q = load_octet<BITS>(packed + o * BITS);
      const size_t g = o * 8 / GROUP;  // an octet never straddles a group (groups: 16-128)
BODY
      continue;
    }
"""


def _source(n: int, affine: bool, body: str) -> str:
    """The grid-stride loop over the octets of ``n`` weights, each octet through
    ``_BODIES[body]`` (``n`` = 1: ``dequantize``; more: ``dequantize_together``). For one
    weight nvcc 13 (sm_90a) makes the same PTX of it as of the one-weight loop it replaced
    (twenty-fourth issue-16 session): the branch on ``end0`` is the loop's own condition."""
    ends = ", ".join(f"end{k} = 0" for k in range(n))
    source = f"  size_t end_ = 0, {ends};  // where each weight's octets end (end_: the first's start)\n"
    for k in range(n):
        source += f"  {{\n    size_t words = 1;\n    for (int d = 0; d < w{k}_ndim; ++d) words *= w{k}_shape[d];\n"
        source += f"    end{k} = end{k - 1 if k else '_'} + words * 4 / BITS;  // 8 values = BITS bytes\n  }}\n"
    source += "  const size_t step = size_t(gridDim.x) * blockDim.x;\n"
    source += f"  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end{n - 1}; i += step) {{\n"
    for k in range(n):
        part = _WEIGHT_OCTETS.replace("%K", str(k)).replace("%J", str(k - 1) if k else "_")
        if not affine:
            part = part.replace(f"      const auto* biases = biases{k};\n", "")
        source += part.replace("BODY", _BODIES[body])
    return source + "  }\n"


@functools.cache
def _kernel(n: int, mode: str, bits: int, group_size: int, body: str) -> Kernel:
    """The kernel that dequantizes ``n`` weights of one (mode, bits, group size) through one
    ``_BODIES`` entry (inputs w0, scales0[, biases0], w1, ...; one output, values: each
    weight's values after the last one's); dtypes are template arguments."""
    affine = mode == "affine"
    names = ["w", "scales", "biases"] if affine else ["w", "scales"]
    return Kernel(
        name=f"esmc_dequantize{n}_{mode}_{bits}_{group_size}" + ("_pairs" if body == "fp_pairs" else ""),
        input_names=[f"{name}{k}" for k in range(n) for name in names],
        output_names=["values"],
        source=_source(n, affine, body),
        header=_HEADER,
    )


def weight_width(w: mx.array, bits: int) -> int:
    """A packed weight's smaller dimension, its rows or its unpacked columns: for a block
    weight, its model's hidden size (what DEQUANTIZE_MIN_WIDTH and quantized.SMALL_WIDTH gate)."""
    return min(w.shape[-2], w.shape[-1] * 32 // bits)


def dequantized_shape(w: mx.array, bits: int) -> tuple:
    """The shape of packed weight ``w`` unpacked: its last dimension times 32 / ``bits``."""
    return (*w.shape[:-1], w.shape[-1] * 32 // bits)


def on_cuda() -> bool:
    """True when MLX's default device is a CUDA GPU: where every kernel here can run."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supported(w, scales, biases, group_size: int, bits: int, mode: str, dtype, global_scale=None) -> bool:
    """True when the CUDA kernel handles this call (and the default device is a CUDA GPU)."""
    if not on_cuda():
        return False
    if w.dtype != mx.uint32 or w.ndim < 2 or dtype not in FLOATS or w.size * 4 % bits:  # whole octets
        return False
    if mode == "affine":
        return (
            bits in AFFINE_BITS
            and group_size in AFFINE_GROUPS
            and biases is not None
            and scales.dtype in FLOATS
            and biases.dtype == scales.dtype
            and scales.shape == biases.shape
            and scales.size * group_size == w.size * 32 // bits
        )
    return (
        FP_MODES.get(mode) == (bits, group_size)
        and global_scale is None
        and scales.dtype == mx.uint8
        and scales.size * group_size == w.size * 32 // bits
    )


def dequantize(
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    dtype: mx.Dtype | None = None,
    global_scale: mx.array | None = None,
) -> mx.array:
    """``mx.dequantize`` with the same arguments and the same output, bit for bit; on a CUDA
    GPU the custom kernel above does the work."""
    defaults = FP_MODES.get(mode, (4, 64))  # mx.dequantize's defaults per mode
    bits = bits or defaults[0]
    group_size = group_size or defaults[1]
    if dtype is None:
        dtype = scales.dtype if mode == "affine" else mx.bfloat16
    small = weight_width(w, bits) < DEQUANTIZE_MIN_WIDTH
    if small or not supported(w, scales, biases, group_size, bits, mode, dtype, global_scale):
        return mx.dequantize(
            w,
            scales,
            biases,
            group_size=group_size,
            bits=bits,
            mode=mode,
            dtype=dtype,
            **({} if global_scale is None else {"global_scale": global_scale}),
        )
    kernel = _kernel(1, mode, bits, group_size, _body(mode, dtype))
    return _launch(kernel, [(w, scales, biases)], group_size, bits, mode, dtype, dequantized_shape(w, bits))


def _scales_template(mode: str, scales_dtype: mx.Dtype) -> tuple:
    """The template argument that tells a kernel its scales' format: their dtype T (affine), or
    MX (1: e8m0 scales, mxfp4/mxfp8; 0: e4m3, nvfp4)."""
    return ("T", scales_dtype) if mode == "affine" else ("MX", int(mode != "nvfp4"))


def _launch(
    kernel: Kernel, weights: list[tuple], group_size: int, bits: int, mode: str, dtype: mx.Dtype, shape=None
) -> mx.array:
    """One launch of ``kernel`` (``_kernel``'s, for ``len(weights)``) over the octets of
    ``weights`` (w, scales, biases), handed as MLX holds them: no reshape, each would be one
    more graph node to encode. Its one output, of ``dtype`` and ``shape`` (default flat), holds
    every weight's values, one weight after another."""
    inputs = [a for w, s, b in weights for a in ((w, s, b) if mode == "affine" else (w, s))]
    template = [("O", dtype), ("BITS", bits), ("GROUP", group_size), _scales_template(mode, weights[0][1].dtype)]
    octets = sum(w.size * 4 // bits for w, _, _ in weights)
    threads = min(-(-octets // THREADS_PER_BLOCK), MAX_BLOCKS) * THREADS_PER_BLOCK
    return kernel(
        inputs=inputs,
        template=template,
        grid=(threads, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[shape or (octets * 8,)],
        output_dtypes=[dtype],
    )[0]


# ---- several weights in one launch ----------------------------------------------------------
#
# A block of ESMC has four weight matmuls (fused q/k/v, o, fused gate/up, down); at token counts
# where each takes dequantize + matmul, their four dequantizes are one launch
# (quantized.dequantized_together): the octets of the four weights in one grid-stride loop, each
# octet written by the same body as ``dequantize``'s. H200, twenty-third issue-16 session
# (docs/benchmarks.md):
# - GPU time, the 300M's affine8 forward at 16x256 (Nsight Compute, benchmarks.host_overhead
#   --profile): its dequantizes 0.32 ms in 30 launches against 1.39 ms in 120 mx.dequantize
#   calls, all its kernels 7.76 against 8.83 ms (the bf16 forward's: 7.55);
# - host time, the 300M's 120 weights (benchmarks.dequant_cost, compiled): 0.85-1.04 ms to
#   encode and launch in 30 calls against 1.06-1.25 ms in 120 mx.dequantize calls. A call's
#   arrays cost MLX more than the call itself, so four calls in one save little host time
#   (twenty-fourth session, benchmarks.dequant_cost --call-arrays: 9-12 us a call, 0.8 an input,
#   3.7-4.1 an output; one output sliced into the four weights costs the same, a slice being
#   one more array too);
# - whole forwards, together / one by one (benchmarks.min_values_ab --gate together, logits
#   identical): 300M 16x256 0.98 / 1.00 / 1.00 and 0.98 / 0.94 / 0.98 in two runs (affine4 /
#   affine8 / mxfp4), 600M 16x256 0.99 / 0.99 / 0.98, 6B 1x1024 1.01 / - / 1.00 and 16x256
#   - / 1.00 / - (GPU-bound; its weights took this project's kernel one by one before).
# - one output a block, not one a weight (twenty-sixth session): each layer multiplies by a
#   strided view of it (quantized.transposed_views: one node a weight where an output and a
#   transpose were two). Host time of a block's dequantize and four matmuls, 30 blocks
#   compiled (benchmarks.dequant_cost --call-arrays, two processes): 126.3 / 140.4 us against
#   136.8 / 153.2. Whole forwards, one output / four (min_values_ab on the branch
#   experiment/dequant-views, both ways round, seven processes; logits identical): 300M affine8
#   1x1024 0.93-0.99, 16x256 0.94-1.01 (every mode); 600M 0.97-1.00; 6B 1.00-1.02 (GPU-bound).
# Fewest weights of a block that go in one launch (4 + 1: never).
TOGETHER_MIN_WEIGHTS = 2


def dequantize_together(
    weights: list[tuple[mx.array, mx.array, mx.array | None]],
    group_size: int,
    bits: int,
    mode: str,
    dtype: mx.Dtype,
) -> mx.array | None:
    """The (w, scales, biases) of ``weights``, all quantized alike, dequantized into ``dtype``
    by one kernel launch into one flat output, each weight's values after the last one's: each
    bit for bit ``mx.dequantize``'s, flattened (``dequantize``'s octet bodies). One output, not
    one a weight: each costs MLX's host as much as a graph node does, and the layers take views
    of it (``quantized.transposed_views``). None where it does not run (not a CUDA GPU, fewer
    than TOGETHER_MIN_WEIGHTS, a weight ``supported`` refuses, the scales' dtypes differ): then
    each weight is dequantized on its own."""
    if len(weights) < max(TOGETHER_MIN_WEIGHTS, 1) or len({s.dtype for _, s, _ in weights}) != 1:
        return None
    if not all(supported(w, s, b, group_size, bits, mode, dtype) for w, s, b in weights):
        return None
    kernel = _kernel(len(weights), mode, bits, group_size, _body(mode, dtype))
    return _launch(kernel, weights, group_size, bits, mode, dtype)


# ---- quantized matmul, Marlin-style: packed weight dequantized into tensor-core fragments ----
#
# Issue 16's B=1 gap: every quantized weight is written out as a bf16 copy and read back by
# cuBLAS. This kernel reads the packed weight itself. Design (after Frantar et al. 2024,
# "MARLIN", written here from the paper's ideas, no code taken):
# - mma.sync m16n8k16 with the weight rows as A (16 rows) and the tokens as B (8 tokens),
#   fp32 sums; each of 8 warps owns 16 weight rows and all BT tokens of its block, so a weight
#   value is dequantized once per block, in registers, straight into the A fragments (no bf16
#   tile in shared memory, no barrier between dequantize and math).
# - K is read in steps of 64 columns; a thread's 16 values of a row in a step are its two
#   octets 2t, 2t+1 (t = lane % 4): the k order inside a step is permuted (the same permutation
#   for x), so those 16 values are exactly what the thread's A fragments need for the step's
#   four k16 slices, and its x values are 32 contiguous bytes (two 16-byte shared loads per 8
#   tokens, XOR-swizzled so that a warp's loads hit distinct banks). No repacking of the weight.
# - x and the packed weight arrive by 16-byte cp.async, STAGES steps in flight; the scales by
#   plain loads into registers one step ahead (each thread needs one group per row per step).
# - a block: 128 weight rows x BT (16..128) tokens; K split (fp32 slabs, summed in a fixed
#   order by split_sum: deterministic) until the grid fills the SMs at B=1.
# - the dequantized values are dequantize's, bit for bit: the same octet functions
#   (affine_octet, fp_octet), or (FAST) the same arithmetic on pairs: affine 4-bit with the
#   scales in x's dtype builds q exactly (magic-number exponent), then one fma per value
#   (__hfma2, the fma the scalar expression is contracted into); mxfp4 into bf16 builds e2m1
#   exactly (bf16 bits times 2^126, exact) and multiplies by the e8m0 scale in bf16 (exact
#   wherever the fp32 product is, as bf16 has fp32's exponent range).
# - two warp tiles: "1d" (_QMM_SOURCE, above) and the two-dimensional ones (_QMM2_SOURCE,
#   QMM_TILES): a warp 16 * MI weight rows x BT / WN tokens, so each A fragment feeds BT / WN / 8
#   mma and each x fragment MI x 4; same k order, swizzle, pipeline, scales and octet code.

QMM_BW = 128  # weight rows (output columns) a block computes: 8 warps x 16
QMM_BK = 64  # weight columns a pipeline step loads
QMM_STAGES = 4  # steps in flight (cp.async)
QMM_THREADS = 256
QMM_FLOATS = (mx.bfloat16, mx.float16)  # what the tensor-core instruction takes
QMM_BITS = (4, 8)  # whole octets of 4 / 8 bytes: 16-byte aligned rows of a step
QMM_SMS = 132  # the H200's multiprocessors

_QMM_HEADER = """
// A thread's two octets of a step in two weight rows ``row_b`` bytes apart (rows a and b of its
// A fragments), from shared memory: one 8-byte (4 bits) or 16-byte (8 bits) load a row, as
// words; step_octet puts octet o of a row together.
template <int BITS>
__device__ __forceinline__ void load_step_octets(
    const uint8_t* wt, int row_b, uint32_t (&qa)[2 * BITS / 4], uint32_t (&qb)[2 * BITS / 4]) {
  if constexpr (BITS == 4) {
    const uint2 ua = *reinterpret_cast<const uint2*>(wt), ub = *reinterpret_cast<const uint2*>(wt + row_b);
    qa[0] = ua.x; qa[1] = ua.y; qb[0] = ub.x; qb[1] = ub.y;
  } else {
    const uint4 ua = *reinterpret_cast<const uint4*>(wt), ub = *reinterpret_cast<const uint4*>(wt + row_b);
    qa[0] = ua.x; qa[1] = ua.y; qa[2] = ua.z; qa[3] = ua.w;
    qb[0] = ub.x; qb[1] = ub.y; qb[2] = ub.z; qb[3] = ub.w;
  }
}

template <int BITS>
__device__ __forceinline__ uint64_t step_octet(const uint32_t (&q)[2 * BITS / 4], int o) {
  return BITS == 4 ? uint64_t(q[o]) : (uint64_t(q[2 * o]) | (uint64_t(q[2 * o + 1]) << 32));
}

// 16 (or, src_bytes = 0, zero) bytes from global memory to the shared-memory address dst,
// asynchronously; and 4 bytes.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\\n" ::"n"(N)); }

// d += a (16x16, row-major) @ b (16x8, column-major), fp32 accumulators.
template <typename O>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (cuda::std::is_same_v<O, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <typename O>
__device__ __forceinline__ uint32_t pack2(O lo, O hi) { return bits16(lo) | (bits16(hi) << 16); }

// Values 2p, 2p+1 (p = 0..3) of a 4-bit affine octet, as a pair of O, with O == T:
// O(q) exactly (the bits of 128 + q in bf16, 1024 + q in fp16, minus that constant), then
// q * scale + bias as one fma: affine_octet's arithmetic, two values at a time.
template <typename O>
__device__ __forceinline__ void affine4_pairs(uint32_t q, uint32_t scale2, uint32_t bias2, uint32_t* out) {
  constexpr uint32_t MAGIC = cuda::std::is_same_v<O, __nv_bfloat16> ? 0x43004300u : 0x64006400u;
  const uint32_t q4 = q >> 4;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    // byte p of q (values 2p, 2p + 1) and of q >> 4 into bytes 0 and 2, masked to the two
    // nibbles: one prmt where shifts and masks took four (6B forwards, fused: 0.986-0.999x)
    const uint32_t word = (__byte_perm(q, q4, p | ((4 + p) << 8)) & 0x000F000Fu) | MAGIC;
    if constexpr (cuda::std::is_same_v<O, __nv_bfloat16>) {
      const __nv_bfloat162 v = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&word),
                                       *reinterpret_cast<const __nv_bfloat162*>(&MAGIC));
      const __nv_bfloat162 r = __hfma2(v, *reinterpret_cast<const __nv_bfloat162*>(&scale2),
                                       *reinterpret_cast<const __nv_bfloat162*>(&bias2));
      out[p] = *reinterpret_cast<const uint32_t*>(&r);
    } else {
      const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&word), *reinterpret_cast<const __half2*>(&MAGIC));
      const __half2 r = __hfma2(v, *reinterpret_cast<const __half2*>(&scale2), *reinterpret_cast<const __half2*>(&bias2));
      out[p] = *reinterpret_cast<const uint32_t*>(&r);
    }
  }
}
"""

# What the fused kernels share: the indices, the async copies of a step (x, swizzled; the packed
# weight), and the store of y (fp32 slabs when K is split) from the fp32 tile in shared memory.
_QMM_SETUP = """\
  const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * BW, m0 = blockIdx.y * BT;
  const int steps = K / BK, per = (steps + gridDim.z - 1) / gridDim.z;
  const int s0 = blockIdx.z * per, s1 = min(steps, s0 + per);
  const size_t row_bytes = size_t(K) * BITS / 8;
  const uint8_t* packed = reinterpret_cast<const uint8_t*>(w);
  const bool x16 = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  const bool w16 = (reinterpret_cast<uintptr_t>(packed) & 15) == 0;

  // The copies of a step. x's chunk c = tid + THREADS * i is token row r = tid / 8 + XROWS * i,
  // 16-byte chunk j = tid % 8 of the step's 64 columns, stored at j ^ (r & 7) (the swizzle): the
  // same j ^ (r & 7) for every i, as XROWS is a multiple of 8, so a step adds only its k0 and
  // stage to a destination computed once. The sources: in a tile whose rows are all x's (every
  // tile but a call's last), chunk i is i * XROWS rows past chunk 0, whose address a thread
  // keeps in shared memory (xbase) and loads once a step. Kept in registers (an array of
  // XCHUNKS pointers, eighteenth issue-16 session), ptxas rematerialized every address from
  // threadIdx in each step: ~117 instructions a step for the wg tile's 8 copies (mxfp4), ~45
  // now (nvcc 13.0, nvdisasm of the sm_90a cubin; the step's dequantize and MMAs are ~215).
  // Whole 6B forwards with every supported weight fused, against the register array
  // (benchmarks.kernels_ab both ways round, twentieth issue-16 session; logits identical):
  // 0.95-0.98x at 1x256, 0.89-0.90x at 1x512, 0.86-0.88x at 1x1024. A tile with rows past M
  // (zero-filled) clamps each chunk's row as before. The weight's chunk c: row c / (WB / 16),
  // byte 16 * (c % (WB / 16)).
  constexpr int XROWS = THREADS / 8, XCHUNKS = (BT + XROWS - 1) / XROWS;
  constexpr int WCHUNK = BW * WB / 16, WCHUNKS = (WCHUNK + THREADS - 1) / THREADS;
  const int xr = tid >> 3, xj = tid & 7;
  const uint32_t xdst = static_cast<uint32_t>(__cvta_generic_to_shared(xs + xr * BK + ((xj ^ (xr & 7)) << 3)));
  const uint32_t wdst = static_cast<uint32_t>(__cvta_generic_to_shared(ws + 16 * tid));
  const O* xsrc = x + size_t(min(m0 + xr, M - 1)) * K + xj * 8;  // chunk 0's row, clamped
  const size_t xstride = size_t(XROWS) * K;  // chunk i's row is i * XROWS rows past chunk 0's
  const int xrows = M - m0 - xr;  // chunk i is a row of x (else zero-filled) when XROWS * i < xrows
  __shared__ const O* xbase[THREADS];
  xbase[tid] = xsrc;
  const uint8_t* wsrc[WCHUNKS];
#pragma unroll
  for (int i = 0; i < WCHUNKS; ++i) {
    const int c = tid + THREADS * i;
    wsrc[i] = packed + size_t(min(n0 + c / (WB / 16), N - 1)) * row_bytes + (c % (WB / 16)) * 16;
  }

  auto issue = [&](int s, int stage) {
    const int k0 = s * BK;
    if (x16 && m0 + BT <= M) {  // every row of the tile is x's (uniform)
      const O* src = xbase[tid] + k0;
#pragma unroll
      for (int i = 0; i < XCHUNKS; ++i) {
        if (XCHUNKS * XROWS <= BT || xr + XROWS * i < BT)
          cp_async16(xdst + (stage * XSTAGE + XROWS * i * BK) * sizeof(O), src, 16);
        src += xstride;
      }
    } else if (x16) {
      const O* src = xsrc + k0;
#pragma unroll
      for (int i = 0; i < XCHUNKS; ++i) {
        if (XCHUNKS * XROWS <= BT || xr + XROWS * i < BT) {
          const bool ok = XROWS * i < xrows;
          cp_async16(xdst + (stage * XSTAGE + XROWS * i * BK) * sizeof(O), ok ? src + i * xstride : src, ok ? 16 : 0);
        }
      }
    } else {
      O* xd = xs + stage * XSTAGE;
      for (int c = tid; c < BT * 8; c += THREADS) {
        const int r = c >> 3, j = c & 7, m = m0 + r;
        O* dst = xd + r * BK + ((j ^ (r & 7)) << 3);
        const O* src = x + size_t(min(m, M - 1)) * K + k0 + j * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) dst[i] = m < M ? src[i] : O(0.0f);
      }
    }
#pragma unroll
    for (int i = 0; i < WCHUNKS; ++i) {
      if (WCHUNKS * THREADS <= WCHUNK || tid + THREADS * i < WCHUNK) {
        const uint8_t* src = wsrc[i] + size_t(k0) * BITS / 8;
        const uint32_t dst = wdst + stage * WSTAGE + 16 * THREADS * i;
        if (w16) {
          cp_async16(dst, src, 16);
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) cp_async4(dst + 4 * q, src + 4 * q);
        }
      }
    }
  };

"""

_QMM_STORE = """\
  if constexpr (SPLIT) {
    float* out = reinterpret_cast<float*>(y) + size_t(blockIdx.z) * M * N;
    for (int c = tid; c < BT * BW / 4; c += THREADS) {
      const int r = c / (BW / 4), col = (c % (BW / 4)) * 4;
      if (m0 + r < M && n0 + col < N)
        *reinterpret_cast<float4*>(out + size_t(m0 + r) * N + n0 + col) = *reinterpret_cast<const float4*>(cs + r * CS + col);
    }
  } else {
    for (int c = tid; c < BT * BW / 8; c += THREADS) {
      const int r = c / (BW / 8), col = (c % (BW / 8)) * 8;
      if (m0 + r < M && n0 + col < N) {
        const float* v = cs + r * CS + col;
        *reinterpret_cast<uint4*>(y + size_t(m0 + r) * N + n0 + col) = make_uint4(
            pack2(O(v[0]), O(v[1])), pack2(O(v[2]), O(v[3])), pack2(O(v[4]), O(v[5])), pack2(O(v[6]), O(v[7])));
      }
    }
  }
"""

_QMM_SOURCE = (
    """
  // y (M x N) = x (M x K) @ dequantize(w).T; a block: 128 weight rows (8 warps x 16) x BT
  // tokens x the steps s0..s1 of 64 columns of K (blockIdx.z: one split of K; SPLIT: y holds
  // fp32 partial sums, one M x N slab per split).
  constexpr int BK = 64, STAGES = 4, THREADS = 256, BW = 128;
  constexpr int NT = BT / 8;  // n8 tiles of tokens (each warp computes all of them)
  constexpr int WB = BK * BITS / 8;  // packed bytes of a weight row in a step
  constexpr int XSTAGE = BT * BK;  // values of x in a stage
  constexpr int WSTAGE = BW * WB;  // packed bytes of w in a stage
  extern __shared__ __align__(16) uint8_t smem[];
  O* xs = reinterpret_cast<O*>(smem);  // STAGES x BT rows x 64 values, 16-byte chunks swizzled
  uint8_t* ws = smem + STAGES * XSTAGE * sizeof(O);  // STAGES x 128 rows x WB bytes

"""
    + _QMM_SETUP
    + """  // This thread's weight rows (within the block: warp * 16 + g and + 8) and their groups.
  const int wr = warp * 16 + g;
  const size_t ga = size_t(min(n0 + wr, N - 1)) * (K / GROUP), gb = size_t(min(n0 + wr + 8, N - 1)) * (K / GROUP);
  SCALE_REGS
  auto load_scales = [&](int s, Sc& d) {
    const int gi = (s * BK + 16 * t) / GROUP;  // the thread's 16 values of a step: one group
    LOAD_SCALES
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;

#pragma unroll
  for (int p = 0; p < STAGES - 1; ++p) {
    if (s0 + p < s1) issue(s0 + p, p);
    cp_async_commit();
  }
  Sc cur;
  if (s0 < s1) load_scales(s0, cur);

  int stage = 0;
  for (int s = s0; s < s1; ++s) {
    cp_async_wait<STAGES - 2>();  // step s has landed (this thread's copies)
    __syncthreads();  // ... everyone's; step s - 1's buffers are free
    {
      const int sn = s + STAGES - 1;
      if (sn < s1) issue(sn, stage == 0 ? STAGES - 1 : stage - 1);
      cp_async_commit();
    }
    Sc nxt;
    if (s + 1 < s1) load_scales(s + 1, nxt);

    // Dequantize the thread's 2 rows x 16 values into A-fragment pairs: pa[p] = values 2p, 2p+1.
    const uint8_t* wt = ws + stage * WSTAGE + wr * WB + t * 2 * BITS;
    uint32_t qa[2 * BITS / 4], qb[2 * BITS / 4];  // the two octets of each row
    load_step_octets<BITS>(wt, 8 * WB, qa, qb);
    uint32_t pa[8], pb[8];
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      const uint64_t oa = step_octet<BITS>(qa, o), ob = step_octet<BITS>(qb, o);
      DEQUANT
    }

    const O* xt = xs + stage * XSTAGE;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int r = j * 8 + g;
      const uint4 lo = *reinterpret_cast<const uint4*>(xt + r * BK + (((2 * t) ^ g) << 3));
      const uint4 hi = *reinterpret_cast<const uint4*>(xt + r * BK + (((2 * t + 1) ^ g) << 3));
      const uint32_t bw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int k4 = 0; k4 < 4; ++k4) {
        const uint32_t a[4] = {pa[2 * k4], pb[2 * k4], pa[2 * k4 + 1], pb[2 * k4 + 1]};
        mma_16816<O>(acc[j], a, bw[2 * k4], bw[2 * k4 + 1]);
      }
    }
    cur = nxt;
    stage = stage == STAGES - 1 ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  __syncthreads();

  // Through shared memory (fp32, BT x (128 + 4)), then coalesced rows of y.
  constexpr int CS = BW + 4;
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int r = j * 8 + 2 * t;
    cs[r * CS + wr] = acc[j][0];
    cs[(r + 1) * CS + wr] = acc[j][1];
    cs[r * CS + wr + 8] = acc[j][2];
    cs[(r + 1) * CS + wr + 8] = acc[j][3];
  }
  __syncthreads();
"""
    + _QMM_STORE
)

_QMM_DEQUANT = {
    # (scale registers, their loads for group gi of rows a / b, the octet o's dequantize)
    "affine": (
        "struct Sc { T sa, ba, sb, bb; };",
        "d.sa = scales[ga + gi]; d.ba = biases[ga + gi]; d.sb = scales[gb + gi]; d.bb = biases[gb + gi];",
        """{
        O va[8], vb[8];
        affine_octet<BITS, T, O>(oa, cur.sa, cur.ba, va);
        affine_octet<BITS, T, O>(ob, cur.sb, cur.bb, vb);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          pa[4 * o + p] = pack2(va[2 * p], va[2 * p + 1]);
          pb[4 * o + p] = pack2(vb[2 * p], vb[2 * p + 1]);
        }
      }""",
    ),
    "affine_fast": (  # BITS == 4, T == O
        "struct Sc { uint32_t sa, ba, sb, bb; };",
        "d.sa = bits16(scales[ga + gi]) * 0x10001u; d.ba = bits16(biases[ga + gi]) * 0x10001u;\n"
        "    d.sb = bits16(scales[gb + gi]) * 0x10001u; d.bb = bits16(biases[gb + gi]) * 0x10001u;",
        "affine4_pairs<O>(uint32_t(oa), cur.sa, cur.ba, pa + 4 * o);\n"
        "      affine4_pairs<O>(uint32_t(ob), cur.sb, cur.bb, pb + 4 * o);",
    ),
    "fp": (
        "struct Sc { uint8_t sa, sb; };",
        "d.sa = scales[ga + gi]; d.sb = scales[gb + gi];",
        """{
        O va[8], vb[8];
        fp_octet<BITS, MX, O>(oa, cur.sa, va);
        fp_octet<BITS, MX, O>(ob, cur.sb, vb);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          pa[4 * o + p] = pack2(va[2 * p], va[2 * p + 1]);
          pb[4 * o + p] = pack2(vb[2 * p], vb[2 * p + 1]);
        }
      }""",
    ),
    "fp_fast": (  # mxfp4 into bf16
        "struct Sc { uint32_t sa, sb; };",
        "d.sa = e8m0_bf16(scales[ga + gi]); d.sb = e8m0_bf16(scales[gb + gi]);",
        "mxfp4_pairs_bf16(uint32_t(oa), cur.sa, pa + 4 * o);\n      mxfp4_pairs_bf16(uint32_t(ob), cur.sb, pb + 4 * o);",
    ),
}


_QMM2_SOURCE = (
    """
  // The two-dimensional warp tile. y (M x N) = x (M x K) @ dequantize(w).T; a block: BW weight
  // rows x BT tokens x the steps s0..s1 of 64 columns of K. The 8 warps are WMW (along the
  // weight rows) x WN (along the tokens); a warp owns MI m16 tiles of weight rows (16 * MI
  // rows) and BT / WN tokens (NJ n8 tiles): each A fragment (dequantized weight, registers)
  // feeds NJ mma.sync and each x fragment (two swizzled 16-byte shared loads) MI x 4.
  constexpr int BK = 64, STAGES = 4, THREADS = 256;
  constexpr int WMW = 8 / WN;  // warps along the weight rows
  constexpr int BW = WMW * 16 * MI;  // weight rows of a block
  constexpr int TW = BT / WN;  // tokens of a warp
  constexpr int NJ = TW / 8;  // n8 tiles of a warp
  constexpr int WB = BK * BITS / 8;  // packed bytes of a weight row in a step
  constexpr int XSTAGE = BT * BK;  // values of x in a stage
  constexpr int WSTAGE = BW * WB;  // packed bytes of w in a stage
  extern __shared__ __align__(16) uint8_t smem[];
  O* xs = reinterpret_cast<O*>(smem);  // STAGES x BT rows x 64 values, 16-byte chunks swizzled
  uint8_t* ws = smem + STAGES * XSTAGE * sizeof(O);  // STAGES x BW rows x WB bytes

"""
    + _QMM_SETUP
    + """  const int wm = warp % WMW, wn = warp / WMW;
  // This thread's weight rows (within the block: wm * 16 * MI + 16 * i + g and + 8), their groups.
  const int wr0 = wm * 16 * MI + g;
  SCALE_REGS
  auto load_scales = [&](int s, Sc& d, size_t ga, size_t gb) {
    const int gi = (s * BK + 16 * t) / GROUP;  // the thread's 16 values of a step: one group
    LOAD_SCALES
  };
  size_t gra[MI], grb[MI];
#pragma unroll
  for (int i = 0; i < MI; ++i) {
    gra[i] = size_t(min(n0 + wr0 + 16 * i, N - 1)) * (K / GROUP);
    grb[i] = size_t(min(n0 + wr0 + 16 * i + 8, N - 1)) * (K / GROUP);
  }

  float acc[MI][NJ][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

#pragma unroll
  for (int p = 0; p < STAGES - 1; ++p) {
    if (s0 + p < s1) issue(s0 + p, p);
    cp_async_commit();
  }
  Sc cur_[MI];
  if (s0 < s1) {
#pragma unroll
    for (int i = 0; i < MI; ++i) load_scales(s0, cur_[i], gra[i], grb[i]);
  }

  int stage = 0;
  for (int s = s0; s < s1; ++s) {
    cp_async_wait<STAGES - 2>();  // step s has landed (this thread's copies)
    __syncthreads();  // ... everyone's; step s - 1's buffers are free
    {
      const int sn = s + STAGES - 1;
      if (sn < s1) issue(sn, stage == 0 ? STAGES - 1 : stage - 1);
      cp_async_commit();
    }
    Sc nxt_[MI];
    if (s + 1 < s1) {
#pragma unroll
      for (int i = 0; i < MI; ++i) load_scales(s + 1, nxt_[i], gra[i], grb[i]);
    }

    // Dequantize the thread's 2 * MI rows x 16 values into A-fragment pairs.
    uint32_t pas[MI][8], pbs[MI][8];
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const uint8_t* wt = ws + stage * WSTAGE + (wr0 + 16 * i) * WB + t * 2 * BITS;
      uint32_t qa[2 * BITS / 4], qb[2 * BITS / 4];  // the two octets of each row
      load_step_octets<BITS>(wt, 8 * WB, qa, qb);
      const Sc& cur = cur_[i];
      uint32_t* pa = pas[i];
      uint32_t* pb = pbs[i];
#pragma unroll
      for (int o = 0; o < 2; ++o) {
        const uint64_t oa = step_octet<BITS>(qa, o), ob = step_octet<BITS>(qb, o);
        DEQUANT
      }
    }

    const O* xt = xs + stage * XSTAGE;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int r = wn * TW + j * 8 + g;
      const uint4 lo = *reinterpret_cast<const uint4*>(xt + r * BK + (((2 * t) ^ g) << 3));
      const uint4 hi = *reinterpret_cast<const uint4*>(xt + r * BK + (((2 * t + 1) ^ g) << 3));
      const uint32_t bw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int k4 = 0; k4 < 4; ++k4)
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          const uint32_t a[4] = {pas[i][2 * k4], pbs[i][2 * k4], pas[i][2 * k4 + 1], pbs[i][2 * k4 + 1]};
          mma_16816<O>(acc[i][j], a, bw[2 * k4], bw[2 * k4 + 1]);
        }
    }
#pragma unroll
    for (int i = 0; i < MI; ++i) cur_[i] = nxt_[i];
    stage = stage == STAGES - 1 ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  __syncthreads();

  // Through shared memory (fp32, BT x (BW + 4)), then coalesced rows of y.
  constexpr int CS = BW + 4;
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int r = wn * TW + j * 8 + 2 * t, c = wr0 + 16 * i;
      cs[r * CS + c] = acc[i][j][0];
      cs[(r + 1) * CS + c] = acc[i][j][1];
      cs[r * CS + c + 8] = acc[i][j][2];
      cs[(r + 1) * CS + c + 8] = acc[i][j][3];
    }
  __syncthreads();
"""
    + _QMM_STORE
)


def _qmm_source(variant: str, source: str) -> str:
    regs, load, octet = _QMM_DEQUANT[variant]
    return source.replace("SCALE_REGS", regs).replace("LOAD_SCALES", load).replace("DEQUANT", octet)


def _qmm_shared_bytes(bt: int, bits: int) -> int:
    stages = QMM_STAGES * (bt * QMM_BK * 2 + QMM_BW * QMM_BK * bits // 8)
    return max(stages, bt * (QMM_BW + 4) * 4)


def _fused_kernel(name: str, variant: str, source: str, header: str, shared_memory: int) -> Kernel:
    """A fused quantized matmul kernel: x, the packed weight, its scales (and biases) -> y."""
    affine = variant.startswith("affine")
    return Kernel(
        name=name,
        input_names=["x", "w", "scales", "biases"] if affine else ["x", "w", "scales"],
        output_names=["y"],
        source=_qmm_source(variant, source),
        header=header,
        shared_memory=shared_memory,
    )


@functools.cache
def _qmm_kernel(variant: str, bits: int, group_size: int, bt: int) -> Kernel:
    name = f"esmc_qmm_{variant}_{bits}_{group_size}_{bt}"
    return _fused_kernel(name, variant, _QMM_SOURCE, _HEADER + _QMM_HEADER, _qmm_shared_bytes(bt, bits))


# The two-dimensional warp tiles: name -> (BT tokens, MI m16 tiles of a warp, WN warps along
# the tokens); a block is (8 / WN) * 16 * MI weight rows x BT tokens, a warp 16 * MI rows x
# BT / WN tokens.
QMM_TILES = {
    "2d": (64, 2, 1),  # 256 rows x 64 tokens, warps 8 x 1 of 32 rows x 64 tokens
    "2d128": (128, 2, 2),  # 128 rows x 128 tokens, warps 4 x 2 of 32 x 64
    "2d64w": (64, 4, 2),  # 256 rows x 64 tokens, warps 4 x 2 of 64 x 32
    "2d32": (32, 2, 1),  # 256 rows x 32 tokens, warps 8 x 1 of 32 x 32
}
# Resident blocks of a tile on an SM, from its registers (nvcc 13.0 for sm_90, no spills):
# "2d" 160-180 a thread, "2d128" 160-180, "2d64w" 196-250, "2d32" 121-147 (nvfp4's 147: one
# block then; "2d32" runs only when forced).
QMM_TILE_RESIDENT = {"2d": 1, "2d128": 1, "2d64w": 1, "2d32": 2}
# From this many tokens the default tile is "2d"; below it the one-dimensional tile. H200, per
# weight (benchmarks.fused_qmm_ab2, eleventh issue-16 session, second round), "2d" against "1d" on the 6B's
# four block shapes: affine4 0.88-1.02x at 256 tokens and 0.78-0.90x at 1024, mxfp4 1.01-1.06x
# at 256 and 0.97-1.04x at 1024; both 1.0-1.23x at 16-64 tokens. On 7680x2560, "2d128" was
# within 3% of "2d" at 256 tokens and 5% slower at 1024; "2d32" was slower at both.
QMM_2D_FROM = 65
QMM_TILE_ENV = "ESMC_MLX_QMM_TILE"  # 1d | 2d | 2d128 | 2d64w | 2d32 | wg: forces a tile (A/B runs)
# The waves of resident blocks that K is split to fill (qmm_plan), when the caller gives none;
# 0 never splits (one launch a call, no split_sum: A/B runs).
QMM_WAVES_ENV = "ESMC_MLX_QMM_WAVES"


def _qmm2_bw(tile: str) -> int:
    bt, mi, wn = QMM_TILES[tile]
    return (8 // wn) * 16 * mi


def _qmm2_shared_bytes(tile: str, bits: int) -> int:
    bt, bw = QMM_TILES[tile][0], _qmm2_bw(tile)
    stages = QMM_STAGES * (bt * QMM_BK * 2 + bw * QMM_BK * bits // 8)
    return max(stages, bt * (bw + 4) * 4)


@functools.cache
def _qmm2_kernel(variant: str, bits: int, group_size: int, tile: str) -> Kernel:
    name = f"esmc_qmm2_{variant}_{bits}_{group_size}_{tile}"
    return _fused_kernel(name, variant, _QMM2_SOURCE, _HEADER + _QMM_HEADER, _qmm2_shared_bytes(tile, bits))


# Hopper's warpgroup MMA with the dequantized weight as the register A operand (the "wg" tile).
def _wgmma_header(n: int) -> str:
    """wgmma_rs<n, O>: d (64 weight rows x n tokens, fp32, a warpgroup) += a (64 x 16, the
    dequantized weight, registers: each warp's 16 rows in mma.sync's A layout) @ the 16 x N
    x tile that ``desc`` points at (K-major, 128-byte swizzle), for O bf16 and fp16. Generated:
    the instruction takes each accumulator as its own operand."""
    out = [
        '__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory"); }',
        '__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory"); }',
        "template <int N>",
        '__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\\n" ::"n"(N) : "memory"); }',
        "// cp.async's (generic proxy) writes to shared memory, made visible to wgmma (async proxy).",
        '__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory"); }',
        "// A K-major, 128-byte-swizzled shared-memory operand: rows of 64 values (128 bytes), 8-row",
        "// groups 1024 bytes apart; addr must sit in a 1024-aligned swizzle atom (plus 32 * k16).",
        "__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr) {",
        "  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);",
        "}",
        "__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }",
        "// The two bytes sel picks from each word pair of q (x, y then z, w), in one word: a lane's",
        "// bytes of 16 packed bytes in mma's k order.",
        "__device__ __forceinline__ uint32_t wg_gather(uint4 q, uint32_t sel) {",
        "  return __byte_perm(__byte_perm(q.x, q.y, sel), __byte_perm(q.z, q.w, sel), 0x5410);",
        "}",
        "// An 8-bit octet in mma's k order from a k16 slice pair (lo, hi): bytes 2t, 2t + 1, 2t + 8,",
        "// 2t + 9 of each (sel picks 2t, 2t + 1 of a word pair).",
        "__device__ __forceinline__ uint64_t wg_octet8(uint4 lo, uint4 hi, uint32_t sel) {",
        "  return uint64_t(wg_gather(lo, sel)) | (uint64_t(wg_gather(hi, sel)) << 32);",
        "}",
        "template <int N, typename O>",
        "__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);",
    ]
    regs = n // 2
    dl = ", ".join(f"%{i}" for i in range(regs))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    for o, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16")):
        out += [
            "template <>",
            f"__device__ __forceinline__ void wgmma_rs<{n}, {o}>(float (&d)[{regs}], const uint32_t (&a)[4], uint64_t desc) {{",
            f'  asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} "',
            f'               "{{{dl}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, 1, 1, 1, 0;\\n"',
            f"               : {cons}",
            '               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));',
            "}",
        ]
    return "\n".join(out) + "\n"


_QMM_WG_SOURCE = (
    """
  // Hopper's warpgroup MMA. y (M x N) = x (M x K) @ dequantize(w).T; a block: 2 warpgroups x 64
  // weight rows (128) x BT tokens x the steps s0..s1 of 64 columns of K. Each warp dequantizes
  // its 16 rows into registers in mma.sync's A layout, in K's own order (wgmma reads x from
  // shared memory in that order): lane t needs columns 2t, 2t + 1, 2t + 8, 2t + 9 of each k16
  // slice, gathered into two octets, one for each half of the step (the k16 slices 0-1 and
  // 2-3; a group of 32 values or more covers a half). At 4 bits those are bytes t, t + 4, ...,
  // t + 28 of the row's 32; at 8 bits the byte pairs 2t, 2t + 8 of each 16 of the row's 64.
  // x arrives by cp.async in the 128-byte-swizzled K-major layout wgmma reads (the 1d tile's
  // swizzle, on a 1024-byte-aligned base).
  constexpr int BK = 64, STAGES = 4, THREADS = 256, BW = 128;
  constexpr int WB = BK * BITS / 8;  // packed bytes of a weight row in a step (32 or 64)
  constexpr int XSTAGE = BT * BK;  // values of x in a stage
  constexpr int WSTAGE = BW * WB;  // packed bytes of w in a stage
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (static_cast<unsigned>(__cvta_generic_to_shared(smem_raw)) & 1023u)) & 1023u);
  O* xs = reinterpret_cast<O*>(smem);  // STAGES x BT rows x 64 values (BT * 128 bytes: whole atoms)
  uint8_t* ws = smem + STAGES * XSTAGE * sizeof(O);  // STAGES x BW rows x WB bytes

"""
    + _QMM_SETUP
    + """  // This thread's weight rows (within the block: warp * 16 + g and + 8) and their groups.
  const int wr = warp * 16 + g;
  const size_t ga = size_t(min(n0 + wr, N - 1)) * (K / GROUP), gb = size_t(min(n0 + wr + 8, N - 1)) * (K / GROUP);
  SCALE_REGS
  auto load_scales = [&](int s, Sc (&dd)[2]) {
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      const int gi = (s * BK + 32 * o) / GROUP;  // half o of the step: one group
      Sc& d = dd[o];
      LOAD_SCALES
    }
  };

  float acc[BT / 2];
#pragma unroll
  for (int j = 0; j < BT / 2; ++j) acc[j] = 0.0f;

  // A step: the weight's half-steps dequantized into pa / pb, then the four k16 MMAs issued
  // (asynchronous) and committed as one group.
  // Lane t's octet of a half step: at 4 bits, byte t of each word of the half's 16 bytes; at 8
  // bits, bytes 2t, 2t + 1 of each 8 of its 32 (columns 2t, 2t + 1, 2t + 8, 2t + 9 of each k16).
  const uint32_t sel = uint32_t(BITS == 4 ? t : 2 * t) | (uint32_t(BITS == 4 ? t + 4 : 2 * t + 1) << 4);
  Sc cur_[2];
  auto mma_step = [&](int stage, uint32_t (&pa)[8], uint32_t (&pb)[8]) {
    const uint8_t* wt = ws + stage * WSTAGE + wr * WB;
    const uint4 a0 = *reinterpret_cast<const uint4*>(wt), a1 = *reinterpret_cast<const uint4*>(wt + 16);
    const uint4 b0 = *reinterpret_cast<const uint4*>(wt + 8 * WB), b1 = *reinterpret_cast<const uint4*>(wt + 8 * WB + 16);
    uint4 a2, a3, b2, b3;  // 8 bits: the step's second half
    if constexpr (BITS == 8) {
      a2 = *reinterpret_cast<const uint4*>(wt + 32), a3 = *reinterpret_cast<const uint4*>(wt + 48);
      b2 = *reinterpret_cast<const uint4*>(wt + 8 * WB + 32), b3 = *reinterpret_cast<const uint4*>(wt + 8 * WB + 48);
    }
    const uint32_t xa = smem_u32(xs + stage * XSTAGE);
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      uint64_t oa, ob;
      if constexpr (BITS == 4) {
        oa = wg_gather(o == 0 ? a0 : a1, sel);
        ob = wg_gather(o == 0 ? b0 : b1, sel);
      } else {
        oa = wg_octet8(o == 0 ? a0 : a2, o == 0 ? a1 : a3, sel);
        ob = wg_octet8(o == 0 ? b0 : b2, o == 0 ? b1 : b3, sel);
      }
      const Sc& cur = cur_[o];
      DEQUANT
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k4 = 2 * o + h;
        const uint32_t a[4] = {pa[2 * k4], pb[2 * k4], pa[2 * k4 + 1], pb[2 * k4 + 1]};
        wgmma_rs<BT, O>(acc, a, wgmma_desc(xa + 32 * k4));
      }
    }
    wgmma_commit();
  };
  if (s0 < s1) load_scales(s0, cur_);

  // Step s's dequantize runs while step s - 1's MMAs do (two register sets): copies run
  // STAGES - 2 steps ahead, into the buffers of step s - 2, whose MMAs are waited for first.
#pragma unroll
  for (int p = 0; p < STAGES - 2; ++p) {
    if (s0 + p < s1) issue(s0 + p, p);
    cp_async_commit();
  }
  uint32_t pa0[8], pb0[8], pa1[8], pb1[8];
  auto step = [&](int s, uint32_t (&pa)[8], uint32_t (&pb)[8]) {
    const int stage = (s - s0) % STAGES;  // the prologue put step s0 in buffer 0
    cp_async_wait<STAGES - 3>();  // step s has landed (this thread's copies)
    fence_proxy_async();
    wgmma_wait<1>();  // step s - 2's MMAs are done (s - 1's may run)
    __syncthreads();  // everyone's copies of step s landed; step s - 2's buffers are free
    {
      const int sn = s + STAGES - 2;
      if (sn < s1) issue(sn, (sn - s0) % STAGES);
      cp_async_commit();
    }
    Sc nxt_[2];
    if (s + 1 < s1) load_scales(s + 1, nxt_);
    mma_step(stage, pa, pb);
#pragma unroll
    for (int o = 0; o < 2; ++o) cur_[o] = nxt_[o];
  };
  // The odd last step runs after the loop: no path then rewrites a register set that MMAs in
  // flight may read, so ptxas keeps them in flight (with that step inside the loop it warned
  // C7513 and waited for each wgmma: 0.84-0.97x the time per weight once removed).
  if (s0 < s1) {
    int s = s0;
    for (; s + 1 < s1; s += 2) {
      step(s, pa0, pb0);
      step(s + 1, pa1, pb1);
    }
    if (s < s1) step(s, pa0, pb0);
    wgmma_wait<0>();
  }
  cp_async_wait<0>();
  __syncthreads();

  // Through shared memory (fp32, BT x (BW + 4)), then coalesced rows of y. acc[4j + c]: weight
  // row wr (+ 8 for c >= 2), token 8j + 2t (+ 1 for odd c).
  constexpr int CS = BW + 4;
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < BT / 8; ++j) {
    const int r = 8 * j + 2 * t;
    cs[r * CS + wr] = acc[4 * j];
    cs[(r + 1) * CS + wr] = acc[4 * j + 1];
    cs[r * CS + wr + 8] = acc[4 * j + 2];
    cs[(r + 1) * CS + wr + 8] = acc[4 * j + 3];
  }
  __syncthreads();
"""
    + _QMM_STORE
)

# Hopper's tile (sm_90a; kernel_cache and MLX compile for it), for 4- and 8-bit weights with
# groups of 32 or more: a block 128 weight rows (two warpgroups of 64) x QMM_WG_TOKENS tokens, 4
# stages of buffers. At 256 tokens (since the seventeenth issue-16 session; 128 before): 189-202
# registers a thread (nvcc 13, no spills) and 145-161 KB of shared memory, so one block an SM
# (test_warpgroup_tile_fits_its_resident_blocks), each weight value dequantized once per 256
# tokens instead of twice and each wgmma m64n256k16. Against the 128-token tile (two blocks an
# SM, 118-127 registers) on the H200: per weight (benchmarks.fused_qmm_ab2 --tiles) 0.87-0.98x
# at 256 tokens and 0.87-1.01x at 1024 (6B shapes, affine4 / mxfp4; 15 of 16 ahead); whole
# forwards with every supported weight fused (benchmarks.crossover_forward --sides
# fused_wg,...; two machines) 6B 0.95-0.99x at 160-1024 tokens (15 of 15 rows), 300M
# 0.96-1.00x at 256-1024 (8 of 9 ahead, one level). One warpgroup a block (64 rows x 256
# tokens, 3 stages, two blocks an SM) took 1.10-1.22x the 128-token tile's time in 6B forwards
# at 256 and 1024 tokens, 64 x 128 (two or three blocks an SM) 1.13-1.36x: both dropped.
# Measured against the other tiles on the H200 (benchmarks.fused_qmm_ab2 --tiles, twelfth
# issue-16 session, 128 tokens): 0.65-0.74x the "2d" tile's time at 1024 tokens (195-250
# TFLOP/s on the 6B's large weights), 0.71-1.07x at 256; its variants then (64 tokens; no
# overlap of the dequantize with the MMAs; 6 or 8 stages; 4 warpgroups) were as fast or slower.
# Its MMAs are pipelined (the odd last step after the loop, so ptxas does not serialize the
# wgmma: warning C7513): 204-214 registers then (nvcc 13.0), one block an SM as before.
# Against the serialized form on the H200 (eighteenth issue-16 session): per weight
# (benchmarks.fused_qmm_ab2 --tiles) 0.84-0.97x at 256 and 1024 tokens (16 of 16 ahead; 6B
# shapes, affine4 / mxfp4); 6B forwards with every supported weight fused
# (benchmarks.crossover_forward) 0.85-0.94x at 512-1024 tokens, 0.95-1.03x at 160-256; 300M
# 0.95-1.08x at 256-1024 (host-bound). On the 128-token tile (two blocks an SM) the same
# change cost the second block and ran 1.07-1.19x per weight (fourteenth issue-16 session).
QMM_WG_TILE = "wg"
QMM_WG_TOKENS = 256
QMM_WG_RESIDENT = 1
# From this many tokens the default tile is "wg" (where it runs: 4- and 8-bit, groups of 32 or
# more; else "2d"). Whole 6B forwards on the H200 at 128 tokens: "2d" ahead for affine4 (23.5 against
# 25.1 ms), "wg" for mxfp4 (19.3 against 21.0); at 256 "wg" ahead for both (affine4 25.5
# against 27.5, mxfp4 22.1 against 28.0).
QMM_WG_FROM = 129
# 8-bit weights take "wg" by default only from this many values (the 6B's; the 300M's are all
# smaller). Whole forwards at B=1 on the H200, affine8, "wg" / "2d" time (benchmarks.
# crossover_forward --sides fused_2d,fused, sixteenth issue-16 session): 6B 0.99 at 128 tokens
# (both "2d" then), 0.84 at 192, 0.77 at 256, 0.71-0.73 at 320-384 (one run); 300M 0.99-1.02 at
# 160-192, 1.01-1.04 at 256, 1.04-1.05 at 384, 1.02-1.04 at 512 (four runs, two machines).
QMM_WG_8BIT_VALUES = MIN_VALUES


def _qmm_wg_shared_bytes(bits: int) -> int:
    # the 1d tile's buffers at QMM_WG_TOKENS (the same 128 weight rows) + the swizzle's alignment
    return _qmm_shared_bytes(QMM_WG_TOKENS, bits) + 1024


def _qmm_wg_header() -> str:
    return _HEADER + _QMM_HEADER + _wgmma_header(QMM_WG_TOKENS)


@functools.cache
def _qmm_wg_kernel(variant: str, bits: int, group_size: int) -> Kernel:
    name = f"esmc_qmmwg_{variant}_{bits}_{group_size}"
    return _fused_kernel(name, variant, _QMM_WG_SOURCE, _qmm_wg_header(), _qmm_wg_shared_bytes(bits))


def qmm_tile(rows: int, tile: str | None = None, bits: int = 4, values: int = MIN_VALUES) -> str:
    """The warp tile for ``rows`` tokens through a weight of ``values`` values at ``bits`` bits:
    ``tile``, else ESMC_MLX_QMM_TILE, else "1d" (a warp 16 weight rows x all tokens) below
    QMM_2D_FROM tokens, "2d" from there and "wg" (Hopper's warpgroup MMA) from QMM_WG_FROM, for
    8-bit weights only from MIN_VALUES values (QMM_WG_8BIT_VALUES)."""
    wg = rows >= QMM_WG_FROM and (bits != 8 or values >= QMM_WG_8BIT_VALUES)
    default = QMM_WG_TILE if wg else "2d" if rows >= QMM_2D_FROM else "1d"
    tile = tile or os.environ.get(QMM_TILE_ENV, "") or default
    if tile != "1d" and tile != QMM_WG_TILE and tile not in QMM_TILES:
        raise ValueError(f"{QMM_TILE_ENV}: {tile!r} is not 1d or one of {', '.join([QMM_WG_TILE, *QMM_TILES])}")
    return tile


def qmm_waves() -> float:
    """The split rule's waves: ESMC_MLX_QMM_WAVES (a number >= 0), else 1."""
    raw = os.environ.get(QMM_WAVES_ENV, "")
    try:
        waves = float(raw) if raw else 1.0
    except ValueError:
        waves = math.nan
    if not 0 <= waves < math.inf:
        raise ValueError(f"{QMM_WAVES_ENV}: {raw!r} is not a number >= 0")
    return waves


def wg_tile_supported(bits: int, group_size: int) -> bool:
    """The warpgroup tile takes 4- and 8-bit weights whose groups cover half a 64-column step."""
    return bits in QMM_BITS and group_size >= 32


def qmm2_plan(rows: int, n: int, k: int, tile: str, waves: float = 1.0) -> int:
    """Splits of K for a two-dimensional or warpgroup tile, by qmm_plan's rule."""
    if tile == QMM_WG_TILE:
        bt, bw, resident = QMM_WG_TOKENS, QMM_BW, QMM_WG_RESIDENT
    else:
        bt, bw, resident = QMM_TILES[tile][0], _qmm2_bw(tile), QMM_TILE_RESIDENT[tile]
    tiles = -(-n // bw) * -(-rows // bt)
    target = int(waves * QMM_SMS * resident)
    steps = k // QMM_BK
    splits = max(1, min(target // tiles, steps // 4)) if 2 * tiles <= target else 1
    per = -(-steps // splits)
    return -(-steps // per)


def quantized_matmul_supported(x, w, scales, biases, group_size: int, bits: int, mode: str) -> bool:
    """True when ``quantized_matmul`` runs the fused kernel for this call: x in bf16 or fp16, a
    2-D weight of 4 or 8 bits, K a multiple of 64, N of 8."""
    k = x.shape[-1] if x.ndim else 0
    return (
        x.dtype in QMM_FLOATS
        and bits in QMM_BITS
        and w.ndim == 2
        and k % QMM_BK == 0
        and k > 0
        and x.size > 0
        and w.shape[1] * 32 // bits == k
        and w.shape[0] % 8 == 0
        and group_size >= 16
        and supported(w, scales, biases, group_size, bits, mode, x.dtype)
    )


# Blocks of each token tile an SM holds at once (registers: 46-66 / 56-84 / 98-118 / 142-152 a
# thread with nvcc 13.0 for sm_90; shared memory: 25-49 / 82 KB at 4 bits).
QMM_RESIDENT = {16: 3, 32: 3, 64: 2, 128: 1}


def qmm_plan(rows: int, n: int, k: int, waves: float = 1.0, bt: int | None = None) -> tuple[int, int]:
    """(BT, splits of K) for ``rows`` tokens through an n x k weight: token tiles of 16-128
    (the smallest that holds them); when the tiles fill less than half of ``waves`` waves of
    resident blocks, K is split (fp32 slabs) up to that, each split keeping at least 4 steps
    of 64 columns, none empty."""
    bt = bt or (16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128)
    tiles = -(-n // QMM_BW) * -(-rows // bt)
    target = int(waves * QMM_SMS * QMM_RESIDENT[bt])
    steps = k // QMM_BK
    splits = max(1, min(target // tiles, steps // 4)) if 2 * tiles <= target else 1
    per = -(-steps // splits)
    return bt, -(-steps // per)


def _qmm_variant(mode: str, bits: int, x_dtype, scales_dtype, fast: bool) -> str:
    if mode == "affine":
        return "affine_fast" if fast and bits == 4 and scales_dtype == x_dtype else "affine"
    return "fp_fast" if fast and mode == "mxfp4" and x_dtype == mx.bfloat16 else "fp"


def quantized_matmul(
    x,
    w,
    scales,
    biases=None,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    waves: float | None = None,
    bt: int | None = None,
    fast: bool = True,
    tile: str | None = None,
):
    """``x @ dequantize(w, ...).T`` without writing the float weight out: each weight value is
    what ``dequantize`` gives, bit for bit; the products are summed in fp32 on tensor cores (in
    another order than cuBLAS, so results differ from dequantize + matmul by fp32 rounding).
    Callers check ``quantized_matmul_supported`` first. ``tile`` picks the warp tile ("1d", or
    one of QMM_TILES; default ``qmm_tile``'s rule); ``bt`` forces the one-dimensional tile with
    that many tokens a block."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    if waves is None:
        waves = qmm_waves()
    tile = qmm_tile(rows, tile if bt is None else "1d", bits, n * k)
    if tile == QMM_WG_TILE and not wg_tile_supported(bits, group_size):
        tile = "2d" if rows >= QMM_2D_FROM else "1d"
    variant = _qmm_variant(mode, bits, x.dtype, scales.dtype, fast)
    if tile == QMM_WG_TILE:
        bt, splits = QMM_WG_TOKENS, qmm2_plan(rows, n, k, tile, waves)
        kernel, bw, extra = _qmm_wg_kernel(variant, bits, group_size), QMM_BW, []
    elif tile == "1d":
        bt, splits = qmm_plan(rows, n, k, waves, bt)
        kernel, bw, extra = _qmm_kernel(variant, bits, group_size, bt), QMM_BW, []
    else:
        bt, mi, wn = QMM_TILES[tile]
        splits = qmm2_plan(rows, n, k, tile, waves)
        kernel, bw, extra = _qmm2_kernel(variant, bits, group_size, tile), _qmm2_bw(tile), [("MI", mi), ("WN", wn)]
    inputs = [x.reshape(rows, k), w, scales.reshape(n, -1)]
    template = [("O", x.dtype), ("BITS", bits), ("GROUP", group_size), ("BT", bt), ("SPLIT", splits > 1), *extra]
    template.append(_scales_template(mode, scales.dtype))
    if mode == "affine":
        inputs.append(biases.reshape(n, -1))
    (y,) = kernel(
        inputs=inputs,
        template=template,
        grid=(-(-n // bw) * QMM_THREADS, -(-rows // bt), splits),
        threadgroup=(QMM_THREADS, 1, 1),
        output_shapes=[(splits, rows, n) if splits > 1 else (rows, n)],
        output_dtypes=[mx.float32 if splits > 1 else x.dtype],
    )
    if splits > 1:
        y = split_sum(y, x.dtype)
    return y.reshape(*x.shape[:-1], n)


# The fused matmul's split-K partials (S x M x N fp32) summed over S, in slab order, and rounded
# once to the output dtype: what y.sum(axis=0).astype(O) gives (bit for bit for two slabs; the
# 6B's logits came out identical at 64-256 tokens), in one launch instead of MLX's reduce and
# cast (two launches and an M x N fp32 intermediate). Whole 6B forwards on the H200 against
# the reduce and cast (benchmarks.kernels_ab, two runs, fourteenth issue-16 session): affine4
# 0.93-0.96x at 1x64, 0.96x at 1x128, 0.96-0.98x at 1x256; mxfp4 0.92-0.94x at 1x64, 0.96x at
# 1x128 (its 1x256 runs no fused matmul: 1.04-1.07x with the same code on both sides).
# Splitting K across a thread-block cluster instead, the tiles summed in distributed shared
# memory, is not open to mx.fast.cuda_kernel: a compile-time cluster shape put on MLX's
# declaration gave wrong outputs once MLX updated its cached CUDA graphs in place (branch
# experiment/qmm-cluster-splitk).
_SPLIT_SUM_SOURCE = """
  const size_t n8 = size_t(parts_shape[1]) / 8, i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  const float4* p = reinterpret_cast<const float4*>(parts) + 2 * i;
  float4 lo = p[0], hi = p[1];
  for (int s = 1; s < parts_shape[0]; ++s) {
    const float4 a = p[2 * n8 * s], b = p[2 * n8 * s + 1];
    lo = make_float4(lo.x + a.x, lo.y + a.y, lo.z + a.z, lo.w + a.w);
    hi = make_float4(hi.x + b.x, hi.y + b.y, hi.z + b.z, hi.w + b.w);
  }
  const O v[8] = {O(lo.x), O(lo.y), O(lo.z), O(lo.w), O(hi.x), O(hi.y), O(hi.z), O(hi.w)};
  store8<O>(y + 8 * i, v);
"""


@functools.cache
def _split_sum_kernel() -> Kernel:
    return Kernel(
        name="esmc_split_sum", input_names=["parts"], output_names=["y"], source=_SPLIT_SUM_SOURCE, header=_HEADER
    )


def split_sum(parts: mx.array, dtype: mx.Dtype) -> mx.array:
    """``parts.sum(axis=0).astype(dtype)`` for fp32 partials (S, M, N), N a multiple of 8."""
    s, m, n = parts.shape
    (y,) = _split_sum_kernel()(
        inputs=[parts.reshape(s, m * n)],
        template=[("O", dtype)],
        grid=(-(-m * n // 8 // THREADS_PER_BLOCK) * THREADS_PER_BLOCK, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )
    return y


# ---- row kernels: one block per token row, MLX's layer_norm layout --------------------------

QKV_HEAD_DIM = 64
GRID_X_THREADS = 2**31 - 1  # the most threads along a grid's x axis (an int32)
MAX_THREADS = 1024  # per block

# Shared by the row kernels below and by cutlass_qmm.cu: MLX's layer_norm.cu row layout and
# LayerNorm statistics, in MLX's order (the file says how).
# The package's file (also for a kernels.py loaded from elsewhere: benchmarks.kernels_ab's).
ROW_HEADER_FILE = Path(str(importlib.resources.files(__package__) / "layer_norm_rows.cuh"))
_ROW_HEADER = ROW_HEADER_FILE.read_text()


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
    """Whether a row of ``width`` values of ``dtype`` fits layer_norm_rows.cuh's layout, one block
    a row (at most MAX_THREADS threads of 16 bytes each): the row kernels here and cutlass_qmm's
    split-K sum with its LayerNorm."""
    return width % _per_thread(dtype) == 0 and width <= _per_thread(dtype) * MAX_THREADS


# q/k/v heads. Thread t owns columns N*t.. of q and k; a RoPE pair (j, j + 32) of a head
# sits in threads t and t ^ (32 / N) of one warp: exchanged with a shuffle. q and k are written
# (B, L, H, 64), the projection's own row layout (see qkv_heads).
_QKV_SOURCE = """
  constexpr int DH = 64, D = HEADS * DH, N = 16 / sizeof(T);
  __shared__ float red[2][2][32];
  const int t = threadIdx.x;
  const int L = qkv_shape[1];
  const size_t row = block_row();
  if (row >= size_t(qkv_shape[0]) * L) return;
  const int l = int(row % L);
  const T* src = qkv + row * (3 * D);
  const int c = N * t, j = c % DH;
  const bool active = c < D;
  const size_t dst = row * D + c;
  const float eps = __int_as_float(EPS_BITS);
  const float log2_base = __int_as_float(LOG2_BASE_BITS);

  __align__(16) T x[2][N];  // this thread's q and k values
#pragma unroll
  for (int i = 0; i < N; ++i) x[0][i] = x[1][i] = T(0);
  if (active) {
    move<N>(x[0], src + c);
    move<N>(x[1], src + D + c);
  }

  // The row's 32 RoPE angles as mx.fast.rope computes them (non-traditional: pair p is
  // (p, p + 32); inv_freq = exp2(-(p / 32) * log2(base)), scale 1, offset 0), once per row
  // rather than per element; block_sum's sync (in row_stats) publishes them.
  __shared__ float rot[2][DH / 2];
  if (t < DH / 2) {
    float d = static_cast<float>(t) / static_cast<float>(DH / 2);
    float inv_freq = exp2(-d * log2_base);
    float pos = 1.0f * static_cast<float>(l);
    float theta = pos * inv_freq;
    rot[0][t] = cos(theta);
    rot[1][t] = sin(theta);
  }

  float mean[2], rstd[2];
  row_stats<2, N>(x, active, D, eps, red, mean, rstd);

  // Normalized, times the weight, plus MLX's zero bias: rounded to T as mx.fast.layer_norm
  // writes it; RoPE reads those rounded values back as fp32.
  const T zero = T(0);
  float yq[N], yk[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T wqi = active ? q_weight[c + i] : zero;
    const T wki = active ? k_weight[c + i] : zero;
    float norm_q = (static_cast<float>(x[0][i]) - mean[0]) * rstd[0];
    float norm_k = (static_cast<float>(x[1][i]) - mean[1]) * rstd[1];
    yq[i] = static_cast<float>(T(wqi * static_cast<T>(norm_q) + zero));
    yk[i] = static_cast<float>(T(wki * static_cast<T>(norm_k) + zero));
  }

  // The rotation in mx.fast.rope's fp32 expressions, one rounding at the end.
  const bool first = j < DH / 2;
  __align__(16) T oq[N], ok[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float pq = __shfl_xor_sync(0xffffffffu, yq[i], DH / 2 / N);
    const float pk = __shfl_xor_sync(0xffffffffu, yk[i], DH / 2 / N);
    const int p = (j + i) % (DH / 2);
    const float costheta = rot[0][p], sintheta = rot[1][p];
    float x1 = first ? yq[i] : pq, x2 = first ? pq : yq[i];
    float rx1 = x1 * costheta - x2 * sintheta;
    float rx2 = x1 * sintheta + x2 * costheta;
    oq[i] = static_cast<T>(first ? rx1 : rx2);
    x1 = first ? yk[i] : pk;
    x2 = first ? pk : yk[i];
    rx1 = x1 * costheta - x2 * sintheta;
    rx2 = x1 * sintheta + x2 * costheta;
    ok[i] = static_cast<T>(first ? rx1 : rx2);
  }
  if (active) {
    move<N>(q + dst, oq);
    move<N>(k + dst, ok);
  }
"""


@functools.cache
def _qkv_heads_kernel() -> Kernel:
    return Kernel(
        name="esmc_qkv_heads",
        input_names=["qkv", "q_weight", "k_weight"],
        output_names=["q", "k"],
        source=_QKV_SOURCE,
        header=_ROW_HEADER,
    )


def _f32_bits(x: float) -> int:
    """The fp32 bit pattern of x as a signed int (a kernel template argument)."""
    return int(np.array(x, np.float32).view(np.int32))


def rope_log2_base(base: float) -> float:
    """log2(base) as mx.fast.rope's CUDA path passes it to its kernel: ``std::log2`` of the
    fp32 base, in fp32 (here the exact log2 rounded once to fp32)."""
    return float(np.float32(math.log2(float(np.float32(base)))))


def qkv_heads_supported(
    qkv: mx.array, q_norm_weight: mx.array, k_norm_weight: mx.array, eps: float, rope_theta: float, num_heads: int
) -> bool:
    """True when ``qkv_heads`` runs the CUDA kernel for these arguments (on a CUDA GPU).
    eps and log2(rope_theta) reach the kernel as the bits of positive fp32 values (template
    integers, which become part of the kernel's name: no minus sign)."""
    if not on_cuda():
        return False
    d = num_heads * QKV_HEAD_DIM
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


def qkv_heads_reference(qkv, q_norm_weight, k_norm_weight, eps: float, rope_theta: float, num_heads: int):
    """What the model computes without the kernel (runtime/model.py ``Attention``): split,
    LayerNorm without bias over the whole width, (B, H, L, Dh) heads, RoPE."""
    B, L, _ = qkv.shape
    q, k, v = mx.split(qkv, 3, axis=-1)

    def heads(x):
        return x.reshape(B, L, num_heads, -1).transpose(0, 2, 1, 3)

    def rope(x):
        return mx.fast.rope(x, x.shape[-1], traditional=False, base=rope_theta, scale=1.0, offset=0)

    q = rope(heads(mx.fast.layer_norm(q, q_norm_weight, None, eps)))
    k = rope(heads(mx.fast.layer_norm(k, k_norm_weight, None, eps)))
    return q, k, heads(v)


def qkv_heads(
    qkv: mx.array, q_norm_weight: mx.array, k_norm_weight: mx.array, eps: float, rope_theta: float, num_heads: int
) -> tuple[mx.array, mx.array, mx.array]:
    """q, k, v as (B, H, L, 64) from the fused projection output (B, L, 3d):
    ``rope(layer_norm(q) * w_q)``, the same for k, and v. One CUDA kernel on a GPU instead of
    MLX's copies of the strided q/k views, two layer norms, two head transposes and two ropes;
    elsewhere ``qkv_heads_reference``.

    On the GPU the three are (B, H, L, 64) views of (B, L, H, 64) memory, the layout torch
    hands its attention too: the kernel writes q and k row by row, and v is a view of the
    projection output (no copy). MLX's cuDNN attention allocates its output in q's layout,
    so the output is (B, L, H, 64) in memory and the ``(B, L, d)`` reshape before the output
    projection is free; with contiguous (B, H, L, 64) heads both that reshape and v were a
    copy of the activations per layer. Against that previous kernel, in one process on the
    H200: 6B 64x512 753.1 against 769.8 ms, 16x256 95.4 against 97.5 ms, 300M 64x512 53.2
    against 55.1 ms, same logits (docs/bench/qkv_layout_ab_*_h200.json).

    The kernel repeats MLX's CUDA arithmetic (mlx/backend/cuda/layer_norm.cu and rope.cu,
    0.32.x) as the same expressions: fp32 sum in layer_norm's thread/warp order (16 bytes of
    values per thread, cg::reduce per warp, then across warps), mean = sum / d, the variance as a second
    pass over (x - mean)^2, rsqrt(var / d + eps), ``w * T(norm) + T(0)`` in the input dtype;
    RoPE reads that rounded value, ``inv_freq = exp2(-(p / 32) * log2(base))`` with log2(base)
    rounded to fp32 on the host as MLX does, ``theta = pos * inv_freq``, fp32 cos/sin, one
    rounding at the end.

    Checked on the H200 (tests/test_kernels.py): in fp32, what validation computes in, no
    element differs from the unfused ops at 40 heads (2x17 and 1x300), none is more than 1 ulp
    off at 15; the same now in bf16 and fp16. Until this kernel gave a thread 8 values in bf16
    and fp16, as MLX's layer_norm does (16 bytes a thread), it gave every dtype 4, its sums ran
    in another order, and some bf16/fp16 outputs were more than 1 ulp off; a 6B forward now
    gives the same logits with and without it (``python -m benchmarks.kernel_ab --env
    ESMC_MLX_FUSED_QKV``: 1.06-1.22x faster with it, docs/bench/qkv_kernel_ab_6b_h200_round7.json).
    """
    if not qkv_heads_supported(qkv, q_norm_weight, k_norm_weight, eps, rope_theta, num_heads):
        return qkv_heads_reference(qkv, q_norm_weight, k_norm_weight, eps, rope_theta, num_heads)
    B, L, _ = qkv.shape
    rows = (B, L, num_heads, QKV_HEAD_DIM)
    q, k = _qkv_heads_kernel()(
        inputs=[qkv, q_norm_weight, k_norm_weight],
        template=[
            ("T", qkv.dtype),
            ("HEADS", num_heads),
            ("EPS_BITS", _f32_bits(eps)),
            ("LOG2_BASE_BITS", _f32_bits(rope_log2_base(rope_theta))),
        ],
        output_shapes=[rows] * 2,
        output_dtypes=[qkv.dtype] * 2,
        **_row_launch(B * L, num_heads * QKV_HEAD_DIM, qkv.dtype),
    )
    v = qkv[..., 2 * num_heads * QKV_HEAD_DIM :].reshape(rows)
    return tuple(a.transpose(0, 2, 1, 3) for a in (q, k, v))


# ---- the residual add and the LayerNorm after it, in one pass --------------------------------

_ADD_NORM_SOURCE = """
  constexpr int N = 16 / sizeof(T);
  __shared__ float red[2][1][32];
  const size_t row = block_row();
  if (row >= size_t(x_shape[0])) return;
  const int c = N * threadIdx.x;
  const bool active = c < D;
  const size_t at = row * D + c;
  const float eps = __int_as_float(EPS_BITS);

  // The residual stream: x + h / scale in T, each operation rounded as MLX's ops round it.
  __align__(16) T r[1][N];
#pragma unroll
  for (int i = 0; i < N; ++i) r[0][i] = T(0);
  if (active) {
    __align__(16) T xs[N], hs[N];
    move<N>(xs, x + at);
    move<N>(hs, h + at);
    const T s = scale[0];
#pragma unroll
    for (int i = 0; i < N; ++i) r[0][i] = xs[i] + hs[i] / s;
    move<N>(residual + at, r[0]);
  }

  // mx.fast.layer_norm of it.
  float mean[1], rstd[1];
  row_stats<1, N>(r, active, D, eps, red, mean, rstd);
  if (active) {
    __align__(16) T ws[N], bs[N], out[N];
    move<N>(ws, weight + c);
    move<N>(bs, bias + c);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float norm = (static_cast<float>(r[0][i]) - mean[0]) * rstd[0];
      out[i] = ws[i] * static_cast<T>(norm) + bs[i];
    }
    move<N>(normed + at, out);
  }
"""


@functools.cache
def _add_norm_kernel() -> Kernel:
    return Kernel(
        name="esmc_add_layer_norm",
        input_names=["x", "h", "scale", "weight", "bias"],
        output_names=["residual", "normed"],
        source=_ADD_NORM_SOURCE,
        header=_ROW_HEADER,
    )


def add_layer_norm_supported(x: mx.array, h: mx.array, weight: mx.array, bias: mx.array | None, eps: float) -> bool:
    """True when ``add_layer_norm`` runs the CUDA kernel for these arguments (on a CUDA GPU)."""
    if not on_cuda():
        return False
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


def add_layer_norm_reference(x, h, scale: float, weight, bias, eps: float) -> tuple[mx.array, mx.array]:
    """What the model computes without the kernel: the residual add, then its LayerNorm."""
    residual = x + h / scale
    return residual, mx.fast.layer_norm(residual, weight, bias, eps)


def add_layer_norm(
    x: mx.array, h: mx.array, scale: float, weight: mx.array, bias: mx.array | None, eps: float
) -> tuple[mx.array, mx.array]:
    """``x + h / scale`` (ESMC's scaled residual add) and ``mx.fast.layer_norm`` of it, from
    one CUDA kernel that reads x and h once and writes both (MLX: an add kernel, then a
    LayerNorm that reads the sum back); elsewhere ``add_layer_norm_reference``.

    Written as MLX's own arithmetic: ``scale`` is rounded to x's dtype as MLX rounds a Python
    scalar, the add and the division are T operations (MLX's Divide and Add functors), and the
    LayerNorm is layer_norm_rows.cuh's copy of mlx/backend/cuda/layer_norm.cu with the bias
    (zero when None, as mx.fast.layer_norm adds it). Inputs of fewer than MIN_VALUES values
    take MLX's ops (faster there).

    Checked on the H200 (tests/test_kernels.py): both outputs equal MLX's ops bit for bit, eager
    and compiled, in bf16, fp16 and fp32, at the 300M's, 600M's and 6B's widths, with and
    without bias; whole forwards give identical logits with and without it. Forwards of the
    shipped model, this kernel on against off in one process (``python -m
    benchmarks.kernel_ab``, docs/bench/norm_kernel_ab_*_h200.json): 6B 16x256 97.4 against
    102.1 ms, 64x512 777.0 against 806.4 ms; 300M 64x512 55.2 against 58.8 ms."""
    if x.size < MIN_VALUES or not add_layer_norm_supported(x, h, weight, bias, eps):
        return add_layer_norm_reference(x, h, scale, weight, bias, eps)
    d = x.shape[-1]
    rows = x.size // d
    residual, normed = _add_norm_kernel()(
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
