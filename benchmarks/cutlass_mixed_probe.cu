// Probe (issue 16, thirty-first session): does CUTLASS's Hopper mixed-input GEMM (the weight
// dequantized in registers, TMA + warp specialization: the machinery this project's kernels
// lack) run the 6B's weights at 1024 tokens near the bf16 GEMM's time? CUTLASS 4.4's headers
// ship inside the mlx-cuda-13 wheel (mlx/include/cutlass, cute).
//
// y[M, N] = x[M, K] @ dequantize(W)[N, K]^T, W affine 4- or 8-bit, groups of 64 along K, scales
// and biases bf16. The weight is the builder's A operand (it must pass through registers), so
// the problem is given swapped: (N, M, K), output column-major in (N, M) = y row-major.
//
// A standalone CUDA program (no MLX): the same problem through CUTLASS's bf16 x bf16 GEMM on the
// weight dequantized beforehand is the reference, for time and for values. -DNDEBUG matters:
// without it CUTLASS's device asserts are calls that serialize the wgmma pipeline (ptxas C7510).
// Built here (nvcc 13.0) and run on the H200 in the thirty-first session:
// docs/bench/cutlass_mixed_probe_h200_session31.log.
//
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -I<mlx>/include \
//        -o cutlass_mixed_probe benchmarks/cutlass_mixed_probe.cu    # <mlx>: the CUDA wheel's package
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
using Bf16 = cutlass::bfloat16_t;
constexpr int GROUP = 64;

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
#define CHECK_CUTLASS(x) do { cutlass::Status s = (x); if (s != cutlass::Status::kSuccess) { printf("CUTLASS %s at %d\n", cutlassGetStatusString(s), __LINE__); return -1.0f;} } while (0)

template <class TileShape, class Kernel, class Epi>
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, Shape<_1, _1, _1>,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::ColumnMajor, 8, Bf16, cutlass::layout::ColumnMajor, 8, Epi>::CollectiveOp;

// The weight (builder A: N x K, K contiguous) with its scales and biases; x is builder B (M x K).
template <class Quant, class TileShape, class Kernel, class Epi>
struct Mixed {
  using Epi_ = Epilogue<TileShape, Kernel, Epi>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<Quant, Bf16, Bf16>, cutlass::layout::RowMajor, 128 / cutlass::sizeof_bits<Quant>::value,
      Bf16, cutlass::layout::ColumnMajor, 8, float, TileShape, Shape<_1, _1, _1>,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi_::SharedStorage))>,
      Kernel>::CollectiveOp;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epi_>>;
};

// The same problem with the weight already dequantized (bf16 x bf16).
template <class TileShape, class Kernel, class Epi>
struct Plain {
  using Epi_ = Epilogue<TileShape, Kernel, Epi>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, 8, Bf16,
      cutlass::layout::ColumnMajor, 8, float, TileShape, Shape<_1, _1, _1>,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi_::SharedStorage))>,
      Kernel>::CollectiveOp;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epi_>>;
};

struct Problem {
  int n, k, m, bits;
  void *q;                 // N x K packed, K contiguous (MLX's layout)
  Bf16 *scales, *biases;   // [K / GROUP][N]: CUTLASS wants them N-major (MLX's are [N][K / GROUP])
  Bf16 *w, *x, *y, *y_ref; // w: dequantized N x K
};

__global__ void dequantize_kernel(const uint8_t* q, const Bf16* s, const Bf16* b, Bf16* w, int n, int k, int bits) {
  long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(n) * k) return;
  int row = i / k, col = i % k;
  int v = bits == 8 ? q[i] : (q[i / 2] >> (4 * (i % 2))) & 15;
  int g = (col / GROUP) * n + row;
  w[i] = Bf16(float(s[g]) * float(v) + float(b[g]));
}

template <class Gemm, bool MIXED>
float time_gemm(Problem& p, Bf16* out, int reps) {
  using Kernel = typename Gemm::GemmKernel;
  auto sA = make_stride(int64_t(p.k), Int<1>{}, int64_t(0));
  auto sB = make_stride(int64_t(p.k), Int<1>{}, int64_t(0));
  typename Kernel::StrideD sD{};
  get<1>(sD) = int64_t(p.n);  // column-major (N, M): y row-major
  typename Gemm::Arguments args;
  if constexpr (MIXED) {
    typename Kernel::CollectiveMainloop::StrideScale sS{};
    get<1>(sS) = int64_t(p.n);
    args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                                    {p.n, p.m, p.k, 1},
                                    {static_cast<typename Kernel::ElementA const*>(p.q), sA, p.x, sB, p.scales, sS, GROUP, p.biases},
                                    {{1.0f, 0.0f}, nullptr, {}, out, sD}};
  } else {
    args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                                    {p.n, p.m, p.k, 1},
                                    {p.w, sA, p.x, sB},
                                    {{1.0f, 0.0f}, nullptr, {}, out, sD}};
  }
  Gemm gemm;
  size_t ws = Gemm::get_workspace_size(args);
  void* workspace = nullptr;
  if (ws) CHECK(cudaMalloc(&workspace, ws));
  CHECK_CUTLASS(gemm.can_implement(args));
  CHECK_CUTLASS(gemm.initialize(args, workspace));
  for (int i = 0; i < 3; ++i) CHECK_CUTLASS(gemm.run());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) gemm.run();
  cudaEventRecord(b);
  CHECK(cudaEventSynchronize(b));
  float ms;
  cudaEventElapsedTime(&ms, a, b);
  if (workspace) cudaFree(workspace);
  return 1000.0f * ms / reps;  // us
}

float max_rel(const Bf16* got, const Bf16* ref, size_t n) {
  std::vector<Bf16> g(n), r(n);
  cudaMemcpy(g.data(), got, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(r.data(), ref, n * 2, cudaMemcpyDeviceToHost);
  float worst = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) scale = fmaxf(scale, fabsf(float(r[i])));
  for (size_t i = 0; i < n; ++i) {
    float d = fabsf(float(g[i]) - float(r[i]));
    if (!(d <= worst)) worst = d;  // NaN stays
  }
  return worst / scale;
}

template <class Quant, class Tile, class K, class E>
void run_mixed(const char* name, Problem& p) {
  float us = time_gemm<typename Mixed<Quant, Tile, K, E>::Gemm, true>(p, p.y, 50);
  float err = max_rel(p.y, p.y_ref, size_t(p.m) * p.n);
  printf("  %-28s %8.1f us  %6.1f TFLOP/s  max error / max |y| %.2e\n", name, us, 2.0 * p.m * p.n * p.k / us / 1e6, err);
}

int main(int argc, char** argv) {
  int shapes[][2] = {{7680, 2560}, {2560, 2560}, {13824, 2560}, {2560, 6912}};  // the 6B's qkv, o, gate/up, down
  int tokens[] = {256, 1024, 4096};
  std::vector<uint8_t> hq;
  for (int bits : {4, 8}) {
    for (auto& s : shapes) {
      for (int m : tokens) {
        Problem p{s[0], s[1], m, bits, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
        size_t nk = size_t(p.n) * p.k, groups = nk / GROUP;
        hq.resize(nk * bits / 8);
        for (auto& v : hq) v = rand() & 255;
        std::vector<Bf16> hs(groups), hb(groups), hx(size_t(m) * p.k);
        for (auto& v : hs) v = Bf16(0.002f + 0.001f * (rand() % 8));
        for (auto& v : hb) v = Bf16(-0.01f * (rand() % 4));
        for (auto& v : hx) v = Bf16(float(rand() % 2001 - 1000) / 1000.0f);
        CHECK(cudaMalloc(&p.q, hq.size()));
        CHECK(cudaMalloc(&p.scales, groups * 2));
        CHECK(cudaMalloc(&p.biases, groups * 2));
        CHECK(cudaMalloc(&p.w, nk * 2));
        CHECK(cudaMalloc(&p.x, hx.size() * 2));
        CHECK(cudaMalloc(&p.y, size_t(m) * p.n * 2));
        CHECK(cudaMalloc(&p.y_ref, size_t(m) * p.n * 2));
        cudaMemcpy(p.q, hq.data(), hq.size(), cudaMemcpyHostToDevice);
        cudaMemcpy(p.scales, hs.data(), groups * 2, cudaMemcpyHostToDevice);
        cudaMemcpy(p.biases, hb.data(), groups * 2, cudaMemcpyHostToDevice);
        cudaMemcpy(p.x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
        dequantize_kernel<<<(nk + 255) / 256, 256>>>((uint8_t*)p.q, p.scales, p.biases, p.w, p.n, p.k, bits);
        CHECK(cudaDeviceSynchronize());
        using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
        using CoopE = cutlass::epilogue::TmaWarpSpecializedCooperative;
        using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
        using PingE = cutlass::epilogue::TmaWarpSpecialized;
        float ref = time_gemm<Plain<Shape<_128, _256, _64>, Coop, CoopE>::Gemm, false>(p, p.y_ref, 50);
        printf("%d-bit N=%d K=%d M=%d\n  %-28s %8.1f us  %6.1f TFLOP/s\n", bits, p.n, p.k, m, "bf16 x bf16 128x256 coop", ref,
               2.0 * m * p.n * p.k / ref / 1e6);
        if (bits == 4) {
          run_mixed<cutlass::uint4b_t, Shape<_128, _128, _64>, Coop, CoopE>("mixed 128x128 coop", p);
          run_mixed<cutlass::uint4b_t, Shape<_128, _256, _64>, Coop, CoopE>("mixed 128x256 coop", p);
          run_mixed<cutlass::uint4b_t, Shape<_64, _128, _64>, Ping, PingE>("mixed 64x128 pingpong", p);
        } else {
          run_mixed<uint8_t, Shape<_128, _128, _64>, Coop, CoopE>("mixed 128x128 coop", p);
          run_mixed<uint8_t, Shape<_128, _256, _64>, Coop, CoopE>("mixed 128x256 coop", p);
          run_mixed<uint8_t, Shape<_64, _128, _64>, Ping, PingE>("mixed 64x128 pingpong", p);
        }
        fflush(stdout);
        cudaFree(p.q); cudaFree(p.scales); cudaFree(p.biases); cudaFree(p.w); cudaFree(p.x); cudaFree(p.y); cudaFree(p.y_ref);
      }
    }
  }
  return 0;
}
