// An MLX primitive for affine-quantized matmuls on Hopper GPUs: CUTLASS's mixed-input GEMM (the
// weight dequantized in registers on its way to the tensor cores; TMA copies; warp-specialized),
// added to MLX's CUDA graph as MLX adds its own kernels. Built on the machine by
// `python -m esmc_mlx.runtime.cutlass_qmm` (esmc_mlx/runtime/cutlass_qmm.py says why C++ and
// what was measured); CUTLASS's headers come with MLX's CUDA wheel.
//
// y[M, N] = x[M, K] @ (scales * q + biases)[N, K]^T: x bfloat16, q MLX's packed weight (4 or 8
// bits, K contiguous), scales and biases bfloat16 and transposed to [K / group, N] (CUTLASS wants
// them N-major), groups of 64 or 128. The caller hands in scales and biases already row-contiguous
// (cutlass_qmm.matmul makes them so once per layer): a contiguous() here would add two graph nodes
// to every call; eval_gpu refuses any input that is not.
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

namespace mx = mlx::core;
namespace nb = nanobind;
namespace esmc_qmm {
using namespace cute;
using Bf16 = cutlass::bfloat16_t;

// The weight is the builder's A operand (a narrow operand must pass through registers), so the
// problem is given swapped, (N, M, K), and the output is column-major in (N, M): y row-major.
template <class Quant, class Tile>
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
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
};

int sm_count() {
  static int count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  return count;
}

template <class Quant, class Tile>
void launch(const mx::array& x, const mx::array& q, const mx::array& scales, const mx::array& biases, mx::array& out,
            int group_size, mx::cu::CommandEncoder& encoder) {
  using Kernel = typename MixedGemm<Quant, Tile>::Kernel;
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
  if (Kernel::get_workspace_size(args) != 0) throw std::runtime_error("[cutlass_qmm] needs a workspace");
  if (Kernel::can_implement(args) == false) throw std::runtime_error("[cutlass_qmm] CUTLASS cannot take this problem");
  auto params = Kernel::to_underlying_arguments(args, nullptr);
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
  encoder.set_output_array(out);
  encoder.add_kernel_node_ex(function, Kernel::get_grid_shape(params), Kernel::get_block_shape(),
                             dim3{}, smem, params);
}

class CutlassQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  CutlassQuantizedMatmul(mx::Stream stream, int bits, int group_size, int tile_n)
      : mx::UnaryPrimitive(stream), bits_(bits), group_size_(group_size), tile_n_(tile_n) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[cutlass_qmm] runs on a CUDA GPU only");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (auto& a : inputs)
      if (!a.flags().row_contiguous) throw std::runtime_error("[cutlass_qmm] inputs must be row-contiguous");
    auto& encoder = mx::cu::get_command_encoder(stream());
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto go = [&]<class Quant>() {
      if (tile_n_ == 128)
        launch<Quant, Shape<_128, _128, _64>>(inputs[0], inputs[1], inputs[2], inputs[3], out, group_size_, encoder);
      else
        launch<Quant, Shape<_128, _256, _64>>(inputs[0], inputs[1], inputs[2], inputs[3], out, group_size_, encoder);
    };
    if (bits_ == 4)
      go.template operator()<cutlass::uint4b_t>();
    else
      go.template operator()<uint8_t>();
  }

  const char* name() const override { return "CutlassQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CutlassQuantizedMatmul&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && tile_n_ == o.tile_n_;
  }

 private:
  int bits_, group_size_, tile_n_;
};

mx::array quantized_matmul(const mx::array& x, const mx::array& q, const mx::array& scales_t,
                           const mx::array& biases_t, int bits, int group_size, int tile_n) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("[cutlass_qmm] bits must be 4 or 8");
  if (group_size != 64 && group_size != 128) throw std::invalid_argument("[cutlass_qmm] group_size must be 64 or 128");
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
                     std::make_shared<CutlassQuantizedMatmul>(mx::default_stream(mx::Device::gpu), bits, group_size, tile_n),
                     {x2, q, scales_t, biases_t});
  return mx::reshape(y, lead);
}

}  // namespace esmc_qmm

NB_MODULE(_cutlass_qmm, m) {
  nb::module_::import_("mlx.core");
  m.def("quantized_matmul", &esmc_qmm::quantized_matmul, nb::arg("x"), nb::arg("q"), nb::arg("scales_t"), nb::arg("biases_t"),
        nb::arg("bits"), nb::arg("group_size"), nb::arg("tile_n") = 256,
        "x @ dequantize(q).T by CUTLASS's Hopper mixed-input GEMM; scales and biases transposed to [K / group, N].");
}
