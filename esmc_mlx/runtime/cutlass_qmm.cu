// An MLX primitive for affine-quantized matmuls on Hopper GPUs: CUTLASS's mixed-input GEMM (the
// weight dequantized in registers on its way to the tensor cores; TMA copies; warp-specialized),
// added to MLX's CUDA graph as MLX adds its own kernels. Built on the machine by
// `esmc-mlx build-cutlass` (esmc_mlx/runtime/cutlass_qmm.py says why C++ and what was measured);
// CUTLASS's headers come with MLX's CUDA wheel.
//
// y[M, N] = x[M, K] @ (scales * q + biases)[N, K]^T: x bfloat16, q MLX's packed weight (4 or 8
// bits, K contiguous), scales and biases bfloat16 and transposed to [K / group, N] (CUTLASS wants
// them N-major), groups of 64 or 128. The caller hands in scales and biases already row-contiguous
// (cutlass_qmm.matmul makes them so once per layer): a contiguous() here would add two graph nodes
// to every call; eval_gpu refuses any input that is not.
//
// Two schedules: "persistent" (each SM takes whole output tiles) and "stream-k" (the tiles' K
// iterations shared evenly among the SMs, partial sums fixed up through a workspace in a fixed
// order: deterministic); and two tiles, 128 x 256 and 128 x 192 (weight rows x tokens), the
// narrow one persistent only. Which a call takes is cutlass_qmm.schedule's.
#include <nanobind/nanobind.h>

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
namespace nb = nanobind;
namespace esmc_qmm {
using namespace cute;
using Bf16 = cutlass::bfloat16_t;

// The weight is the builder's A operand (a narrow operand must pass through registers), so the
// problem is given swapped, (N, M, K), and the output is column-major in (N, M): y row-major.
using QmmTile = Shape<_128, _256, _64>;  // weight rows, tokens, K: ahead of 128 x 128 at 1024-4096 tokens
// Where whole tiles of either width take as many waves of the SMs, the narrower ones finish
// sooner: the 6B's o_proj at 1024 tokens, 80 or 120 tiles on 132 SMs, 32 -> 28 us.
using QmmTile192 = Shape<_128, _192, _64>;

// Tile stays a parameter: with nothing of the epilogue's type depending on one, nvcc's host pass
// rejected its CollectiveBuilder.
template <class Quant, class Scheduler, class Tile>
struct MixedGemm {
  using Cluster = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor, 8, Bf16,
      cutlass::layout::ColumnMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<Quant, Bf16, Bf16>, cutlass::layout::RowMajor,
      128 / cutlass::sizeof_bits<Quant>::value, Bf16, cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
};

int sm_count() {
  static int count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  return count;
}

template <class Quant, class Scheduler, class Tile>
void launch(const mx::array& x, const mx::array& q, const mx::array& scales, const mx::array& biases, mx::array& out,
            int group_size, mx::cu::CommandEncoder& encoder) {
  using Kernel = typename MixedGemm<Quant, Scheduler, Tile>::Kernel;
  constexpr bool stream_k = std::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>;
  int m = x.shape(0), k = x.shape(1), n = out.shape(1);
  auto stride_q = make_stride(int64_t(k), Int<1>{}, int64_t(0));
  auto stride_x = make_stride(int64_t(k), Int<1>{}, int64_t(0));
  typename Kernel::StrideD stride_y{};
  get<1>(stride_y) = int64_t(n);
  typename Kernel::CollectiveMainloop::StrideScale stride_s{};
  get<1>(stride_s) = int64_t(n);
  cutlass::KernelHardwareInfo hw{0, sm_count()};
  typename Kernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {n, m, k, 1},
      {static_cast<typename Kernel::ElementA const*>(mx::gpu_ptr<void>(q)), stride_q, mx::gpu_ptr<Bf16>(x), stride_x,
       mx::gpu_ptr<Bf16>(scales), stride_s, group_size, mx::gpu_ptr<Bf16>(biases)},
      {{1.0f, 0.0f}, nullptr, {}, mx::gpu_ptr<Bf16>(out), stride_y},
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
  // This library links its own CUDA runtime, which MLX's does not know: hand MLX the driver's
  // handle of the kernel (one per context, shared by both runtimes), not the runtime's symbol.
  static CUfunction function = [] {
    cudaFunction_t f = nullptr;
    cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>));
    return reinterpret_cast<CUfunction>(f);
  }();
  if (!function) throw std::runtime_error("[cutlass_qmm] could not find the kernel");
  encoder.set_input_array(x);
  encoder.set_input_array(q);
  encoder.set_input_array(scales);
  encoder.set_input_array(biases);
  if (workspace_ptr) encoder.set_input_array(workspace);
  encoder.set_output_array(out);
  encoder.add_kernel_node_ex(function, Kernel::get_grid_shape(params), Kernel::get_block_shape(),
                             dim3{}, smem, params);
}

class CutlassQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  CutlassQuantizedMatmul(mx::Stream stream, int bits, int group_size, bool stream_k, int tile_tokens)
      : mx::UnaryPrimitive(stream), bits_(bits), group_size_(group_size), stream_k_(stream_k), tile_tokens_(tile_tokens) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[cutlass_qmm] runs on a CUDA GPU only");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (auto& a : inputs)
      if (!a.flags().row_contiguous) throw std::runtime_error("[cutlass_qmm] inputs must be row-contiguous");
    auto& encoder = mx::cu::get_command_encoder(stream());
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto go = [&]<class Quant>() {
      if (stream_k_)
        launch<Quant, cutlass::gemm::StreamKScheduler, QmmTile>(inputs[0], inputs[1], inputs[2], inputs[3], out,
                                                                group_size_, encoder);
      else if (tile_tokens_ == 192)
        launch<Quant, cutlass::gemm::PersistentScheduler, QmmTile192>(inputs[0], inputs[1], inputs[2], inputs[3], out,
                                                                      group_size_, encoder);
      else
        launch<Quant, cutlass::gemm::PersistentScheduler, QmmTile>(inputs[0], inputs[1], inputs[2], inputs[3], out,
                                                                   group_size_, encoder);
    };
    if (bits_ == 4)
      go.template operator()<cutlass::uint4b_t>();
    else
      go.template operator()<uint8_t>();
  }

  const char* name() const override { return "CutlassQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CutlassQuantizedMatmul&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && stream_k_ == o.stream_k_ &&
           tile_tokens_ == o.tile_tokens_;
  }

 private:
  int bits_, group_size_;
  bool stream_k_;
  int tile_tokens_;
};

mx::array quantized_matmul(const mx::array& x, const mx::array& q, const mx::array& scales_t,
                           const mx::array& biases_t, int bits, int group_size, bool stream_k, int tile_tokens) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("[cutlass_qmm] bits must be 4 or 8");
  if (group_size != 64 && group_size != 128) throw std::invalid_argument("[cutlass_qmm] group_size must be 64 or 128");
  if (tile_tokens != 192 && tile_tokens != 256) throw std::invalid_argument("[cutlass_qmm] tile_tokens must be 192 or 256");
  // Built for the wide tile only: the narrow one is for calls whose whole tiles fit the waves.
  if (stream_k && tile_tokens != 256) throw std::invalid_argument("[cutlass_qmm] stream-K runs 256-token tiles only");
  if (x.dtype() != mx::bfloat16 || scales_t.dtype() != mx::bfloat16 || biases_t.dtype() != mx::bfloat16)
    throw std::invalid_argument("[cutlass_qmm] x, scales and biases must be bfloat16");
  int k = x.shape(-1), n = q.shape(0);
  if (q.ndim() != 2 || q.shape(1) * 32 / bits != k) throw std::invalid_argument("[cutlass_qmm] weight and x disagree");
  if (scales_t.shape(0) != k / group_size || scales_t.shape(1) != n || biases_t.shape() != scales_t.shape())
    throw std::invalid_argument("[cutlass_qmm] scales and biases must be [K / group_size, N]");
  auto lead = x.shape();
  lead.back() = n;
  auto x2 = mx::contiguous(mx::reshape(x, {-1, k}));
  int m = x2.shape(0);
  auto y = mx::array({m, n}, mx::bfloat16,
                     std::make_shared<CutlassQuantizedMatmul>(mx::default_stream(mx::Device::gpu), bits, group_size, stream_k,
                                                              tile_tokens),
                     {x2, q, scales_t, biases_t});
  return mx::reshape(y, lead);
}

}  // namespace esmc_qmm

NB_MODULE(_cutlass_qmm, m) {
  nb::module_::import_("mlx.core");
  m.def("quantized_matmul", &esmc_qmm::quantized_matmul, nb::arg("x"), nb::arg("q"), nb::arg("scales_t"), nb::arg("biases_t"),
        nb::arg("bits"), nb::arg("group_size"), nb::arg("stream_k") = false, nb::arg("tile_tokens") = 256,
        "x @ dequantize(q).T by CUTLASS's Hopper mixed-input GEMM; scales and biases transposed to [K / group, N];\n"
        "stream_k: the tiles' K shared among the SMs (else whole tiles each); tile_tokens: 256 or 192.");
  m.def("sm_count", &esmc_qmm::sm_count, "The GPU's streaming multiprocessors (the waves tiles fill).");
}
