"""Put an optimized BLAS under MLX's CPU GEMMs on Linux.

The Linux ``mlx[cpu]`` wheel bundles the reference (netlib) BLAS: an fp32 GEMM there runs at
~5 GFLOP/s against ~150-220 GFLOP/s with OpenBLAS on the same two cores. MLX resolves
``cblas_sgemm`` when ``libmlx.so`` is loaded; a library opened with RTLD_GLOBAL *before* that
wins the lookup, so this module must run before the first ``import mlx.core`` (the package's
``__init__`` imports it first). Loading it later has no effect (measured), hence the warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

ENV_VAR = "ESMC_MLX_BLAS"  # a path to a BLAS library, or "none" to skip the search
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

loaded_path: str | None = None


def _candidates() -> list[str]:
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return [] if chosen.lower() == "none" else [chosen]
    found = ctypes.util.find_library("openblas")
    return ([found] if found else []) + [p for p in CANDIDATES if os.path.exists(p)]


def load_fast_blas() -> str | None:
    """Load the first OpenBLAS found (RTLD_GLOBAL) and return its path; warn once if none."""
    global loaded_path
    if loaded_path or not sys.platform.startswith("linux"):
        return loaded_path
    if os.environ.get(ENV_VAR, "").lower() == "none":
        return None
    late = "mlx.core" in sys.modules
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded_path = path
        break
    if loaded_path is None:
        warnings.warn(
            "esmc_mlx: no OpenBLAS found; MLX's CPU backend will use its bundled reference BLAS "
            "(~30x slower). Install one (Debian/Ubuntu: apt-get install libopenblas0-pthread) "
            f"or point {ENV_VAR} at a BLAS shared library.",
            RuntimeWarning,
            stacklevel=3,
        )
    elif late:
        warnings.warn(
            "esmc_mlx: mlx.core was imported before esmc_mlx, so MLX keeps its slow reference "
            "BLAS on the CPU. Import esmc_mlx first.",
            RuntimeWarning,
            stacklevel=3,
        )
    return loaded_path
