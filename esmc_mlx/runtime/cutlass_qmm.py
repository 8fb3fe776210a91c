"""CUTLASS's Hopper mixed-input GEMM for affine 4- and 8-bit weights: an MLX C++ primitive,
built on the machine, used wherever it is built unless ``ESMC_MLX_CUTLASS_QMM=0`` (issue 16,
thirty-first and thirty-second sessions).

Why it exists: past the fused kernel's token window, a quantized layer on CUDA dequantizes its
weight to a bf16 copy and runs cuBLAS on it. At 1024 tokens on the 6B that copy's bytes are a
floor no dequantize kernel gets under (docs/benchmarks.md, "Misses"). CUTLASS's mixed-input GEMM
reads the packed weight itself and dequantizes it in registers on its way to the tensor cores.
Where it won in whole forwards on the H200, and by how much, is quantized.CUTLASS_TOKENS and
its comment; elsewhere the tables keep dequantize + matmul. Its outputs equalled dequantize +
matmul's to the bit in every whole forward compared.

Why C++: ``mx.fast.cuda_kernel`` cannot launch it. CUTLASS's Hopper kernels take TMA
descriptors that the host encodes from the arrays' addresses, and a launch bound; a custom
kernel sees neither. An MLX extension's ``eval_gpu`` has the addresses and adds the kernel to
MLX's CUDA graph as MLX does with its own (cutlass_qmm.cu). CUTLASS's headers come with MLX's
CUDA wheel; the build needs nvcc, nanobind 3.0 or 3.1 (MLX 0.32's binding ABI, internals v22)
and fmt's headers (MLX's headers include them; torch ships a copy). mxfp4 and mxfp8 cannot take
it: its K tile must divide the group and be at least 64 (a static assert, "Consider increasing
TileShapeK"), and their groups are 32.

    pip install 'esmc-mlx[cutlass]'           # nanobind
    esmc-mlx build-cutlass                     # build it into <cache>/cutlass_qmm/mlx-<version>/
    esmc-mlx ...                               # used from then on (ESMC_MLX_CUTLASS_QMM=0: not)

A layer takes it where the tables send its calls by dequantize + matmul (QuantizedLinear.policy)
at token counts up to its table's CUTLASS_TOKENS (``ESMC_MLX_CUTLASS_QMM=1``: at every count,
for benchmarks) and its weight qualifies (``eligible``); it keeps a copy of its scales and
biases transposed to [K / group, N], as CUTLASS wants them (1/16 of a byte a weight at groups
of 64: 0.4 GB for the 6B).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import EsmcMlxError
from ..hashes import cache_root
from . import kernel_cache

ENV = "ESMC_MLX_CUTLASS_QMM"
SOURCE = Path(__file__).with_name("cutlass_qmm.cu")
MODULE = "_cutlass_qmm"
# CUTLASS's tile: 128 weight rows by 256 tokens by 64 of K. At 1024 and 4096 tokens it beat the
# 128 x 128 tile on every 6B weight (0.71-0.94x its time, standalone); the C++ side also has 128.
TILE_TOKENS = 256
HOPPER = "sm_90a"  # what the build targets (-arch); the kernel runs on nothing else


class BuildError(EsmcMlxError, RuntimeError):
    """The extension could not be built, or a build does not load; the message names what is
    missing (the CLI prints it as its one ``Error:`` line)."""


def build_dir() -> Path | None:
    """Where the extension for this MLX lives: it links MLX's C++ library, so a build serves one
    MLX version only."""
    root = cache_root()
    return None if root is None else root / "cutlass_qmm" / f"mlx-{mx.__version__}"


@functools.cache
def _extension():
    """The built module, or None (not built, or built for another Python)."""
    folder = build_dir()
    if folder is None:
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / (MODULE + suffix)
        if path.exists():
            spec = importlib.util.spec_from_file_location(MODULE, path)
            try:  # an extension module is loaded by module_from_spec already
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            except ImportError as e:
                raise BuildError(f"{path} does not load ({e}): rebuild it with esmc-mlx build-cutlass") from None
            return module
    return None


def runs_here() -> bool:
    """Whether the default device runs the extension's code: sm_90a, Hopper only."""
    return kernel_cache.device_arch() == HOPPER


def enabled() -> bool:
    """Built for this MLX and Python, on a Hopper GPU, and not turned off (``ESMC_MLX_CUTLASS_QMM=0``)."""
    return os.environ.get(ENV) != "0" and runs_here() and _extension() is not None


def forced() -> bool:
    """``ESMC_MLX_CUTLASS_QMM=1``: every call the tables give to dequantize + matmul, whatever
    its token count (benchmarks.cutlass_qmm_ab's side)."""
    return os.environ.get(ENV) == "1"


def eligible(layer: nn.Module) -> bool:
    """Whether the kernel takes ``layer``'s weight: affine 4- or 8-bit in groups of 64 or 128
    (CUTLASS's K tile is 64), bfloat16 scales, N a multiple of 8 (16-byte rows of y)."""
    if layer.mode != "affine" or layer.bits not in (4, 8) or layer.group_size not in (64, 128):
        return False
    return layer["scales"].dtype == mx.bfloat16 and layer["weight"].shape[0] % 8 == 0


def matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """``x @ dequantize(layer's weight).T`` (+ its bias) by CUTLASS; x in bfloat16."""
    transposed = getattr(layer, "cutlass_scales", None)
    if transposed is None:
        # Computed once, on the first eager call (a compiled model traces a shape only the
        # second time it sees it), and kept: the trace then reads them as constants.
        transposed = (mx.contiguous(layer["scales"].T), mx.contiguous(layer["biases"].T))
        mx.eval(transposed)
        object.__setattr__(layer, "cutlass_scales", transposed)  # not a parameter
    y = _extension().quantized_matmul(x, layer["weight"], *transposed, layer.bits, layer.group_size, TILE_TOKENS)
    return y + layer["bias"] if "bias" in layer else y


def _fmt_include() -> Path:
    """A folder holding fmt/format.h: $FMT_INCLUDE, torch's copy, or the system's."""
    candidates = [os.environ.get("FMT_INCLUDE")]
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.submodule_search_locations:
        candidates.append(str(Path(next(iter(torch.submodule_search_locations))) / "include"))
    candidates += ["/usr/include", "/usr/local/include"]
    for folder in filter(None, candidates):
        if (Path(folder) / "fmt" / "format.h").exists():
            return Path(folder)
    raise BuildError("fmt's headers (fmt/format.h) not found: set FMT_INCLUDE, or install torch or libfmt-dev")


def build_command(output: Path, nvcc: str = "nvcc") -> list[str]:
    """The nvcc command line that builds the extension into ``output``."""
    found = shutil.which(nvcc)
    if found is None:
        raise BuildError(
            f"{nvcc} not found: the CUDA toolkit's compiler builds this extension (CUDA 13, as MLX's wheel)"
        )
    mlx_root = Path(mx.__file__).resolve().parent
    if not (mlx_root / "include" / "cutlass").is_dir() or not (mlx_root / "lib").is_dir():
        raise BuildError(
            f"{mlx_root} has no CUTLASS headers or libmlx: install MLX's CUDA build (pip install 'mlx[cuda13]')"
        )
    try:
        import nanobind
    except ImportError:
        raise BuildError(
            "nanobind not found: pip install 'esmc-mlx[cutlass]' (nanobind 3.0 or 3.1: MLX 0.32's binding ABI)"
        ) from None
    if not nanobind.__version__.startswith(("3.0.", "3.1.")):
        raise BuildError(
            f"nanobind {nanobind.__version__} does not share MLX 0.32's binding ABI (nanobind 3.0 and 3.1 do): pip install 'esmc-mlx[cutlass]'"
        )
    nb_source = Path(nanobind.source_dir())
    return [
        found,
        "-std=c++20",
        "-O3",
        "-DNDEBUG",  # CUTLASS's device asserts are calls that serialize the wgmma pipeline
        "-DFMT_HEADER_ONLY",
        "-DNB_DOMAIN=mlx",  # mlx.core's nanobind domain: our functions take its arrays
        f"-arch={HOPPER}",  # wgmma and TMA: Hopper only
        "--expt-relaxed-constexpr",
        "--diag-suppress=997,2908",
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        "-shared",
        f"-I{mlx_root / 'include'}",
        f"-I{_fmt_include()}",
        f"-I{nanobind.include_dir()}",
        f"-I{nb_source.parent / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        str(nb_source / "nb_combined.cpp"),
        f"-L{mlx_root / 'lib'}",
        "-lmlx",
        "-Xlinker",
        f"-rpath,{mlx_root / 'lib'}",
        "-o",
        str(output),
    ]


def build(nvcc: str = "nvcc", log=print) -> Path:
    """Build the extension for this MLX and Python into ``build_dir()``; it is moved there only
    once nvcc has finished."""
    folder = build_dir()
    if folder is None:
        raise BuildError("the esmc-mlx cache is off (ESMC_MLX_CACHE=off): the extension is kept there")
    target = folder / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    if not runs_here():
        raise BuildError(
            f"CUTLASS's Hopper kernel runs on a compute capability 9.0 GPU only (this device: {kernel_cache.device_arch() or 'none'})"
        )
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        partial = Path(work) / target.name
        command = build_command(partial, nvcc)
        log(f"Building {target.name} (CUTLASS, a few minutes) ...")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if " error" in line]
            raise BuildError("nvcc failed: " + ("; ".join(errors[:3]) or done.stderr.strip()[-500:]))
        os.replace(partial, target)
    _extension.cache_clear()
    return target
