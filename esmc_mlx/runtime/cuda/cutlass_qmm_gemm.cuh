// The GEMM half of cutlass_qmm.cu: CUTLASS's mixed-input GEMM for our weights (the types, the
// mxfp4 scale pairs' mainloop utilities, ``launch``), apart from the primitive, so that its 36
// instantiations compile side by side: cutlass_qmm_gemm.cu instantiates those of one weight type
// and layout (ESMC_QMM_QUANT, ESMC_QMM_LAYOUT), compiled once for each; cutlass_qmm.cu declares
// them extern. Built by `esmc-mlx build-cutlass` (cutlass_qmm.py).
#pragma once

#include <bit>
#include <limits>
#include <optional>
#include <tuple>
#include <variant>

#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/backend/cuda/device.h"

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace mx = mlx::core;

// mxfp4 (e2m1 values, one e8m0 scale per 32 along K) through the same mainloop. CUTLASS's takes
// one scale a row per K tile, and its K tile is at least 64; so the scale element here is a pair,
// the two groups' scales of a K tile as bf16, and the K tile's first half of k-blocks uses one,
// its second half the other. That choice is made where the mainloop hands each k-block's weights
// and scales over, in its utilities (MixedInputUtils): specialized below for this scale type, the
// rest of them CUTLASS's own.
namespace esmc_qmm {
struct Mxfp4Scales {
  cutlass::bfloat16_t even, odd;
};
}  // namespace esmc_qmm

namespace cutlass::gemm::collective::detail {

// The members CUTLASS's utilities read from their collective, from ours: their generic form
// serves everything but the dequantize.
template <class C>
struct CollectiveMembers {
  using KernelSchedule = typename C::KernelSchedule;
  using SmemLayoutA = typename C::SmemLayoutA;
  using SmemLayoutB = typename C::SmemLayoutB;
  using SmemLayoutScale = typename C::SmemLayoutScale;
  using SwappedElementA = typename C::SwappedElementA;
  using SwappedElementB = typename C::SwappedElementB;
  using RealSwappedElementA = typename C::RealSwappedElementA;
  using RealSwappedElementB = typename C::RealSwappedElementB;
  using ElementScale = typename C::ElementScale;
  using ElementZero = typename C::ElementZero;
  using SmemCopyAtomScale = typename C::SmemCopyAtomScale;
  static constexpr auto KernelConversionMode = C::KernelConversionMode;
  static constexpr auto ModeHasScales = C::ModeHasScales;
  static constexpr auto UseScaleLookupTable = C::UseScaleLookupTable;
};

template <class Policy, class Tile, class StrideA, class ElementB, class StrideB, class TiledMma, class CopyA,
          class AtomA, class SmemCopyA, class TransformA, class CopyB, class AtomB, class SmemCopyB, class TransformB>
struct MixedInputUtils<CollectiveMma<Policy, Tile, cute::tuple<float_e2m1_t, esmc_qmm::Mxfp4Scales>, StrideA, ElementB, StrideB,
                                     TiledMma, CopyA, AtomA, SmemCopyA, TransformA, CopyB, AtomB, SmemCopyB, TransformB>>
    : MixedInputUtils<CollectiveMembers<CollectiveMma<Policy, Tile, cute::tuple<float_e2m1_t, esmc_qmm::Mxfp4Scales>, StrideA,
                                                      ElementB, StrideB, TiledMma, CopyA, AtomA, SmemCopyA, TransformA,
                                                      CopyB, AtomB, SmemCopyB, TransformB>>> {
  // A byte of two e2m1 codes (the first value in its low nibble) as a bf16 pair times 2^-126,
  // exactly, in four integer instructions: a code's three magnitude bits become its bf16's two
  // lowest exponent bits and top mantissa bit (2^-126 times 1, 1.5, 2, 3, 4, 6; 0.5 the
  // subnormal 2^-127), its sign bit the sign. Each product below is two shifted copies of the
  // byte that do not overlap, so it adds nothing; the masks keep the bits wanted. The scales
  // carry the 2^126 back (cutlass_qmm.scale_pairs: 2^(e-1), not 2^(e-127)). The byte-permute
  // tables this replaced (still the fused kernel's, octets.cuh's mxfp4_pairs_bf16) made the main
  // loop 217 instructions a K tile against 180 (affine4's 177; nvcc 13, sm_90a).
  CUTLASS_DEVICE static uint32_t e2m1_pair(uint32_t byte) {
    const uint32_t magnitudes = byte * 0x40040u;  // bits 0-2 to 6-8, bits 4-6 to 22-24
    const uint32_t signs = byte * 0x1001000u;     // bit 3 to 15, bit 7 to 31
    return (magnitudes & 0x01C001C0u) | (signs & 0x80008000u);
  }

  // k-block ``k_block`` (16 of K) of this thread's weights, e2m1 codes, to bf16 times its group's
  // scale: exact products, so bit for bit mx.dequantize's values (float(scale) * float(value),
  // rounded once). Eight codes a 32-bit register; each pair of values lies in one row (one scale).
  template <class EngineIn, class EngineOut, class LayoutIn, class LayoutOut, class... Ts>
  CUTLASS_DEVICE static void dequantize_A_kblock(Tensor<EngineIn, LayoutIn> const& tCrA_load,
                                                 Tensor<EngineOut, LayoutOut>& tCrA_mma,
                                                 cute::tuple<Ts...>& partitioned_extra_info, int const k_block) {
    constexpr int k_blocks = decltype(size<2>(tCrA_load))::value;
    static_assert(k_blocks % 2 == 0, "two scale groups a K tile");
    Tensor src = tCrA_load(_, _, k_block);
    Tensor dst = tCrA_mma(_, _, k_block);
    Tensor scales = cute::get<1>(partitioned_extra_info)(_, _, k_block);
    CUTE_STATIC_ASSERT_V(size(src) == size(scales));
    Tensor src_vm = cute::group_modes<1, -1>(cute::zipped_divide(src, Int<8>{}));
    Tensor dst_vm = cute::group_modes<1, -1>(cute::zipped_divide(dst, Int<8>{}));
    Tensor scales_vm = cute::group_modes<1, -1>(cute::zipped_divide(scales, Int<8>{}));
    // Value j of a column at bits 4j of its register, in src and dst alike (so pairs are raw pairs).
    static_assert(cute::is_same_v<decltype(coalesce(src_vm(_, 0).layout())), Layout<_8, _1>>);
    static_assert(cute::is_same_v<decltype(coalesce(dst_vm(_, 0).layout())), Layout<_8, _1>>);
    const bool odd = 2 * k_block >= k_blocks;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<1>(src_vm); ++i) {
      auto bytes = cute::recast<uint8_t>(src_vm(_, i));  // pair p: byte p
      auto out = cute::recast<uint32_t>(dst_vm(_, i));
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < 4; ++p) {
        const esmc_qmm::Mxfp4Scales s = scales_vm(2 * p, i);
        const __nv_bfloat16 scale = odd ? s.odd.to_nv_bfloat16() : s.even.to_nv_bfloat16();
        const uint32_t v = e2m1_pair(bytes(p));
        const __nv_bfloat162 r = __hmul2(reinterpret_cast<const __nv_bfloat162&>(v), __bfloat162bfloat162(scale));
        out(p) = reinterpret_cast<const uint32_t&>(r);
      }
    }
  }
};

}  // namespace cutlass::gemm::collective::detail

namespace esmc_qmm {
using namespace cute;
using Bf16 = cutlass::bfloat16_t;

// The weight is the builder's A operand (a narrow operand must pass through registers), so the
// problem is given swapped, (N, M, K), and the output is column-major in (N, M): y row-major.
using QmmTile = Shape<_128, _256, _64>;  // weight rows, tokens, K: ahead of 128 x 128 at 1024-4096 tokens
// Where whole tiles of either width take as many waves of the SMs, the narrower ones finish
// sooner: the 6B's o_proj at 1024 tokens, 80 or 120 tiles on 132 SMs, 32 -> 28 us.
using QmmTile192 = Shape<_128, _192, _64>;
// And for few tokens: 128 wide, where whole tiles of it still take one wave.
using QmmTile128 = Shape<_128, _128, _64>;

// A 16 x 16 block of the weight (rows, K) -> its elements' places among the block's 256, such that
// the eight values each thread of a warp holds in wgmma's A register fragment for one k-block
// (PTX ISA, "Register fragment for matrix A": lane 4g + t holds rows g and g + 8, columns 2t, 2t + 1,
// 2t + 8, 2t + 9) lie side by side, in the fragment's order: 32 bits a thread for 4-bit weights, 64
// for 8-bit, so each thread reads its k-block's weights from shared memory in one load instead of
// four sub-word ones. Tiled over the weight, rows first (cutlass_qmm.reorder makes the copy).
using ReorderAtom = Layout<Shape<Shape<_8, _2>, Shape<_2, _4, _2>>, Stride<Stride<_32, _2>, Stride<_1, _8, _4>>>;
using ReorderedWeight = decltype(tile_to_shape(ReorderAtom{}, Shape<int, int, int>{}));

// The builder's A operand for a weight of ``Quant``: affine (scale and bias a group), or mxfp4's
// values with their scale pairs.
template <class Quant>
struct Operand {
  using type = cute::tuple<Quant, Bf16, Bf16>;
};
template <>
struct Operand<cutlass::float_e2m1_t> {
  using type = cute::tuple<cutlass::float_e2m1_t, Mxfp4Scales>;
};

// Tile stays a parameter: with nothing of the epilogue's type depending on one, nvcc's host pass
// rejected its CollectiveBuilder.
// ``Out``: bf16, or split-K's fp32 partial products.
template <class Quant, class Scheduler, class Tile, class WeightLayout, class Out>
struct MixedGemm {
  using Cluster = Shape<_1, _1, _1>;
  static constexpr int out_alignment = 128 / cutlass::sizeof_bits<Out>::value;  // 16-byte stores
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor, out_alignment,
      Out, cutlass::layout::ColumnMajor, out_alignment, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Operand<Quant>::type, WeightLayout,
      128 / cutlass::sizeof_bits<Quant>::value, Bf16, cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
};

// The K one row of the scales covers: a group, or mxfp4's pair of 32-wide groups (Mxfp4Scales).
constexpr int scale_row_k(bool mxfp4, int group_size) { return mxfp4 ? 64 : group_size; }

inline int sm_count() {
  static int count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  return count;
}

// The driver's handle of one of this library's kernels, for MLX's graph: this library links its
// own CUDA runtime, which MLX's does not know, so MLX gets the handle (one per context, shared by
// both runtimes), not the runtime's symbol.
inline CUfunction driver_handle(const void* kernel) {
  cudaFunction_t f = nullptr;
  cudaGetFuncBySymbol(&f, kernel);
  if (!f) throw std::runtime_error("[cutlass_qmm] could not find a kernel");
  return reinterpret_cast<CUfunction>(f);
}

// ``inputs``: x, q, then the scales and biases, or mxfp4's scale pairs (one per 64 along K).
// ``out``: [M, N] (Out bf16), or [splits, M, N] (fp32): K's ``splits`` slabs as the GEMM's batch.
template <class Quant, class Scheduler, class Tile, class WeightLayout, class Out = Bf16>
void launch(const std::vector<mx::array>& inputs, mx::array& out, int group_size, int splits,
            mx::cu::CommandEncoder& encoder) {
  constexpr bool mxfp4 = std::is_same_v<Quant, cutlass::float_e2m1_t>;
  constexpr bool reordered = std::is_same_v<WeightLayout, ReorderedWeight>;
  const mx::array &x = inputs[0], &q = inputs[1], &scales = inputs[2];
  using Kernel = typename MixedGemm<Quant, Scheduler, Tile, WeightLayout, Out>::Kernel;
  constexpr bool stream_k = std::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>;
  int k = x.shape(-1), m = static_cast<int>(x.size() / k), n = out.shape(-1), slab = k / splits;
  // Slab l of K: columns l * slab on of x and of the weight; in the reordered weight the 16 x 16
  // blocks run rows first, then K, so a slab is a contiguous run of them.
  auto stride_q = [&] {
    if constexpr (reordered)
      return tile_to_shape(ReorderAtom{}, make_shape(n, slab, splits));
    else
      return make_stride(int64_t(k), Int<1>{}, int64_t(slab));
  }();
  auto stride_x = make_stride(int64_t(k), Int<1>{}, int64_t(slab));
  typename Kernel::StrideD stride_y{};
  get<1>(stride_y) = int64_t(n);
  get<2>(stride_y) = int64_t(m) * n;
  typename Kernel::CollectiveMainloop::StrideScale stride_s{};
  get<1>(stride_s) = int64_t(n);
  get<2>(stride_s) = int64_t(slab / scale_row_k(mxfp4, group_size)) * n;  // a slab's rows of scales
  cutlass::KernelHardwareInfo hw{0, sm_count()};
  typename Kernel::CollectiveMainloop::Arguments mainloop;
  if constexpr (mxfp4)
    mainloop = {static_cast<typename Kernel::ElementA const*>(mx::gpu_ptr<void>(q)), stride_q, mx::gpu_ptr<Bf16>(x),
                stride_x, mx::gpu_ptr<Mxfp4Scales>(scales), stride_s, 2 * group_size};
  else
    mainloop = {static_cast<typename Kernel::ElementA const*>(mx::gpu_ptr<void>(q)), stride_q, mx::gpu_ptr<Bf16>(x),
                stride_x, mx::gpu_ptr<Bf16>(scales), stride_s, group_size, mx::gpu_ptr<Bf16>(inputs[3])};
  typename Kernel::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {n, m, slab, splits},
                                  mainloop,
                                  {{1.0f, 0.0f}, nullptr, {}, mx::gpu_ptr<Out>(out), stride_y},
                                  hw};
  if constexpr (stream_k) {
    // Every output tile's K shared among the SMs, not only a ragged last wave's (CUTLASS's own
    // heuristic keeps whole tiles when the last wave is at least half full, as the 6B's
    // 2560-row weights make it at 1024 tokens: 80 tiles on 132 SMs).
    args.scheduler.decomposition_mode = cutlass::gemm::kernel::detail::DecompositionMode::StreamK;
    args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
  }
  if (Kernel::can_implement(args) == false) throw std::runtime_error("[cutlass_qmm] CUTLASS cannot take this problem");
  // Stream-K's partial sums and the flags that order their fix-up live in a workspace that only
  // this call uses; its flags must start at zero (CUTLASS's initialize_workspace: a memset,
  // captured into MLX's graph ahead of the kernel).
  size_t workspace_size = Kernel::get_workspace_size(args);
  void* workspace_ptr = nullptr;
  mx::array workspace({static_cast<int>(std::max<size_t>(workspace_size, 1))}, mx::uint8, nullptr, {});
  if (workspace_size != 0) {
    if constexpr (!stream_k) throw std::runtime_error("[cutlass_qmm] needs a workspace");
    workspace.set_data(mx::allocator::malloc(workspace.nbytes()));
    encoder.add_temporary(workspace);
    workspace_ptr = mx::gpu_ptr<void>(workspace);
    encoder.set_output_array(workspace);
    mx::cu::CommandEncoder::CaptureContext capture(encoder);
    if (Kernel::initialize_workspace(args, workspace_ptr, encoder.stream()) != cutlass::Status::kSuccess)
      throw std::runtime_error("[cutlass_qmm] could not clear the stream-K workspace");
  }
  auto params = Kernel::to_underlying_arguments(args, workspace_ptr);
  constexpr int smem = Kernel::SharedStorageSize;
  static bool attribute_set = [] {
    return cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) ==
           cudaSuccess;
  }();
  if (!attribute_set) throw std::runtime_error("[cutlass_qmm] could not set the kernel's shared memory");
  static CUfunction function = driver_handle(reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>));
  for (auto& a : inputs) encoder.set_input_array(a);
  if (workspace_ptr) encoder.set_input_array(workspace);
  encoder.set_output_array(out);
  encoder.add_kernel_node_ex(function, Kernel::get_grid_shape(params), Kernel::get_block_shape(),
                             dim3{}, smem, params);
}

// Every launch the primitive makes for a weight type Q and layout L: stream-K in the 256-token
// tile, whole tiles of 128, 256 and 192 tokens into bf16, split-K's slabs of 128 and 256 into fp32.
#define ESMC_QMM_LAUNCHES(DO, Q, L)                                     \
  DO(Q, cutlass::gemm::StreamKScheduler, QmmTile, L, Bf16)             \
  DO(Q, cutlass::gemm::PersistentScheduler, QmmTile128, L, Bf16)       \
  DO(Q, cutlass::gemm::PersistentScheduler, QmmTile, L, Bf16)          \
  DO(Q, cutlass::gemm::PersistentScheduler, QmmTile192, L, Bf16)       \
  DO(Q, cutlass::gemm::PersistentScheduler, QmmTile128, L, float)      \
  DO(Q, cutlass::gemm::PersistentScheduler, QmmTile, L, float)
#define ESMC_QMM_LAUNCH_ARGS const std::vector<mx::array>&, mx::array&, int, int, mx::cu::CommandEncoder&
#define ESMC_QMM_EXTERN(Q, S, T, L, O) extern template void launch<Q, S, T, L, O>(ESMC_QMM_LAUNCH_ARGS);
#define ESMC_QMM_INSTANCE(Q, S, T, L, O) template void launch<Q, S, T, L, O>(ESMC_QMM_LAUNCH_ARGS);
// The six weight types and layouts (the build's -D pairs are these).
#define ESMC_QMM_EACH_WEIGHT(DO)                                             \
  ESMC_QMM_LAUNCHES(DO, cutlass::float_e2m1_t, ReorderedWeight)             \
  ESMC_QMM_LAUNCHES(DO, cutlass::float_e2m1_t, cutlass::layout::RowMajor)   \
  ESMC_QMM_LAUNCHES(DO, cutlass::uint4b_t, ReorderedWeight)                 \
  ESMC_QMM_LAUNCHES(DO, cutlass::uint4b_t, cutlass::layout::RowMajor)       \
  ESMC_QMM_LAUNCHES(DO, uint8_t, ReorderedWeight)                           \
  ESMC_QMM_LAUNCHES(DO, uint8_t, cutlass::layout::RowMajor)

}  // namespace esmc_qmm
