"""The CUDA GPU in hand: its architecture as NVRTC names it, and its multiprocessors."""

from __future__ import annotations

import ctypes
import functools

import mlx.core as mx

# cuDeviceGetAttribute's CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT (cuda.h)
_MULTIPROCESSOR_COUNT = 16


@functools.cache
def arch() -> str | None:
    """NVRTC's --gpu-architecture for the default GPU, as MLX picks it (sm_XY, with the
    arch-specific 'a' from compute capability 9 on); None without a CUDA GPU."""
    info = mx.device_info()
    major, minor = info.get("compute_capability_major"), info.get("compute_capability_minor")
    if major is None or minor is None:
        return None
    return f"sm_{int(major)}{int(minor)}{'a' if int(major) >= 9 else ''}"


@functools.cache
def sms() -> int:
    """The default GPU's multiprocessors, from the CUDA driver MLX has loaded (MLX's device_info
    does not report them); 0 where it cannot be asked."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int()
        if driver.cuInit(0) or driver.cuDeviceGetAttribute(ctypes.byref(count), _MULTIPROCESSOR_COUNT, 0):
            return 0
        return count.value
    except (OSError, AttributeError):
        return 0
