// Row kernels' shared parts: rows.cu's qkv_heads and add_layer_norm (compiled by
// mx.fast.cuda_kernel, which reads this file as their header) and cutlass_qmm.cu's split-K sum
// with its LayerNorm (compiled by nvcc, which includes it). They lay a row out as
// mlx/backend/cuda/layer_norm.cu (0.32.x) does: thread t owns the N = 16 / sizeof(T) columns
// N*t .. N*t+N-1 (MLX's N_READS: 8 for bf16/fp16, 4 for fp32), so that the LayerNorm sums are
// added in MLX's order and its outputs are MLX's bit for bit.
#ifndef ESMC_MLX_LAYER_NORM_ROWS_CUH
#define ESMC_MLX_LAYER_NORM_ROWS_CUH

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
template <int K, int N, typename T>
__device__ __forceinline__ void row_stats(
    const T (&x)[K][N], bool active, int D, float eps, float (&tmp)[2][K][32], float (&mean)[K], float (&rstd)[K]) {
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

#endif  // ESMC_MLX_LAYER_NORM_ROWS_CUH
