"""Custom CUDA kernels for MLX's CUDA backend, each written to give the MLX ops it replaces
bit for bit: ``dequantize`` (below), ``qkv_heads`` (the attention's QK LayerNorm, RoPE and
head layout in one pass) and ``add_layer_norm`` (a residual add and the LayerNorm after it);
their docstrings have the details. Elsewhere they are the MLX ops.
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
# Below this many values (of the weight, or of add_layer_norm's input) MLX's own ops are as
# fast or faster: a custom kernel call carries 15-20 us of launch and dispatch. H200, bf16:
# weights of 0.9-6.6M values took 9-48 us with mx.dequantize and 16-38 us with this kernel,
# while 6912x2560 and larger took 1.08-3.15x less time here; whole forwards with
# add_layer_norm at every size were 5-11% slower at 3.9M values or fewer per call (6B at 1x256,
# 1x1024; 300M up to 16x256) and 4-7% faster from 10M (6B 16x256, 64x512; 300M 64x512).
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


# ---- row kernels: one block per token row, MLX's layer_norm layout --------------------------

QKV_HEAD_DIM = 64
GRID_X_THREADS = 2**31 - 1  # the most threads along a grid's x axis (an int32)
MAX_THREADS = 1024  # per block

# Shared by the row kernels below. They lay a row out as mlx/backend/cuda/layer_norm.cu (0.32.x)
# does: thread t owns the N = 16 / sizeof(T) columns N*t .. N*t+N-1 (MLX's N_READS: 8 for
# bf16/fp16, 4 for fp32), so that the LayerNorm sums are added in MLX's order.
_ROW_HEADER = """
#include <cooperative_groups/reduce.h>

// One thread's N = 16 / sizeof(T) consecutive values: one 128-bit access when both addresses
// are 16-byte aligned, else element by element. Register arrays passed here are __align__(16).
template <int N, typename T>
__device__ __forceinline__ void move(T* to, const T* from) {
  static_assert(N * sizeof(T) == 16);
  if (((reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from)) & 15) == 0) {
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    return;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) to[i] = from[i];
}

// K block sums in MLX's layer_norm order (BlockBroadcastReduce): a cg::reduce per warp, the
// warp results through shared memory (0 past the last warp), a cg::reduce of those.
template <int K>
__device__ __forceinline__ void block_sum(float (&v)[K], float (&tmp)[K][32]) {
  auto block = cooperative_groups::this_thread_block();
  auto warp = cooperative_groups::tiled_partition<32>(block);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = cooperative_groups::reduce(warp, v[k], cooperative_groups::plus<float>());
    if (warp.thread_rank() == 0) tmp[k][warp.meta_group_rank()] = v[k];
  }
  block.sync();
  const bool has = warp.thread_rank() < warp.meta_group_size();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = has ? tmp[k][warp.thread_rank()] : 0.0f;
    v[k] = cooperative_groups::reduce(warp, v[k], cooperative_groups::plus<float>());
  }
}

// This block's row: blocks run along x, then on to further rows of blocks along y (a grid past
// 2^31 threads); the last row of blocks may run past the rows (the kernel returns there).
__device__ __forceinline__ size_t block_row() {
  return size_t(blockIdx.y) * gridDim.x + blockIdx.x;
}

// LayerNorm statistics of K rows of D values, this thread holding N of each (zeros past the
// row's end), as mlx/backend/cuda/layer_norm.cu computes them: the mean from an fp32 block
// sum, the variance as a second pass over (x - mean)^2, then rsqrt(var / D + eps).
template <int K, int N, int D, typename T>
__device__ __forceinline__ void row_stats(
    const T (&x)[K][N], bool active, float eps, float (&tmp)[2][K][32], float (&mean)[K], float (&rstd)[K]) {
  float sums[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    sums[k] = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) sums[k] += static_cast<float>(x[k][i]);
  }
  block_sum<K>(sums, tmp[0]);
  float vars[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    mean[k] = sums[k] / D;
    vars[k] = 0;
    if (active) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float t = static_cast<float>(x[k][i]) - mean[k];
        vars[k] += t * t;
      }
    }
  }
  block_sum<K>(vars, tmp[1]);
#pragma unroll
  for (int k = 0; k < K; ++k) rstd[k] = rsqrt(vars[k] / D + eps);
}
"""


def _per_thread(dtype: mx.Dtype) -> int:
    """Columns per thread in MLX's layer_norm layout (N_READS = 16 / itemsize)."""
    return 16 // dtype.size


def _row_launch(rows: int, width: int, dtype: mx.Dtype) -> dict:
    """Grid and block for one block per row: a 2D grid of blocks once the row count times the
    block would pass the grid's int32 width (the kernels skip the last row's spare blocks)."""
    threads = -(-width // _per_thread(dtype) // 32) * 32
    nx = min(rows, GRID_X_THREADS // threads)
    return {"grid": (nx * threads, -(-rows // nx), 1), "threadgroup": (threads, 1, 1)}


def _fits_a_block(width: int, dtype: mx.Dtype) -> bool:
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
  row_stats<2, N, D>(x, active, eps, red, mean, rstd);

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
        and _fits_a_block(d, qkv.dtype)
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
  row_stats<1, N, D>(r, active, eps, red, mean, rstd);
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
        and _fits_a_block(d, x.dtype)
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
    LayerNorm is the qkv_heads kernel's copy of mlx/backend/cuda/layer_norm.cu with the bias
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
