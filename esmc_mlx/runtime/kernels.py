"""Custom CUDA kernels for MLX's CUDA backend, each written to give the MLX ops it replaces
bit for bit: ``dequantize`` (below) and ``qkv_heads`` (the attention's QK LayerNorm, RoPE and
head layout in one pass; its docstring has the details). Elsewhere both are the MLX ops.
Each is an ``mx.fast.cuda_kernel`` whose compiled form runtime/kernel_cache.py keeps on disk
(MLX would compile it in every process).

A fast dequantize, bit for bit the same as ``mx.dequantize``.

MLX 0.32.4's CUDA dequantize gives every thread one packed byte (or 3/5 bytes) and reloads
the group's scale and bias per byte: on an H200 it reaches 400-750 GB/s of the card's 4.8 TB/s
on the 6B's weights (issue 16). Here a thread takes 8 values at a time (an octet: ``bits``
packed bytes, one aligned load where the address allows), their one scale (and bias: an octet
never straddles a group), and writes them with one 128-bit store from registers (two for
fp32), so that a warp reads 32 x bits consecutive bytes and writes 512 consecutive bytes. A
grid-stride loop over at most MAX_BLOCKS blocks.

Measured on the H200 (``python -m benchmarks.dequant_kernels --models 6B,300M --against
OLD_kernels.py --max-blocks 1056,0 --skip-matmul``, bf16 out, each weight timed in batches of
20 calls, contenders interleaved; docs/bench/dequant_kernels_h200_octets.json): on the 6B's
weights of 8M values or more (13824x2560 fused gate/up, 6912x2560, 2560x6912, 7680x2560),
29.5-67.3 us, 1.08-3.15x less time than mx.dequantize and 1.08-1.65x less than this module's
previous kernel (32 values a thread), bit-exact for every mode, bit width and shape timed. That
is 860-1690 GB/s, a third of the card's bandwidth: each call also carries 15-20 us of launch
and dispatch (a 960x960 weight takes 16-20 us here against 9-16 us with mx.dequantize, the
fixed costs of a custom kernel), which is why smaller weights, fewer than MIN_VALUES values,
stay with mx.dequantize (faster in 36 of 45 such cases). The grid cap changed nothing beyond
the noise (1,056 blocks, 4,224, or one thread per octet).

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
import math

import mlx.core as mx
import numpy as np

from .kernel_cache import Kernel

# Blocks of the grid-stride loop: four waves of the H200's 132 SMs x 8 resident blocks of 256.
MAX_BLOCKS = 132 * 8 * 4
# Below this many values MLX's own dequantize is as fast or faster (H200, bf16 out: weights of
# 0.9-6.6M values took 9-48 us with mx.dequantize and 16-38 us with this kernel, while 6912x2560
# and larger took 1.08-3.15x less time here): launch costs dominate.
MIN_VALUES = 8 << 20
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
"""

_LOOP = """
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const size_t n_octets = size_t(w_shape[0]) * 4 / BITS;  // 8 values = BITS bytes
  const size_t step = size_t(gridDim.x) * blockDim.x;
  const uint8_t* packed = reinterpret_cast<const uint8_t*>(w);
  for (size_t o = size_t(blockIdx.x) * blockDim.x + threadIdx.x; o < n_octets; o += step) {
    const uint64_t q = load_octet<BITS>(packed + o * BITS);
    const size_t g = o * 8 / GROUP;  // an octet never straddles a group (groups: 16, 32, 64, 128)
    O v[8];
    BODY
    store8<O>(out + o * 8, v);
  }
"""

_AFFINE = """
    const T scale = scales[g];
    const T bias = biases[g];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const T r = static_cast<T>(static_cast<int>(uint32_t(q >> (i * BITS)) & MASK)) * scale + bias;
      v[i] = to_out<O>(r);
    }
"""

_FP = """
    const float scale = MX ? e8m0(scales[g]) : e4m3(scales[g]) * 1.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t d = uint32_t(q >> (i * BITS)) & MASK;
      v[i] = static_cast<O>(scale * (BITS == 8 ? e4m3(d) : e2m1(d)));
    }
"""


@functools.cache
def _kernel(mode: str, bits: int, group_size: int) -> Kernel:
    """The kernel for one (mode, bits, group size); dtypes are template arguments."""
    affine = mode == "affine"
    return Kernel(
        name=f"esmc_dequantize_{mode}_{bits}_{group_size}",
        input_names=["w", "scales", "biases"] if affine else ["w", "scales"],
        output_names=["out"],
        source=_LOOP.replace("BODY", _AFFINE if affine else _FP),
        header=_HEADER,
    )


def supported(w, scales, biases, group_size: int, bits: int, mode: str, dtype, global_scale=None) -> bool:
    """True when the CUDA kernel handles this call (and the default device is a CUDA GPU)."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
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
    small = w.size * 32 // bits < MIN_VALUES
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
    out_shape = (*w.shape[:-1], w.shape[-1] * 32 // bits)
    inputs = [w.reshape(-1), scales.reshape(-1)]
    template = [("O", dtype), ("BITS", bits), ("GROUP", group_size)]
    if mode == "affine":
        inputs.append(biases.reshape(-1))
        template.append(("T", scales.dtype))
    else:
        template.append(("MX", int(mode != "nvfp4")))
    octets = w.size * 4 // bits
    threads = min(-(-octets // THREADS_PER_BLOCK), MAX_BLOCKS) * THREADS_PER_BLOCK
    (out,) = _kernel(mode, bits, group_size)(
        inputs=inputs,
        template=template,
        grid=(threads, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[out_shape],
        output_dtypes=[dtype],
    )
    return out


# ---- q/k/v heads: QK LayerNorm + RoPE + head layout in one pass ------------------------------

QKV_HEAD_DIM = 64
GRID_X_THREADS = 2**31 - 1  # the most threads along a grid's x axis (an int32)

_QKV_HEADER = """
#include <cooperative_groups/reduce.h>

// 4 consecutive values; one 64/128-bit access when the address allows.
template <typename T>
__device__ __forceinline__ void load4(const T* p, T* v) {
  if constexpr (sizeof(T) == 2) {
    if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      *reinterpret_cast<uint2*>(v) = *reinterpret_cast<const uint2*>(p);
      return;
    }
  } else if constexpr (sizeof(T) == 4) {
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(p);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = p[i];
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const T* v) {
  if constexpr (sizeof(T) == 2) {
    if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(v);
      return;
    }
  } else if constexpr (sizeof(T) == 4) {
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = v[i];
}

// Two block sums in MLX's layer_norm order (BlockBroadcastReduce): a cg::reduce per warp,
// the warp results through shared memory (0 past the last warp), a cg::reduce of those.
__device__ __forceinline__ void block_sum2(float& a, float& b, float* ta, float* tb) {
  auto block = cooperative_groups::this_thread_block();
  auto warp = cooperative_groups::tiled_partition<32>(block);
  a = cooperative_groups::reduce(warp, a, cooperative_groups::plus<float>());
  b = cooperative_groups::reduce(warp, b, cooperative_groups::plus<float>());
  if (warp.thread_rank() == 0) {
    ta[warp.meta_group_rank()] = a;
    tb[warp.meta_group_rank()] = b;
  }
  block.sync();
  const bool has = warp.thread_rank() < warp.meta_group_size();
  a = has ? ta[warp.thread_rank()] : 0.0f;
  b = has ? tb[warp.thread_rank()] : 0.0f;
  a = cooperative_groups::reduce(warp, a, cooperative_groups::plus<float>());
  b = cooperative_groups::reduce(warp, b, cooperative_groups::plus<float>());
}
"""

# One block per token row; thread t owns columns 4t..4t+3 of q, k and v (MLX's layer_norm
# layout with N_READS = 4, so the sums are added in its order). A RoPE pair (j, j + 32) of a
# head sits in threads t and t ^ 8 of one warp: exchanged with a shuffle.
_QKV_SOURCE = """
  constexpr int DH = 64, D = HEADS * DH;
  __shared__ float red[4][32];
  const int t = threadIdx.x;
  const int L = qkv_shape[1];
  const size_t row = size_t(blockIdx.y) * gridDim.x + blockIdx.x;
  if (row >= size_t(qkv_shape[0]) * L) return;  // the whole block: the grid's last, partial row of blocks
  const size_t b = row / L;
  const int l = int(row % L);
  const T* src = qkv + row * (3 * D);
  const int c = 4 * t, h = c / DH, j = c % DH;
  const bool active = c < D;
  const size_t dst = ((b * HEADS + h) * L + l) * DH + j;
  const float eps = __int_as_float(EPS_BITS);
  const float log2_base = __int_as_float(LOG2_BASE_BITS);

  __align__(16) T xq[4], xk[4], xv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) xq[i] = xk[i] = T(0);
  if (active) {
    load4(src + c, xq);
    load4(src + D + c, xk);
    load4(src + 2 * D + c, xv);
    store4(v + dst, xv);
  }

  // The row's 32 RoPE angles as mx.fast.rope computes them (non-traditional: pair p is
  // (p, p + 32); inv_freq = exp2(-(p / 32) * log2(base)), scale 1, offset 0), once per row
  // rather than per element; block_sum2's sync publishes them.
  __shared__ float rot[2][DH / 2];
  if (t < DH / 2) {
    float d = static_cast<float>(t) / static_cast<float>(DH / 2);
    float inv_freq = exp2(-d * log2_base);
    float pos = 1.0f * static_cast<float>(l);
    float theta = pos * inv_freq;
    rot[0][t] = cos(theta);
    rot[1][t] = sin(theta);
  }

  // Mean (fp32 sum in MLX's order), then the variance as a second pass over (x - mean)^2.
  float sq = 0, sk = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sq += static_cast<float>(xq[i]);
    sk += static_cast<float>(xk[i]);
  }
  block_sum2(sq, sk, red[0], red[1]);
  const float mq = sq / D, mk = sk / D;
  float nq = 0, nk = 0;
  if (active) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float tq = static_cast<float>(xq[i]) - mq;
      nq += tq * tq;
      float tk = static_cast<float>(xk[i]) - mk;
      nk += tk * tk;
    }
  }
  block_sum2(nq, nk, red[2], red[3]);
  nq = rsqrt(nq / D + eps);
  nk = rsqrt(nk / D + eps);

  // Normalized, times the weight, plus MLX's zero bias: rounded to T as mx.fast.layer_norm
  // writes it; RoPE reads those rounded values back as fp32.
  const T zero = T(0);
  float yq[4], yk[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const T wqi = active ? q_weight[c + i] : zero;
    const T wki = active ? k_weight[c + i] : zero;
    float norm_q = (static_cast<float>(xq[i]) - mq) * nq;
    float norm_k = (static_cast<float>(xk[i]) - mk) * nk;
    yq[i] = static_cast<float>(T(wqi * static_cast<T>(norm_q) + zero));
    yk[i] = static_cast<float>(T(wki * static_cast<T>(norm_k) + zero));
  }

  // The rotation in mx.fast.rope's fp32 expressions, one rounding at the end.
  const bool first = j < DH / 2;
  __align__(16) T oq[4], ok[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float pq = __shfl_xor_sync(0xffffffffu, yq[i], 8);
    const float pk = __shfl_xor_sync(0xffffffffu, yk[i], 8);
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
    store4(q + dst, oq);
    store4(k + dst, ok);
  }
"""


@functools.cache
def _qkv_heads_kernel() -> Kernel:
    return Kernel(
        name="esmc_qkv_heads",
        input_names=["qkv", "q_weight", "k_weight"],
        output_names=["q", "k", "v"],
        source=_QKV_SOURCE,
        header=_QKV_HEADER,
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
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
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
        and d <= 4 * 1024  # one column group of 4 per thread, at most 1024 threads
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
    """q, k, v as contiguous (B, H, L, 64) from the fused projection output (B, L, 3d):
    ``rope(layer_norm(q) * w_q)``, the same for k, and v re-laid out. One CUDA kernel on a GPU
    instead of MLX's copies of the strided q/k views, two layer norms, three head transposes
    and two ropes; elsewhere ``qkv_heads_reference``.

    The kernel repeats MLX's CUDA arithmetic (mlx/backend/cuda/layer_norm.cu and rope.cu,
    0.32.x) as the same expressions: fp32 sum in layer_norm's thread/warp order (4 values per
    thread, cg::reduce per warp, then across warps), mean = sum / d, the variance as a second
    pass over (x - mean)^2, rsqrt(var / d + eps), ``w * T(norm) + T(0)`` in the input dtype;
    RoPE reads that rounded value, ``inv_freq = exp2(-(p / 32) * log2(base))`` with log2(base)
    rounded to fp32 on the host as MLX does, ``theta = pos * inv_freq``, fp32 cos/sin, one
    rounding at the end.

    Checked on the H200 (tests/test_kernels.py): in fp32, what validation computes in, no
    element differs from the unfused ops at 40 heads (2x17 and 1x300), none is more than 1 ulp
    off at 15. In bf16 and fp16
    some elements differ by more than 1 ulp at 40 heads (fewer at 15); whole-model outputs
    agree within the bf16 bound. A likely cause, not yet checked: mx.fast.layer_norm adds each
    thread's 4 inputs in the input dtype (cub::ThreadReduce) before widening, this kernel in
    fp32. Its own speed was not measured apart: the 6B figures of docs/benchmarks.md (issue
    16) were taken with it on.
    """
    if not qkv_heads_supported(qkv, q_norm_weight, k_norm_weight, eps, rope_theta, num_heads):
        return qkv_heads_reference(qkv, q_norm_weight, k_norm_weight, eps, rope_theta, num_heads)
    B, L, _ = qkv.shape
    d = num_heads * QKV_HEAD_DIM
    threads = -(-d // 4 // 32) * 32
    # One block per row; a 2D grid of blocks once the row count times the block would pass
    # the grid's int32 width.
    nx = min(B * L, GRID_X_THREADS // threads)
    ny = -(-(B * L) // nx)
    shape = (B, num_heads, L, QKV_HEAD_DIM)
    return tuple(
        _qkv_heads_kernel()(
            inputs=[qkv, q_norm_weight, k_norm_weight],
            template=[
                ("T", qkv.dtype),
                ("HEADS", num_heads),
                ("EPS_BITS", _f32_bits(eps)),
                ("LOG2_BASE_BITS", _f32_bits(rope_log2_base(rope_theta))),
            ],
            grid=(nx * threads, ny, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[shape] * 3,
            output_dtypes=[qkv.dtype] * 3,
        )
    )
