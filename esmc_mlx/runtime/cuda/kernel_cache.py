"""Our CUDA kernels compiled once per machine, not once per process.

MLX compiles a ``mx.fast.cuda_kernel`` with NVRTC the first time a process runs it. It looks
in its disk cache first (``MLX_PTX_CACHE_DIR``, which esmc_mlx points at ``<cache>/ptx``) but
never writes custom kernels there (mlx/backend/cuda/custom_kernel.cpp asks its JIT for no disk
copy). So every process paid the compiler again for each of its kernels (runtime/cuda/) it used:
on the H200, 2.4-2.9 s at a 300M's first forward (the q/k/v kernel) and 5 s at a quantized
6B's.

Here, the first time a process uses a kernel instantiation, the source MLX generates for it
(``verbose=True`` prints it) is compiled with NVRTC and the options MLX uses, and written where
MLX reads: ``<module>.ptx`` (the cubin) and ``<module>.txt`` (kernel name, tab, mangled name),
``<module>`` being MLX's module name, the kernel's name and the hex ``std::hash`` of its source
(libstdc++'s, reproduced by ``std_hash``). MLX then loads it instead of compiling, and runs it
exactly as before: the same source, compiler and options give the same code, and MLX's own
launch path is untouched. (Running a cubin through ``mx.fast.precompiled_cuda_kernel``
instead made each call 60-80 us slower on the H200: the quantized 6B's forwards took 1.6x
as long.)

MLX hands NVRTC its device header from memory; our kernels use only the CUDA headers it
includes and its ``Shape`` type, so ``DEVICE_HEADER`` stands in for it (``Shape``'s size from
MLX's installed ``config.h``). NVRTC, the very library MLX has loaded, is called through
ctypes: MLX's dependencies have no binding for it. Whatever fails here (no NVRTC library, MLX
printing its source differently, a compile error, a cache that cannot be written) leaves MLX
to compile the kernel as it always did; so does ``ESMC_MLX_CACHE=off``.

MLX also hashes a kernel's whole source again on *every* call, on the host (custom_kernel.cpp's
eval_gpu names the module by ``std::hash`` of it): 0.14 ns a byte on an EPYC host, 3.6-3.9 us
for the 27 KB of the warpgroup tile's header and body, in forwards that are host-bound at
B=1. So each kernel's header and body are written once to files beside the compiled modules
(``<MLX_PTX_CACHE_DIR>/esmc-include``, named by the sha256 of what they hold) and MLX is
handed two ``#include`` lines instead (``by_include``): ~170 bytes that compile to the same
code, and whose module name still changes whenever the code does (whole forwards 0.86-0.90x
the time at B=1 on the H200; docs/decisions.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from ... import settings
from ...errors import OutputError
from ...outputs import atomic_file
from . import device, source

MAX_NAME = 245  # MLX's longest cache file name (jit_module.cpp get_ptx_path); longer: not seeded

DEVICE_HEADER = source.text("mlx_device_utils.cuh")  # stands in for MLX's in-memory header
DEVICE_HEADER_NAME = "mlx/backend/cuda/device/utils.cuh"
GENERATED = re.compile(r"Generated source code for `([^`]+)`:\n```\n(.*)\n```\n", re.S)

_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s ``std::hash<std::string>`` on 64-bit Linux (``_Hash_bytes``, a
    MurmurHash2 variant): what MLX names a JIT module by."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n, aligned = len(data), len(data) & ~7
    h = (seed ^ (n * _MUL)) & _M64
    for i in range(0, aligned, 8):
        h ^= (shift_mix((int.from_bytes(data[i : i + 8], "little") * _MUL) & _M64) * _MUL) & _M64
        h = (h * _MUL) & _M64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _M64
    return shift_mix((shift_mix(h) * _MUL) & _M64)


def mlx_cache_dir() -> Path | None:
    """Where MLX reads compiled kernels: $MLX_PTX_CACHE_DIR, which esmc_mlx sets to
    <cache>/ptx (unless it was set already); None with ESMC_MLX_CACHE=off: nothing is kept."""
    chosen = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(chosen) if chosen else None


@functools.cache
def _include_args() -> tuple[str, ...]:
    """MLX's NVRTC include paths (jit_module.cpp include_path_args): its bundled headers, their
    CCCL, then the CUDA runtime headers of the nvidia wheel beside it, else $CUDA_HOME,
    $CUDA_PATH or /usr/local/cuda."""
    root = Path(mx.__file__).resolve().parent
    cudart = root.parent / "nvidia" / "cu13" / "include"
    if not cudart.exists():
        cudart = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
    paths = [root / "include", root / "include" / "cccl", cudart]
    return tuple(f"--include-path={p}" for p in paths if p.exists())


_NVRTC = []  # the library, once found


def _nvrtc():
    """The NVRTC library this process's MLX has loaded (so the same compiler makes the same
    code, loadable by this driver), or None while it has loaded none: then MLX compiles."""
    if _NVRTC:
        return _NVRTC[0]
    try:
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if "libnvrtc.so" in line and "builtins" not in line})
    except OSError:
        return None
    for candidate in loaded:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        p, size, ptr, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER, ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ptr(p), text, text, ctypes.c_int, ptr(text), ptr(text)]
        lib.nvrtcAddNameExpression.argtypes = [p, text]
        lib.nvrtcCompileProgram.argtypes = [p, ctypes.c_int, ptr(text)]
        lib.nvrtcGetProgramLogSize.argtypes = [p, ptr(size)]
        lib.nvrtcGetProgramLog.argtypes = [p, text]
        lib.nvrtcGetCUBINSize.argtypes = [p, ptr(size)]
        lib.nvrtcGetCUBIN.argtypes = [p, text]
        lib.nvrtcGetLoweredName.argtypes = [p, text, ptr(text)]
        lib.nvrtcDestroyProgram.argtypes = [ptr(p)]
        _NVRTC.append(lib)
        return lib
    return None


class CompileError(RuntimeError):
    pass


def compile_cubin(source: str, kernel: str, arch: str) -> tuple[bytes, str]:
    """(cubin, mangled name of ``kernel``) of MLX's generated ``source``, compiled as MLX
    compiles it. Raises CompileError."""
    lib = _nvrtc()
    if lib is None:
        raise CompileError("MLX has loaded no NVRTC library yet")
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(DEVICE_HEADER.encode())
    names = (ctypes.c_char_p * 1)(DEVICE_HEADER_NAME.encode())
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 1, headers, names):
        raise CompileError("nvrtcCreateProgram failed")
    try:
        lib.nvrtcAddNameExpression(prog, kernel.encode())
        options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}", *_include_args()]
        argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        if lib.nvrtcCompileProgram(prog, len(options), argv):
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise CompileError(log.value.decode(errors="replace"))
        n = ctypes.c_size_t()
        cubin = None
        if not lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)):
            cubin = ctypes.create_string_buffer(n.value)
        if cubin is None or lib.nvrtcGetCUBIN(prog, cubin):
            raise CompileError("no cubin")
        mangled = ctypes.c_char_p()
        if lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(mangled)):
            raise CompileError("no lowered name")
        return cubin.raw, mangled.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def generated_source(make) -> tuple[str, str] | None:
    """(kernel name, source) that MLX prints for the kernel call ``make(verbose=True)`` (it
    prints while building the graph; the returned arrays are never evaluated)."""
    if sys.stdout is not None:
        sys.stdout.flush()  # what Python buffered goes out before fd 1 is borrowed
    saved = os.dup(1)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 1)
            try:
                make(verbose=True)
            finally:
                os.dup2(saved, 1)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
    finally:
        os.close(saved)
    found = GENERATED.search(text)
    return (found.group(1), found.group(2)) if found else None


def seed(make) -> str:
    """Put the compiled kernel of the call ``make`` (a ``mx.fast.cuda_kernel`` call taking
    ``verbose``) where MLX will read it. Returns what happened: "cached" (already there),
    "seeded", or why not."""
    arch, directory = device.arch(), mlx_cache_dir()
    if arch is None:
        return "no CUDA device"
    if directory is None:
        return "no cache directory"
    try:
        generated = generated_source(make)
    except OSError as e:  # no file descriptor 1 to borrow (a daemon, a closed stdout)
        return f"MLX's source not readable: {e}"
    if generated is None:
        return "MLX printed no source"
    name, source = generated
    module = f"{name}_{std_hash(source.encode()):x}"
    INSTANTIATED[module] = (name, source)
    if len(module) + len(".ptx") > MAX_NAME:
        return "name too long"
    ptx, txt = directory / f"{module}.ptx", directory / f"{module}.txt"
    if ptx.exists() and txt.exists():
        return "cached"
    kernel = f"mlx::core::cu::{name}"
    try:
        cubin, mangled = compile_cubin(source, kernel, arch)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_file(txt) as f:  # the names first: MLX reads them once it finds the .ptx
            f.write(f"{kernel}\t{mangled}\n")
        with atomic_file(ptx, "wb") as f:
            f.write(cubin)
    except (CompileError, OSError, OutputError) as e:
        return f"not compiled: {e}"
    return "seeded"


# Module name -> (kernel name, source) of every instantiation this process ran: what MLX
# compiles, which tests/test_gpu_plans.py compiles again for other architectures.
INSTANTIATED: dict[str, tuple[str, str]] = {}

INCLUDE_DIR = "esmc-include"
_PATH_SAFE = re.compile(r"[A-Za-z0-9_./ +=@,-]+")  # what an #include "..." line can hold as it is


def _include_file(directory: Path, name: str, part: str, text: str) -> Path:
    """``text`` in ``directory``, under a name that changes with it; an existing file is kept
    only if it holds exactly ``text``."""
    path = directory / f"{name}-{part}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.cuh"
    try:
        if path.read_text() == text:
            return path
    except (OSError, UnicodeDecodeError):
        pass
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(text)
    return path


def by_include(kernel_args: dict) -> dict:
    """``mx.fast.cuda_kernel``'s arguments with the header and the source each replaced by an
    ``#include`` of a file holding them (see the module's docstring); unchanged when the cache
    is off or cannot be written. The source keeps a comment naming the ``<input>_shape``,
    ``_strides`` and ``_ndim`` arguments it uses: MLX passes those only when the source's text
    names them."""
    directory = mlx_cache_dir()
    if directory is None:
        return kernel_args
    directory = directory.resolve() / INCLUDE_DIR
    if not _PATH_SAFE.fullmatch(str(directory)):
        return kernel_args
    name, source = kernel_args["name"], kernel_args["source"]
    try:
        body = _include_file(directory, name, "body", source)
        header = _include_file(directory, name, "header", kernel_args.get("header", ""))
    except (OSError, OutputError):
        return kernel_args
    used = [
        f"{n}_{k}" for n in kernel_args["input_names"] for k in ("shape", "strides", "ndim") if f"{n}_{k}" in source
    ]
    return kernel_args | {
        "header": f'#include "{header}"\n',
        "source": f'#include "{body}"\n' + (f"// uses {' '.join(used)}\n" if used else ""),
    }


class Kernel:
    """``mx.fast.cuda_kernel`` (same arguments, same results) whose compiled form is put in
    MLX's disk cache the first time each instantiation is called in a process, and whose code
    MLX sees through ``#include`` lines (``by_include``)."""

    def __init__(self, **kernel_args):
        self._kernel = mx.fast.cuda_kernel(**by_include(kernel_args))
        self.kernel_args = kernel_args  # as given: the kernel's whole text
        self.name = kernel_args["name"]
        self.seen: dict[tuple, str] = {}  # instantiation -> what seed() said

    def __call__(self, **call_args):
        key = (
            tuple((a.dtype, a.ndim) for a in call_args["inputs"]),
            tuple(call_args["output_dtypes"]),
            tuple(call_args.get("template", ())),
        )
        if key not in self.seen:
            by_include(self.kernel_args)  # a new instantiation is compiled: its files must be there
            self.seen[key] = seed(lambda verbose: self._kernel(**call_args, verbose=verbose))
            if settings.current().debug:
                print(f"esmc-mlx: kernel {self.name}: {self.seen[key]}", file=sys.stderr)
        return self._kernel(**call_args)
