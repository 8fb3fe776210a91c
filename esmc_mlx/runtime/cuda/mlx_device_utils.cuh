// What our kernels need of MLX's device header (mlx/backend/cuda/device/utils.cuh, which MLX hands
// NVRTC from memory): its includes and the Shape type, for compiling MLX's generated source here.
#pragma once
#include "mlx/backend/cuda/device/config.h"
#define LIBCUDACXX_ENABLE_SIMPLIFIED_COMPLEX_OPERATIONS
#include <cuda/std/complex>
#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
