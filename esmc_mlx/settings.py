"""Every ``ESMC_MLX_*`` environment variable, parsed in one place and read once (as
huggingface_hub's ``constants.py`` does): code asks ``current()``, never ``os.environ``.
Benchmarks and tests that compare settings within one process use ``override``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from .errors import EsmcMlxError

# The quantized-matmul paths ESMC_MLX_PATH can force (runtime/dispatch.py says what each is).
PATHS = ("quantized", "dequantize", "fused", "cutlass")

# name -> what it does; README.md's table lists exactly these (tests/test_docs.py checks it).
VARIABLES = {
    "ESMC_MLX_CACHE": "esmc-mlx's cache (reference outputs, file hashes, the files it wrote, compiled CUDA "
    "kernels, the CUTLASS build); default $XDG_CACHE_HOME/esmc-mlx or ~/.cache/esmc-mlx; `off` turns it off",
    "ESMC_MLX_DEBUG": "`1`: say on stderr, per CUDA kernel, whether it came from the cache or was compiled, and why not",
    "ESMC_MLX_BLAS": "the BLAS library MLX's CPU GEMMs use on Linux (a path), or `none` for MLX's bundled one",
    "ESMC_MLX_BLAS_CORETYPE": "the OpenBLAS kernel MLX's copy runs (`SkylakeX`, `Haswell` ...) where the one it "
    "picks for the CPU is wrong; other OpenBLAS copies in the process keep theirs",
    "ESMC_MLX_KERNELS": "`0`: no custom CUDA kernel and no CUTLASS: MLX's own ops everywhere (same models, "
    "MLX's speed)",
    "ESMC_MLX_PATH": "forces the matmul path of quantized layers where it can run: "
    + ", ".join(PATHS)
    + " (debugging; `esmc-mlx info MODEL --plan` shows the result)",
}


class SettingsError(EsmcMlxError, ValueError):
    """An ``ESMC_MLX_*`` variable holds a value esmc-mlx does not take."""


@dataclasses.dataclass(frozen=True)
class Settings:
    cache: Path | None  # None: the cache is off
    debug: bool = False
    blas: str | None = None  # a library path, "none", or None: find OpenBLAS
    blas_coretype: str | None = None
    kernels: bool = True
    path: str | None = None  # one of PATHS, or None: the dispatch plan's choice

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        chosen = env.get("ESMC_MLX_CACHE", "")
        if chosen.lower() in ("off", "0", "none"):
            cache = None
        elif chosen:
            cache = Path(chosen).expanduser()
        else:
            xdg = env.get("XDG_CACHE_HOME")
            cache = (Path(xdg) if xdg else Path.home() / ".cache") / "esmc-mlx"
        path = env.get("ESMC_MLX_PATH", "").strip().lower() or None
        if path in ("auto", None):
            path = None
        elif path not in PATHS:
            raise SettingsError(f"ESMC_MLX_PATH={path!r}: choose one of {', '.join(PATHS)} (or leave it unset)")
        return cls(
            cache=cache,
            debug=_flag(env, "ESMC_MLX_DEBUG", False),
            blas=env.get("ESMC_MLX_BLAS") or None,
            blas_coretype=env.get("ESMC_MLX_BLAS_CORETYPE") or None,
            kernels=_flag(env, "ESMC_MLX_KERNELS", True),
            path=path,
        )


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise SettingsError(f"{name}={raw!r}: use 1 or 0")


_current: Settings | None = None


def current() -> Settings:
    """The settings of this process, read from the environment the first time."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def reload() -> Settings:
    """Read the environment again (tests that change it)."""
    global _current
    _current = Settings.from_env()
    return _current


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """These settings changed while the block runs (a benchmark's side, a test)."""
    global _current
    saved = current()
    _current = dataclasses.replace(saved, **changes)
    try:
        yield _current
    finally:
        _current = saved
