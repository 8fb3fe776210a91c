"""Load MLX, and give its CPU GEMMs an optimized BLAS on Linux without lending it to anyone else.

The Linux ``mlx`` wheels link the reference (netlib) BLAS: an fp32 GEMM there runs at ~4-5
GFLOP/s against ~100-220 with OpenBLAS on the same two cores (docs/benchmarks.md). libmlx.so
imports exactly three BLAS functions (``cblas_sgemm``, ``cblas_dgemm``, ``cblas_cgemm``).

Loading OpenBLAS with RTLD_GLOBAL before ``import mlx.core`` (the first approach) put its
symbols in front of every library loaded later: torch's own ``sgemm_`` calls went to it too, and
a 300M torch forward took 10.8 s instead of 1.2 s in a process that had imported esmc_mlx. So
the BLAS is opened RTLD_LOCAL (no other library can see its symbols) and libmlx.so's three
import slots (its GOT entries, found from its relocation table) are pointed at it. Nothing else
in the process changes, and the order of ``import mlx.core`` does not matter.

Which BLAS: ``$ESMC_MLX_BLAS`` (a path, or ``none``), else the ``scipy-openblas32`` wheel (a
dependency on Linux; OpenBLAS 0.3.34, LP64, symbols prefixed ``scipy_``), else the system's
OpenBLAS, else a warning with the rate measured. Which kernel: OpenBLAS's own choice, unless
that is weaker than the CPU (Debian's 0.3.21 took an AVX-512/AMX Xeon for "Prescott": 16-33
GFLOP/s against 175 with SkylakeX); then the copy is reopened with the kernel of the CPU's
vector tier. ``$ESMC_MLX_BLAS_CORETYPE`` forces a kernel for this copy only (``OPENBLAS_CORETYPE``
is set just while it loads, so numpy's and torch's BLAS keep theirs).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import importlib.util
import mmap
import os
import struct
import sys
import time
import warnings
from pathlib import Path

from . import settings

ENV_VAR = "ESMC_MLX_BLAS"  # a path to an OpenBLAS-compatible library, or "none"
CORETYPE_VAR = "ESMC_MLX_BLAS_CORETYPE"  # an OpenBLAS kernel name for MLX's copy, e.g. SkylakeX
SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
# OpenBLAS x86 kernels by the widest vector unit they use (lower case, as openblas_get_corename).
AVX512_CORES = {"skylakex", "cooperlake", "sapphirerapids"}
AVX2_CORES = AVX512_CORES | {"haswell", "zen", "excavator"}
SLOW_GFLOPS = 30.0  # below this an fp32 GEMM is a reference/scalar kernel (4-33 measured)

FIX = {
    "linux": 'pip install "mlx[cpu]" (CPU) or pip install "mlx[cuda13]" (CUDA 13 GPUs), the same version as mlx',
    "darwin": "pip install --force-reinstall mlx (needs macOS 14+ on Apple Silicon)",
}

loaded_path: str | None = None  # the BLAS MLX computes with, or None (reference BLAS)
info: dict = {}  # source, path, corename, config, forced coretype: shown by `esmc-mlx bench`


def load_mlx() -> None:
    """Import ``mlx.core`` and bind the fast BLAS. A broken MLX install (the ``mlx`` wheel
    without a backend: ``ImportError: libmlx.so``) gives one line naming the fix; run as a
    command (``esmc-mlx``, ``esmc-convert``) it exits with it, without a traceback."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        fix = FIX.get(sys.platform, "pip install --force-reinstall mlx")
        message = f"MLX is installed without a working backend ({e}). Fix: {fix}."
        if Path(sys.argv[0]).name in ("esmc-mlx", "esmc-convert"):
            raise SystemExit(f"Error: {message}") from None
        raise ImportError(message) from e
    _check_cuda_build()
    load_fast_blas()
    atexit.register(_finish_queued_work)


def _finish_queued_work() -> None:
    """Let MLX finish the CPU work it has queued before the process's libraries are finalized.

    A run stopped by Ctrl-C or SIGTERM leaves work queued by ``mx.async_eval`` (the next batch
    of a scan or an embedding) running on MLX's own thread. OpenBLAS's finalizer, run by
    ``exit()``, then stops its worker threads while that thread is still handing them a GEMM, and
    waits forever for one of them (gdb: the main thread in ``blas_thread_shutdown_``, joining a
    worker asleep on its condition variable; 5 of 20 terminated scans on the CPU hung so). Python
    runs atexit functions before ``exit()``; waiting here costs at most the batch in flight, and
    nothing when the queue is empty. Only the CPU stream: GPU work never reaches OpenBLAS, and
    asking for the GPU's stream would start a GPU context in a process that used none."""
    mx = sys.modules["mlx.core"]  # imported by load_mlx, which registered this
    try:
        mx.synchronize(mx.default_stream(mx.cpu))
    except Exception:  # a failed computation: it has nothing left to hand to OpenBLAS
        pass


def _check_cuda_build() -> None:
    """mlx-cpu and mlx-cuda-* both ship mlx/lib/libmlx.so, so with both installed (esmc-mlx on
    Linux needs mlx[cpu]; its `cuda` extra adds mlx[cuda13]) the one unpacked last wins. Warn,
    with the fix, when a CUDA package is installed but the file is not its own."""
    if not sys.platform.startswith("linux"):
        return
    from importlib import metadata

    libmlx = _libmlx()
    for name in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        record = next((f for f in dist.files or () if str(f) == "mlx/lib/libmlx.so"), None)
        if libmlx and record is not None and record.size and record.size != libmlx.stat().st_size:
            warnings.warn(
                f"esmc_mlx: {name} is installed but {libmlx} is the CPU build (mlx-cpu ships the same "
                f"file): MLX will not use the GPU. Fix: pip install --force-reinstall --no-deps "
                f"{name}=={dist.version}",
                RuntimeWarning,
                stacklevel=3,
            )
        return


# --- finding and opening the library --------------------------------------------------------
def _candidates() -> list[tuple[str, str, str]]:
    """(path, symbol prefix, where it came from), best first."""
    chosen = settings.current().blas
    if chosen:
        return [] if chosen.lower() == "none" else [(chosen, _prefix_of(chosen), ENV_VAR)]
    out = []
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec and spec.origin:
        lib = Path(spec.origin).parent / "lib" / "libscipy_openblas.so"
        if lib.exists():
            out.append((str(lib), "scipy_", "scipy-openblas32"))
    found = ctypes.util.find_library("openblas")
    system = ([found] if found else []) + [p for p in SYSTEM_CANDIDATES if os.path.exists(p)]
    return out + [(p, "", "system") for p in dict.fromkeys(system)]


def _prefix_of(path: str) -> str:
    return "scipy_" if "scipy_openblas" in Path(path).name else ""


def _open(path: str, coretype: str | None) -> ctypes.CDLL:
    """dlopen ``path`` RTLD_LOCAL, with OPENBLAS_CORETYPE set to ``coretype`` only while its
    constructor picks the kernel."""
    saved = os.environ.get("OPENBLAS_CORETYPE")
    if coretype:
        os.environ["OPENBLAS_CORETYPE"] = coretype
    try:
        return ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    finally:
        if coretype:
            if saved is None:
                del os.environ["OPENBLAS_CORETYPE"]
            else:
                os.environ["OPENBLAS_CORETYPE"] = saved


def _text(lib: ctypes.CDLL, name: str) -> str | None:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    return (fn() or b"").decode(errors="replace").strip()


def cpu_kernel() -> str | None:
    """The OpenBLAS kernel for this CPU's widest vector unit (x86 only), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def _weaker_than_cpu(core: str | None, kernel: str | None) -> bool:
    if not core or not kernel:
        return False
    best = AVX512_CORES if kernel == "SkylakeX" else AVX2_CORES
    return core.lower() not in best


# --- pointing libmlx.so's BLAS imports at it ------------------------------------------------
def _libmlx() -> Path | None:
    """The libmlx.so that the loaded mlx.core uses (its RUNPATH is $ORIGIN/lib; `mlx` is a
    namespace package, so only mlx.core's own location is certain)."""
    core = sys.modules.get("mlx.core")
    if core is None or not getattr(core, "__file__", None):
        return None
    path = Path(core.__file__).parent / "lib" / "libmlx.so"
    return path if path.exists() else None


def blas_imports(path: Path, wanted=lambda name: name.startswith("cblas_")) -> dict[str, list[int]]:
    """The GOT slot offsets (relative to the load address) of the functions the ELF64 shared
    object ``path`` imports (default: every ``cblas_*``), from its RELA relocation sections."""
    out: dict[str, list[int]] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:6] != b"\x7fELF\x02\x01":  # 64-bit little-endian only (x86-64, aarch64)
            return out
        (shoff,) = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
        for _, kind, _, _, offset, size, link, _, _, _ in sections:
            if kind != 4:  # SHT_RELA
                continue
            symtab, strtab = sections[link][4], sections[sections[link][6]][4]
            for at in range(offset, offset + size, 24):
                r_offset, r_info = struct.unpack_from("<QQ", m, at)
                # R_X86_64_GLOB_DAT/JUMP_SLOT (6, 7), R_AARCH64_GLOB_DAT/JUMP_SLOT (1025, 1026)
                if r_info & 0xFFFFFFFF not in (6, 7, 1025, 1026):
                    continue
                (st_name,) = struct.unpack_from("<I", m, symtab + (r_info >> 32) * 24)
                name = m[strtab + st_name : m.find(b"\0", strtab + st_name)].decode()
                if wanted(name):
                    out.setdefault(name, []).append(r_offset)
    return out


class _LinkMap(ctypes.Structure):
    _fields_ = [("l_addr", ctypes.c_size_t), ("l_name", ctypes.c_char_p)]


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


_libc = ctypes.CDLL(None, use_errno=True)


def _base_address(path: Path) -> int | None:
    """Load address of the already loaded ``path`` (None if it is not loaded)."""
    try:
        handle = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)._handle
    except OSError:
        return None
    lm = ctypes.POINTER(_LinkMap)()
    _libc.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    if _libc.dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(lm)) != 0:  # RTLD_DI_LINKMAP
        return None
    return lm.contents.l_addr


def _page_protection(address: int) -> int:
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return (4 if perms[0] == "r" else 0) | (2 if perms[1] == "w" else 0) | (1 if perms[2] == "x" else 0)
    raise OSError(f"address {address:#x} is not mapped")


def _write_pointer(address: int, value: int) -> None:
    """Store ``value`` at ``address`` in a (possibly read-only, RELRO) GOT page."""
    page = address & ~(mmap.PAGESIZE - 1)
    protection = _page_protection(address)
    _libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if _libc.mprotect(page, mmap.PAGESIZE, protection | 2) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed on libmlx.so's GOT")
    ctypes.c_void_p.from_address(address).value = value
    _libc.mprotect(page, mmap.PAGESIZE, protection)


def library_of(address: int | None) -> str | None:
    """The file of the loaded object holding ``address`` (dladdr)."""
    if not address:
        return None
    found = _DlInfo()
    _libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not _libc.dladdr(ctypes.c_void_p(address), ctypes.byref(found)) or not found.dli_fname:
        return None
    return os.path.realpath(found.dli_fname.decode())


def serving_library(path: Path | str, symbol: str) -> str | None:
    """The library whose code the loaded ``path``'s calls to ``symbol`` reach now (its GOT slot,
    resolved with dladdr); None if ``path`` is not loaded or does not import ``symbol``."""
    base = _base_address(Path(path))
    offsets = blas_imports(Path(path), lambda name: name == symbol).get(symbol) if base is not None else None
    if not offsets:
        return None
    return library_of(ctypes.c_void_p.from_address(base + offsets[0]).value)


def mlx_blas_library() -> str | None:
    """The library MLX's fp32 CPU GEMMs (libmlx.so's ``cblas_sgemm``) run on now."""
    path = _libmlx()
    return serving_library(path, "cblas_sgemm") if path else None


def _bind(lib: ctypes.CDLL, prefix: str) -> bool:
    path = _libmlx()
    base = _base_address(path) if path else None
    if base is None:
        return False
    imports = blas_imports(path)
    targets = {}
    for name in imports:
        try:
            targets[name] = ctypes.cast(getattr(lib, prefix + name), ctypes.c_void_p).value
        except AttributeError:
            return False  # not a complete CBLAS: leave MLX on its own
    for name, offsets in imports.items():
        for offset in offsets:
            _write_pointer(base + offset, targets[name])
    return bool(imports)


# --- what it delivers -----------------------------------------------------------------------
def gemm_gflops(n: int = 512, seconds: float = 0.05) -> float:
    """MLX's fp32 GEMM rate on the CPU now (n x n x n, best of a few calls within ``seconds``)."""
    import mlx.core as mx

    a = mx.random.normal((n, n), stream=mx.cpu)
    b = mx.random.normal((n, n), stream=mx.cpu)
    mx.eval(a, b, mx.matmul(a, b, stream=mx.cpu))
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return 2 * n**3 / best / 1e9


def load_fast_blas() -> str | None:
    """Bind the best BLAS found to MLX's CPU GEMMs and return its path (None: the bundled
    reference BLAS stays, with a warning that gives its measured rate). Linux only; idempotent."""
    global loaded_path
    if loaded_path or not sys.platform.startswith("linux"):
        return loaded_path
    if (settings.current().blas or "").lower() == "none":
        return None
    forced = settings.current().blas_coretype
    kernel = cpu_kernel()
    for path, prefix, source in _candidates():
        try:
            lib = _open(path, forced)
        except OSError:
            continue
        core = _text(lib, prefix + "openblas_get_corename")
        if not forced and _weaker_than_cpu(core, kernel):
            # Reopen with the CPU's kernel: the handle is ours alone, so dlclose unloads it.
            _libc.dlclose.argtypes = [ctypes.c_void_p]
            _libc.dlclose(ctypes.c_void_p(lib._handle))
            lib = _open(path, kernel)
            forced = kernel
            core = _text(lib, prefix + "openblas_get_corename")
        if not _bind(lib, prefix):
            continue
        loaded_path = library_of(ctypes.cast(getattr(lib, prefix + "cblas_sgemm"), ctypes.c_void_p).value) or path
        info.update(
            source=source,
            path=loaded_path,
            corename=core,
            forced_coretype=forced,
            config=_text(lib, prefix + "openblas_get_config"),
        )
        if _weaker_than_cpu(core, kernel):
            rate = gemm_gflops()
            info["gemm_gflops"] = rate
            warnings.warn(
                f"esmc_mlx: MLX's BLAS ({path}) runs the {core} kernel on a CPU that has "
                f"{kernel}'s instructions: fp32 GEMM {rate:.0f} GFLOP/s. Set {CORETYPE_VAR}="
                f"{kernel} to force it (this copy only).",
                RuntimeWarning,
                stacklevel=3,
            )
        return loaded_path
    if _libmlx() is not None:
        rate = gemm_gflops()
        info.update(source="reference", path=None, gemm_gflops=rate)
        if rate < SLOW_GFLOPS:
            warnings.warn(
                f"esmc_mlx: no OpenBLAS found; MLX's CPU GEMMs use its bundled reference BLAS "
                f"({rate:.0f} GFLOP/s fp32). pip install scipy-openblas32 (no root needed), or "
                f"apt-get install libopenblas0-pthread, or point {ENV_VAR} at a BLAS library.",
                RuntimeWarning,
                stacklevel=3,
            )
    return None
