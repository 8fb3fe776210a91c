// An MLX primitive for affine-quantized matmuls on Hopper GPUs: CUTLASS's mixed-input GEMM (the
// weight dequantized in registers on its way to the tensor cores; TMA copies; warp-specialized),
// added to MLX's CUDA graph as MLX adds its own kernels. Built on the machine by
// `esmc-mlx build-cutlass` (cutlass_qmm.py beside this says why C++);
// CUTLASS's headers come with MLX's CUDA wheel.
//
// y[M, N] = x[M, K] @ (scales * q + biases)[N, K]^T: x bfloat16, q MLX's packed weight (4 or 8
// bits, K contiguous), scales and biases bfloat16 and transposed to [K / group, N] (CUTLASS wants
// them N-major), groups of 64 or 128. x and the output keep their leading dimensions (no reshape)
// and no contiguous() is added: each such graph node costs MLX's host a few us a call, on every
// call. The layers hand over row-contiguous
// arrays (cutlass_qmm.matmul makes the scales so once per layer); eval_gpu copies any other input
// with a kernel of its own (MLX's copy is not exported to extensions).
//
// Three schedules: "persistent" (each SM takes whole output tiles), "stream-k" (the tiles' K
// iterations shared evenly among the SMs, partial sums fixed up through a workspace in a fixed
// order: deterministic) and "split-k" (K cut into ``splits`` equal slabs run as a batch of
// whole-tile GEMMs side by side, each writing its fp32 partial product, then summed in order by a
// second kernel: no SM waits on another, where stream-K's and CUTLASS's split-K fix-ups are
// serial; that kernel also adds the residual stream when handed one, the o_proj's and
// down_proj's ``x + h / scale``, and the LayerNorm after it when handed its weights); and three tiles, 128 x 256, 128 x 192 and 128 x 128 (weight rows x
// tokens), stream-K in the 256-token one only, split-K in the 256- or 128-token one. Which a call
// takes is runtime/dispatch.py's (cutlass_schedule). The weight comes in MLX's layout or, as the
// layers hand it over, reordered (ReorderAtom below; cutlass_qmm.reorder): 0.84-0.95x a call's
// time in MLX's layout for affine 4-bit weights, 0.93-0.99x for 8-bit, 0.89-0.96x for mxfp4.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>

#include "cutlass_qmm_gemm.cuh"
#include "layer_norm_rows.cuh"  // MLX's LayerNorm row layout and sums, shared with rows.cu

namespace nb = nanobind;

namespace esmc_qmm {

ESMC_QMM_EACH_WEIGHT(ESMC_QMM_EXTERN)

// y = the sum of ``splits`` fp32 partial products [splits][count], in order, rounded once to bf16
// (as the epilogue rounds a whole-K tile); four values a thread. With a ``residual`` r, y = r + that
// sum / scale instead: ESMC's scaled residual add, each operation a bf16 one as MLX's ops compute
// ``r + h / scale`` (its Divide and Add), so the values are theirs bit for bit. nvcc's unrolled
// loop already overlaps the slabs' loads (issuing them all first took the same time).
__global__ void sum_splits(const float4* __restrict__ parts, const uint2* __restrict__ residual, uint2* __restrict__ y,
                           int quads, int splits, unsigned short scale_bits) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= quads) return;
  float4 s = parts[i];
  for (int p = 1; p < splits; ++p) {
    float4 v = parts[i + int64_t(p) * quads];
    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
  }
  __nv_bfloat16 h[4] = {__float2bfloat16_rn(s.x), __float2bfloat16_rn(s.y), __float2bfloat16_rn(s.z),
                        __float2bfloat16_rn(s.w)};
  if (residual) {
    const uint2 packed = residual[i];
    const __nv_bfloat16* r = reinterpret_cast<const __nv_bfloat16*>(&packed);
    const __nv_bfloat16 scale = __ushort_as_bfloat16(scale_bits);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = r[j] + h[j] / scale;
  }
  y[i] = *reinterpret_cast<const uint2*>(h);
}

// sum_splits' residual stream, y = r + (the slabs' sum) / scale, and mx.fast.layer_norm of it
// (``weight``, ``bias`` or none, ``eps``) into ``normed`` in the same pass: one block a row of
// ``n``, thread t holding columns 8t .. 8t + 7, the statistics by layer_norm_rows.cuh's row_stats
// (MLX's layer_norm.cu in its order, as rows.cu's add_layer_norm), so both outputs are MLX's
// ops' values bit for bit. It spares the LayerNorm's own kernel and graph node after each o_proj
// and down_proj that runs split-K.
__global__ void sum_splits_norm(const float* __restrict__ parts, const __nv_bfloat16* __restrict__ residual,
                                __nv_bfloat16* __restrict__ y, __nv_bfloat16* __restrict__ normed,
                                const __nv_bfloat16* __restrict__ weight, const __nv_bfloat16* __restrict__ bias,
                                int n, int splits, int64_t slab_size, unsigned short scale_bits, float eps) {
  __shared__ float warp_sums[2][1][32];
  const int c = 8 * threadIdx.x;
  const bool active = c < n;
  const int64_t at = int64_t(blockIdx.x) * n + c;
  __align__(16) __nv_bfloat16 r[1][8];
#pragma unroll
  for (int i = 0; i < 8; ++i) r[0][i] = __float2bfloat16_rn(0.0f);
  if (active) {
    const float4* p = reinterpret_cast<const float4*>(parts + at);
    float4 lo = p[0], hi = p[1];
    for (int s = 1; s < splits; ++s) {
      const float4* q = reinterpret_cast<const float4*>(parts + at + s * slab_size);
      const float4 a = q[0], b = q[1];
      lo.x += a.x, lo.y += a.y, lo.z += a.z, lo.w += a.w;
      hi.x += b.x, hi.y += b.y, hi.z += b.z, hi.w += b.w;
    }
    const float sums[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    __align__(16) __nv_bfloat16 xs[8];
    ::move<8>(xs, residual + at);
    const __nv_bfloat16 scale = __ushort_as_bfloat16(scale_bits);
#pragma unroll
    for (int i = 0; i < 8; ++i) r[0][i] = xs[i] + __float2bfloat16_rn(sums[i]) / scale;
    ::move<8>(y + at, r[0]);
  }
  float mean[1], rstd[1];
  ::row_stats<1, 8>(r, active, n, eps, warp_sums, mean, rstd);
  if (active) {
    __align__(16) __nv_bfloat16 w[8], b[8], out[8];
    ::move<8>(w, weight + c);
    if (bias)
      ::move<8>(b, bias + c);
    else
#pragma unroll
      for (int i = 0; i < 8; ++i) b[i] = __float2bfloat16_rn(0.0f);  // mx.fast.layer_norm adds a zero bias
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float norm = (__bfloat162float(r[0][i]) - mean[0]) * rstd[0];
      out[i] = w[i] * __float2bfloat16_rn(norm) + b[i];
    }
    ::move<8>(normed + at, out);
  }
}


// A strided (or broadcast) array's shape and strides, in elements, for strided_copy.
struct Strided {
  static constexpr int max_dims = 8;
  int ndim;
  int64_t shape[max_dims], strides[max_dims];
};

// out[i] = the i-th element of ``in`` in row-major order: a row-contiguous copy, one element a thread.
template <class T>
__global__ void strided_copy(const T* __restrict__ in, T* __restrict__ out, int64_t size, Strided dims) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size) return;
  int64_t at = 0, rest = i;
  for (int d = dims.ndim - 1; d >= 0; --d) {
    at += (rest % dims.shape[d]) * dims.strides[d];
    rest /= dims.shape[d];
  }
  out[i] = in[at];
}

// ``a`` itself where it is row-contiguous (every array the layers hand over), else a row-contiguous
// copy made by strided_copy ahead of the kernels that read it.
mx::array row_contiguous(const mx::array& a, mx::cu::CommandEncoder& encoder) {
  if (a.flags().row_contiguous) return a;
  if (a.ndim() > Strided::max_dims) throw std::invalid_argument("[cutlass_qmm] inputs of at most 8 dimensions");
  Strided dims{static_cast<int>(a.ndim()), {}, {}};
  for (int d = 0; d < dims.ndim; ++d) dims.shape[d] = a.shape(d), dims.strides[d] = a.strides(d);
  mx::array copy(a.shape(), a.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  encoder.add_temporary(copy);
  encoder.set_input_array(a);
  encoder.set_output_array(copy);
  int64_t size = a.size();
  constexpr int threads = 256;
  dim3 blocks(static_cast<unsigned>((size + threads - 1) / threads));
  auto go = [&]<class T>() {
    static CUfunction f = driver_handle(reinterpret_cast<const void*>(&strided_copy<T>));
    encoder.add_kernel_node_ex(f, blocks, dim3(threads), dim3{}, 0, mx::gpu_ptr<T>(a), mx::gpu_ptr<T>(copy), size,
                               dims);
  };
  switch (a.itemsize()) {
    case 1: go.template operator()<uint8_t>(); break;
    case 2: go.template operator()<uint16_t>(); break;
    case 4: go.template operator()<uint32_t>(); break;
    default: throw std::invalid_argument("[cutlass_qmm] inputs of 1, 2 or 4 bytes an element");
  }
  return copy;
}

// Outputs: the product (or the residual stream it is added to), then, where split-K's sum also
// normalizes (``norm``), the LayerNorm of that stream.
class CutlassQuantizedMatmul : public mx::Primitive {
 public:
  CutlassQuantizedMatmul(mx::Stream stream, bool mxfp4, int bits, int group_size, bool stream_k, int tile_tokens,
                         bool reordered, int splits, bool residual, float scale, bool norm, bool norm_bias, float eps)
      : mx::Primitive(stream),
        mxfp4_(mxfp4),
        bits_(bits),
        group_size_(group_size),
        stream_k_(stream_k),
        tile_tokens_(tile_tokens),
        reordered_(reordered),
        splits_(splits),
        residual_(residual),
        scale_(scale),
        norm_(norm),
        norm_bias_(norm_bias),
        eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[cutlass_qmm] runs on a CUDA GPU only");
  }

  // ``given``: the GEMM's inputs, then the residual where one is added, then the LayerNorm's
  // weight and its bias (where it has one) where the sum normalizes.
  void eval_gpu(const std::vector<mx::array>& given, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cu::get_command_encoder(stream());
    std::vector<mx::array> all_inputs;
    for (auto& a : given) all_inputs.push_back(row_contiguous(a, encoder));
    const int extras = residual_ + norm_ + norm_bias_;
    const std::vector<mx::array> inputs(all_inputs.begin(), all_inputs.end() - extras);
    const std::vector<mx::array> extra(all_inputs.end() - extras, all_inputs.end());
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    mx::array& out = outputs[0];
    auto go = [&]<class Quant, class WeightLayout>() {
      if (splits_ > 1)
        split_k<Quant, WeightLayout>(inputs, extra, outputs, encoder);
      else if (stream_k_)
        launch<Quant, cutlass::gemm::StreamKScheduler, QmmTile, WeightLayout>(inputs, out, group_size_, 1, encoder);
      else
        whole_tiles<Quant, WeightLayout, Bf16>(inputs, out, 1, encoder);
    };
    using RowMajor = cutlass::layout::RowMajor;
    if (mxfp4_ && reordered_)
      go.template operator()<cutlass::float_e2m1_t, ReorderedWeight>();
    else if (mxfp4_)
      go.template operator()<cutlass::float_e2m1_t, RowMajor>();
    else if (bits_ == 4 && reordered_)
      go.template operator()<cutlass::uint4b_t, ReorderedWeight>();
    else if (bits_ == 4)
      go.template operator()<cutlass::uint4b_t, RowMajor>();
    else if (reordered_)
      go.template operator()<uint8_t, ReorderedWeight>();
    else
      go.template operator()<uint8_t, RowMajor>();
  }

  const char* name() const override { return "CutlassQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CutlassQuantizedMatmul&>(other);
    return mxfp4_ == o.mxfp4_ && bits_ == o.bits_ && group_size_ == o.group_size_ && stream_k_ == o.stream_k_ &&
           tile_tokens_ == o.tile_tokens_ && reordered_ == o.reordered_ && splits_ == o.splits_ &&
           residual_ == o.residual_ && scale_ == o.scale_ && norm_ == o.norm_ && norm_bias_ == o.norm_bias_ &&
           eps_ == o.eps_;
  }

 private:
  // Whole tiles of tile_tokens_ (persistent scheduler) into ``out``: bf16, or split-K's fp32 slabs
  // (``splits`` of K), which check_tiles gives the 128- and 256-token tiles only.
  template <class Quant, class WeightLayout, class Out>
  void whole_tiles(const std::vector<mx::array>& inputs, mx::array& out, int splits, mx::cu::CommandEncoder& encoder) {
    using cutlass::gemm::PersistentScheduler;
    if (tile_tokens_ == 128)
      launch<Quant, PersistentScheduler, QmmTile128, WeightLayout, Out>(inputs, out, group_size_, splits, encoder);
    else if (tile_tokens_ == 256)
      launch<Quant, PersistentScheduler, QmmTile, WeightLayout, Out>(inputs, out, group_size_, splits, encoder);
    else if constexpr (std::is_same_v<Out, Bf16>)
      launch<Quant, PersistentScheduler, QmmTile192, WeightLayout, Out>(inputs, out, group_size_, splits, encoder);
    else
      throw std::invalid_argument("[cutlass_qmm] split-K has no 192-token tile");
  }

  // The slabs' partial products into a temporary fp32 [splits, M, N], then their sum (added to the
  // residual, ``extra``'s first, when given; normalized too by the LayerNorm weight and bias after
  // it, when ``norm_``) into the outputs.
  template <class Quant, class WeightLayout>
  void split_k(const std::vector<mx::array>& inputs, const std::vector<mx::array>& extra,
               std::vector<mx::array>& outputs, mx::cu::CommandEncoder& encoder) {
    mx::array& out = outputs[0];
    int n = out.shape(-1), rows = static_cast<int>(out.size() / n);  // not const: kernel arguments
    mx::array parts({splits_, rows, n}, mx::float32, nullptr, {});
    parts.set_data(mx::allocator::malloc(parts.nbytes()));
    encoder.add_temporary(parts);
    whole_tiles<Quant, WeightLayout, float>(inputs, parts, splits_, encoder);
    encoder.set_input_array(parts);
    for (auto& a : extra) encoder.set_input_array(a);
    for (auto& o : outputs) encoder.set_output_array(o);
    // MLX's own rounding of a Python float to bf16 (as ``h / scale`` rounds the scalar).
    unsigned short scale_bits = std::bit_cast<unsigned short>(mx::bfloat16_t(scale_));
    if (norm_) {
      static CUfunction sum_norm = driver_handle(reinterpret_cast<const void*>(&sum_splits_norm));
      const __nv_bfloat16* bias = norm_bias_ ? mx::gpu_ptr<__nv_bfloat16>(extra[2]) : nullptr;
      encoder.add_kernel_node_ex(sum_norm, dim3(rows), dim3((n / 8 + 31) / 32 * 32), dim3{}, 0,
                                 mx::gpu_ptr<float>(parts), mx::gpu_ptr<__nv_bfloat16>(extra[0]),
                                 mx::gpu_ptr<__nv_bfloat16>(out), mx::gpu_ptr<__nv_bfloat16>(outputs[1]),
                                 mx::gpu_ptr<__nv_bfloat16>(extra[1]), bias, n, splits_, int64_t(rows) * n,
                                 scale_bits, eps_);
      return;
    }
    static CUfunction sum = driver_handle(reinterpret_cast<const void*>(&sum_splits));
    int quads = static_cast<int>(out.size() / 4);  // N is a multiple of 8
    constexpr int threads = 256;
    encoder.add_kernel_node_ex(sum, dim3((quads + threads - 1) / threads), dim3(threads), dim3{}, 0,
                               mx::gpu_ptr<float4>(parts), residual_ ? mx::gpu_ptr<uint2>(extra[0]) : nullptr,
                               mx::gpu_ptr<uint2>(out), quads, splits_, scale_bits);
  }

  bool mxfp4_;
  int bits_, group_size_;
  bool stream_k_;
  int tile_tokens_;
  bool reordered_;
  int splits_;
  bool residual_;
  float scale_;
  bool norm_, norm_bias_;
  float eps_;
};

void check_tiles(bool stream_k, int tile_tokens, int splits) {
  if (tile_tokens != 128 && tile_tokens != 192 && tile_tokens != 256)
    throw std::invalid_argument("[cutlass_qmm] tile_tokens must be 128, 192 or 256");
  // Built for the tiles cutlass_qmm.schedule gives each: the narrow ones are for calls whose whole
  // tiles fit the waves.
  if (stream_k && tile_tokens != 256) throw std::invalid_argument("[cutlass_qmm] stream-K runs 256-token tiles only");
  if (splits < 1) throw std::invalid_argument("[cutlass_qmm] splits must be at least 1");
  if (splits > 1 && (stream_k || tile_tokens == 192))
    throw std::invalid_argument("[cutlass_qmm] split-K runs whole 256- or 128-token tiles only (not stream-K)");
}

// The product, or with a LayerNorm's weight handed over, the residual stream and its LayerNorm.
using Result = std::variant<mx::array, std::tuple<mx::array, mx::array>>;

// x [..., K] @ the weight's transpose, [..., N], by a CutlassQuantizedMatmul over ``scales_etc`` after
// x and q; with a ``residual`` [..., N], residual + that / scale (split-K's sum adds it); with a
// ``norm_weight`` too, that and mx.fast.layer_norm(that, norm_weight, norm_bias, eps) (the sum
// normalizes it: sum_splits_norm).
Result run(const mx::array& x, const mx::array& q, std::vector<mx::array> scales_etc, bool mxfp4, int bits,
           int group_size, bool stream_k, int tile_tokens, bool reordered, int splits,
           const std::optional<mx::array>& residual, float scale, const std::optional<mx::array>& norm_weight,
           const std::optional<mx::array>& norm_bias, float eps) {
  if (x.ndim() < 1 || x.shape(-1) < 1) throw std::invalid_argument("[cutlass_qmm] x must be [..., K] with K > 0");
  int k = x.shape(-1), n = q.shape(0);
  if (reordered && (n % 16 != 0 || k % 16 != 0))
    throw std::invalid_argument("[cutlass_qmm] a reordered weight's rows and K must be multiples of 16");
  // Each slab whole K tiles (64) and whole scale groups (mxfp4's pairs: 64).
  int unit = std::max(64, scale_row_k(mxfp4, group_size));
  if (k % (splits * unit) != 0)
    throw std::invalid_argument("[cutlass_qmm] split-K needs K a multiple of splits x " + std::to_string(unit));
  if (x.size() / k > std::numeric_limits<int>::max())
    throw std::invalid_argument("[cutlass_qmm] x must have fewer than 2^31 rows");
  auto shape = x.shape();
  shape.back() = n;
  scales_etc.insert(scales_etc.begin(), {x, q});
  if (residual) {
    if (splits < 2) throw std::invalid_argument("[cutlass_qmm] a residual is added by split-K's sum: splits must be 2 or more");
    if (residual->shape() != shape || residual->dtype() != mx::bfloat16)
      throw std::invalid_argument("[cutlass_qmm] the residual must be bfloat16 and shaped as the product");
    scales_etc.push_back(*residual);
  }
  if (norm_bias && !norm_weight) throw std::invalid_argument("[cutlass_qmm] a LayerNorm bias needs its weight");
  if (norm_weight) {
    if (!residual) throw std::invalid_argument("[cutlass_qmm] split-K's sum normalizes the residual stream it adds: pass the residual");
    for (auto* a : {&norm_weight, &norm_bias})
      if (*a && ((*a)->shape() != mx::Shape{n} || (*a)->dtype() != mx::bfloat16))
        throw std::invalid_argument("[cutlass_qmm] the LayerNorm's weight and bias must be bfloat16 [N]");
    if (n > 8 * 1024) throw std::invalid_argument("[cutlass_qmm] split-K's sum normalizes rows of at most 8192 (a block a row)");
    if (!(eps > 0)) throw std::invalid_argument("[cutlass_qmm] the LayerNorm's eps must be positive");
    scales_etc.push_back(*norm_weight);
    if (norm_bias) scales_etc.push_back(*norm_bias);
  }
  auto primitive = std::make_shared<CutlassQuantizedMatmul>(mx::default_stream(mx::Device::gpu), mxfp4, bits,
                                                            group_size, stream_k, tile_tokens, reordered, splits,
                                                            residual.has_value(), scale, norm_weight.has_value(),
                                                            norm_bias.has_value(), eps);
  if (!norm_weight) return mx::array(shape, mx::bfloat16, std::move(primitive), std::move(scales_etc));
  auto both = mx::array::make_arrays({shape, shape}, {mx::bfloat16, mx::bfloat16}, primitive, scales_etc);
  return std::tuple{both[0], both[1]};
}

Result quantized_matmul(const mx::array& x, const mx::array& q, const mx::array& scales_t, const mx::array& biases_t,
                        int bits, int group_size, bool stream_k, int tile_tokens, bool reordered, int splits,
                        const std::optional<mx::array>& residual, float scale,
                        const std::optional<mx::array>& norm_weight, const std::optional<mx::array>& norm_bias,
                        float eps) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("[cutlass_qmm] bits must be 4 or 8");
  if (group_size != 64 && group_size != 128) throw std::invalid_argument("[cutlass_qmm] group_size must be 64 or 128");
  check_tiles(stream_k, tile_tokens, splits);
  if (x.dtype() != mx::bfloat16 || scales_t.dtype() != mx::bfloat16 || biases_t.dtype() != mx::bfloat16)
    throw std::invalid_argument("[cutlass_qmm] x, scales and biases must be bfloat16");
  int k = x.shape(-1), n = q.shape(0);
  if (q.ndim() != 2 || q.shape(1) * 32 / bits != k) throw std::invalid_argument("[cutlass_qmm] weight and x disagree");
  if (scales_t.shape(0) != k / group_size || scales_t.shape(1) != n || biases_t.shape() != scales_t.shape())
    throw std::invalid_argument("[cutlass_qmm] scales and biases must be [K / group_size, N]");
  return run(x, q, {scales_t, biases_t}, false, bits, group_size, stream_k, tile_tokens, reordered, splits, residual,
             scale, norm_weight, norm_bias, eps);
}

Result mxfp4_matmul(const mx::array& x, const mx::array& q, const mx::array& scale_pairs, bool stream_k, int tile_tokens,
                    bool reordered, int splits, const std::optional<mx::array>& residual, float scale,
                    const std::optional<mx::array>& norm_weight, const std::optional<mx::array>& norm_bias, float eps) {
  check_tiles(stream_k, tile_tokens, splits);
  if (x.dtype() != mx::bfloat16 || scale_pairs.dtype() != mx::uint32)
    throw std::invalid_argument("[cutlass_qmm] x must be bfloat16 and the scale pairs uint32");
  int k = x.shape(-1), n = q.shape(0);
  if (q.ndim() != 2 || q.shape(1) * 8 != k) throw std::invalid_argument("[cutlass_qmm] weight and x disagree");
  if (k % 64 != 0 || scale_pairs.ndim() != 2 || scale_pairs.shape(0) != k / 64 || scale_pairs.shape(1) != n)
    throw std::invalid_argument("[cutlass_qmm] scale pairs must be [K / 64, N]");
  return run(x, q, {scale_pairs}, true, 4, 32, stream_k, tile_tokens, reordered, splits, residual, scale, norm_weight,
             norm_bias, eps);
}

}  // namespace esmc_qmm

NB_MODULE(_cutlass_qmm, m) {
  nb::module_::import_("mlx.core");
  m.def("quantized_matmul", &esmc_qmm::quantized_matmul, nb::arg("x"), nb::arg("q"), nb::arg("scales_t"), nb::arg("biases_t"),
        nb::arg("bits"), nb::arg("group_size"), nb::arg("stream_k") = false, nb::arg("tile_tokens") = 256,
        nb::arg("reordered") = false, nb::arg("splits") = 1, nb::arg("residual").none() = nb::none(),
        nb::arg("scale") = 1.0f, nb::arg("norm_weight").none() = nb::none(), nb::arg("norm_bias").none() = nb::none(),
        nb::arg("eps") = 1e-5f,
        "x @ dequantize(q).T by CUTLASS's Hopper mixed-input GEMM; scales and biases transposed to [K / group, N];\n"
        "stream_k: the tiles' K shared among the SMs (else whole tiles each); tile_tokens: 256, 192 or 128;\n"
        "reordered: q in cutlass_qmm.reorder's layout (ReorderAtom), not MLX's; splits: K in that many\n"
        "slabs, each a batch of whole tiles (256 or 128 tokens), their fp32 partial products summed by a\n"
        "second kernel;\n"
        "residual (splits > 1 only): residual + the product / scale, from that kernel;\n"
        "norm_weight (with residual; norm_bias optional): (that, mx.fast.layer_norm(that, norm_weight, norm_bias,\n"
        "eps)), both from that kernel.");
  m.def("mxfp4_matmul", &esmc_qmm::mxfp4_matmul, nb::arg("x"), nb::arg("q"), nb::arg("scale_pairs"),
        nb::arg("stream_k") = false, nb::arg("tile_tokens") = 256, nb::arg("reordered") = false,
        nb::arg("splits") = 1, nb::arg("residual").none() = nb::none(), nb::arg("scale") = 1.0f,
        nb::arg("norm_weight").none() = nb::none(), nb::arg("norm_bias").none() = nb::none(), nb::arg("eps") = 1e-5f,
        "x @ dequantize(q, mode='mxfp4').T by the same GEMM; scale_pairs [K / 64, N] uint32, each two groups'\n"
        "scales as bf16 (the even group's in the low half).");
  m.def("sm_count", &esmc_qmm::sm_count, "The GPU's streaming multiprocessors (the waves tiles fill).");
}
