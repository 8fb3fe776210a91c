"""CUTLASS's Hopper mixed-input GEMM for affine 4- and 8-bit and mxfp4 weights: an MLX C++
primitive (cutlass_qmm.cu), built on the machine with ``esmc-mlx build-cutlass``, used where the
plan sends a call (runtime/dispatch.py: Hopper only, affine 4/8-bit and mxfp4 weights, up to
the token counts measured there).

Why it exists: past the fused kernel's token window a quantized layer dequantizes its weight to
a bf16 copy and runs cuBLAS on it, and that copy's bytes are a floor no dequantize kernel gets
under. CUTLASS's mixed-input GEMM reads the packed weight and dequantizes it in registers on its
way to the tensor cores. Why C++: ``mx.fast.cuda_kernel`` cannot launch it (CUTLASS's Hopper
kernels take TMA descriptors the host encodes from the arrays' addresses); an MLX extension's
``eval_gpu`` has the addresses and adds the kernel to MLX's CUDA graph as MLX does with its own.
CUTLASS's headers come with MLX's CUDA wheel; the build needs nvcc, nanobind 3.0 or 3.1 (MLX
0.32's binding ABI) and fmt's headers.

CUTLASS's mainloop takes one scale a row per K tile, at least 64 wide, and mxfp4's groups are
32: its scales go in as pairs (``scale_pairs``). A layer keeps a copy of its scales transposed
to [K / group, N] as CUTLASS wants them (1/16 of a byte a weight at groups of 64) and one of its
packed weight in the order the kernel's threads read it (``reorder``: the weight's bytes again,
3.2 GB for the 6B; 5-16% off a 4-bit call). Split-K's sum also adds the residual stream and
computes the LayerNorm after it where the model hands them over (``matmul``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ... import settings
from ...errors import EsmcMlxError, EsmcMlxWarning, install_hint
from ...hashes import cache_root
from . import device, rows

SOURCE = Path(__file__).with_name("cutlass_qmm.cu")
GEMM_SOURCE = Path(__file__).with_name("cutlass_qmm_gemm.cu")
# The rest of what the build compiles from this package (its name hashes all of them).
HEADERS = (GEMM_SOURCE, Path(__file__).with_name("cutlass_qmm_gemm.cuh"), Path(__file__).with_name(rows.ROW_HEADER))
MODULE = "_cutlass_qmm"
HOPPER = "sm_90a"  # what the build targets; the kernel runs on nothing else
REORDER_BLOCK = 16  # the .cu's ReorderAtom: rows and K of a block


class BuildError(EsmcMlxError, RuntimeError):
    """The extension could not be built, or a build does not load; the message names what is
    missing (the CLI prints it as its one ``Error:`` line)."""


def build_dir() -> Path | None:
    """Where the extension for this MLX and this source lives: it links MLX's C++ library, so a
    build serves one MLX version only, and a build of an older cutlass_qmm.cu (another function
    signature, or another of the headers it includes) is not loaded: until ``esmc-mlx
    build-cutlass`` runs again, calls keep dequantize + matmul."""
    root = cache_root()
    source = hashlib.sha256(b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))).hexdigest()[:12]
    return None if root is None else root / "cutlass_qmm" / f"mlx-{mx.__version__}-{source}"


@functools.cache
def _extension():
    """The built module, or None (not built, or built for another Python). A build for another
    MLX version or cutlass_qmm.cu beside it is not loaded, and said once: an upgrade otherwise
    turns the kernel off without a word."""
    folder = build_dir()
    if folder is None:
        return None
    if not folder.is_dir():
        stale = sorted(p.name for p in folder.parent.glob("mlx-*") if any(p.glob(MODULE + ".*")))
        if stale:
            warnings.warn(
                f"CUTLASS's mixed-input GEMM is built in {folder.parent} for another MLX or esmc-mlx "
                f"({', '.join(stale)}), not this one: quantized layers use dequantize + matmul until "
                "esmc-mlx build-cutlass runs again",
                EsmcMlxWarning,
                stacklevel=2,
            )
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


def available() -> bool:
    """Built for this MLX and Python, and on a Hopper GPU, where the kernel runs."""
    return device.arch() == HOPPER and _extension() is not None


def why_unused() -> str | None:
    """Why quantized layers on this Hopper GPU do without the kernel (the bench says so beside
    its ratios, which move with it); None where they take it, or where it cannot run."""
    if device.arch() != HOPPER or (settings.current().kernels and available()):
        return None
    if not settings.current().kernels:
        return "turned off (ESMC_MLX_KERNELS=0)"
    return "not built for this MLX and esmc-mlx (esmc-mlx build-cutlass builds it)"


def sm_count() -> int:
    return _extension().sm_count()


# The largest e8m0 exponent (a scale of 2^(e-127)) whose scale pairs hold: see scale_pairs.
MXFP4_MAX_EXPONENT = 128


def scale_pairs(scales: mx.array) -> mx.array | None:
    """mxfp4's e8m0 scales, [N, K / 32], as the kernel takes them: [K / 64, N] uint32, each the two
    groups of a 64-wide K tile as bf16 bits, the even group's in the low half; or None where a
    scale is past MXFP4_MAX_EXPONENT (weights of 16 or more), which the layer then leaves to
    dequantize + matmul.

    Each is 2^126 times the scale, 2^(e-1): the kernel's e2m1 decode (the .cu's ``e2m1_pair``,
    four integer instructions a pair of values, no tables) leaves out 2^-126, and the scale puts
    it back, so the products are still exactly mx.dequantize's. bf16 holds 2^(e-1) up to
    e = 128; 255 stays NaN, as MLX's CUDA dequantize decodes it (its CPU one makes it inf), and 0
    is MLX's subnormal 2^-127, so 2^-1 here. The exact decode, 2^(e-127), is octets.cuh's
    ``e8m0_bf16`` (for the fused kernel; this one runs once a layer in MLX)."""
    e = scales.astype(mx.uint32)
    if mx.max(mx.where(e == 255, 0, e)).item() > MXFP4_MAX_EXPONENT:
        return None
    bits = mx.where(e == 255, 0x7FC0, (e + 126) << 7).T
    return mx.contiguous(bits[0::2] | (bits[1::2] << 16))


def kernel_scales(layer: nn.Module) -> tuple[mx.array, ...]:
    """``layer``'s scales as the kernel takes them, kept on the layer: affine scales and biases
    transposed to [K / group, N], mxfp4's scale pairs, or () where its scales are out of the
    kernel's range. Computed once, on the first eager call (a compiled model traces a shape only
    the second time it sees it), and kept: the trace then reads them as constants."""
    scales = getattr(layer, "cutlass_scales", None)
    if scales is None:
        if layer.mode == "mxfp4":
            pairs = scale_pairs(layer["scales"])
            scales = () if pairs is None else (pairs,)
        else:
            scales = (mx.contiguous(layer["scales"].T), mx.contiguous(layer["biases"].T))
        mx.eval(scales)
        object.__setattr__(layer, "cutlass_scales", scales)  # not a parameter
    return scales


def reorder(q: mx.array, bits: int) -> mx.array:
    """MLX's packed weight, [N, K * bits / 32] uint32, in the .cu's ReorderAtom layout, packed the
    same way (value i of the buffer at bits ``bits * (i % per word)`` of word i / per word).

    The weight is cut into 16 x 16 blocks, rows first (block b holds rows 16 (b % (N / 16)) on and
    columns 16 (b // (N / 16)) on); a block's 256 places are wgmma's A fragment in lane order,
    eight a lane: lane 4g + t's value v is row g + 8 ((v // 2) % 2), column 2t + v % 2 + 8 (v // 4)
    of the block (PTX ISA, "Register fragment for matrix A" of wgmma .m64nNk16). Each index is a
    sum of independent parts (row = 16 row block + 8 v1 + g, column = 16 column block + 8 v2 + 2t
    + v0), so the move is one transpose, to column block, row block, g, t, v2, v1, v0; and v0, the
    innermost both ways, is a byte's two 4-bit values, so the transpose moves bytes, never nibbles."""
    if bits not in (4, 8):
        raise ValueError(f"the kernel takes 4- and 8-bit weights, not {bits}-bit")
    rows, k = q.shape[0], q.shape[1] * 32 // bits
    if rows % REORDER_BLOCK or k % REORDER_BLOCK:
        raise ValueError(f"a reordered weight's rows and K must be multiples of {REORDER_BLOCK}: {rows} x {k}")
    v0 = 2 if bits == 8 else 1  # its own axis, or inside the byte
    # row block, v1, g; column block, v2, t, v0
    blocks = q.view(mx.uint8).reshape(rows // REORDER_BLOCK, 2, 8, k // REORDER_BLOCK, 2, 4, v0)
    return blocks.transpose(3, 0, 2, 5, 4, 1, 6).reshape(rows, -1).view(mx.uint32)


def reorders(layer: nn.Module) -> bool:
    """Whether ``layer`` hands the kernel its weight reordered: where its rows are whole blocks of
    the reorder (K is: whole groups of 64 or 128); else MLX's layout."""
    return layer["weight"].shape[0] % REORDER_BLOCK == 0


def reordered_weight(layer: nn.Module) -> mx.array:
    """``layer``'s weight in reorder's layout, made on the first call and kept on the layer (as
    kernel_scales keeps its scales)."""
    weight = getattr(layer, "cutlass_weight", None)
    if weight is None:
        weight = reorder(layer["weight"], layer.bits)
        mx.eval(weight)
        object.__setattr__(layer, "cutlass_weight", weight)  # not a parameter
    return weight


def norms_in_sum(norm: nn.Module, width: int) -> bool:
    """Whether split-K's sum can hand back ``norm`` (an nn.LayerNorm) of the residual stream it
    makes as well, as mx.fast.layer_norm computes it: a bfloat16 weight (and bias, if any) of the
    product's ``width``, a row that fits the kernel's one block (rows.fits_a_block)."""
    weight, bias = norm.get("weight"), norm.get("bias")
    if weight is None or not rows.fits_a_block(width, mx.bfloat16) or not norm.eps > 0:
        return False
    return all(a.dtype == mx.bfloat16 and a.shape == (width,) for a in (weight, bias) if a is not None)


def matmul(
    layer: nn.Module,
    x: mx.array,
    schedule: str,
    splits: int,
    residual: mx.array | None = None,
    scale: float = 1.0,
    norm: nn.Module | None = None,
):
    """``x @ dequantize(layer's weight).T`` (+ its bias) by CUTLASS in the plan's ``schedule`` and
    split-K ``splits``, x in bfloat16. With ``residual`` (split-K in two slabs or more, no bias):
    ``residual + that / scale`` from the kernel that sums the slabs, each operation rounded to
    bf16 as MLX's ops round it; with ``norm`` too (an nn.LayerNorm), that and ``norm`` of it, the
    LayerNorm from the same kernel where ``norms_in_sum``."""
    if residual is not None and ("bias" in layer or splits < 2):
        raise ValueError("[cutlass_qmm] a residual is added in split-K's sum, to a product without bias")
    if norm is not None and residual is None:
        raise ValueError("[cutlass_qmm] a LayerNorm comes with a residual only")
    scales = kernel_scales(layer)
    reordered = reorders(layer)
    weight = reordered_weight(layer) if reordered else layer["weight"]
    width = schedule.rpartition("-")[2]
    how = (schedule == "stream-k", int(width) if width.isdigit() else 256, reordered, splits)
    added = {} if residual is None else {"residual": residual, "scale": scale}
    in_sum = norm is not None and norms_in_sum(norm, layer["weight"].shape[0])
    if in_sum:
        added |= {"norm_weight": norm.weight, "norm_bias": norm.get("bias"), "eps": norm.eps}
    if layer.mode == "mxfp4":
        y = _extension().mxfp4_matmul(x, weight, *scales, *how, **added)
    else:
        y = _extension().quantized_matmul(x, weight, *scales, layer.bits, layer.group_size, *how, **added)
    if norm is not None:
        return y if in_sum else (y, norm(y))
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


# The weight types and layouts cutlass_qmm_gemm.cu is compiled for, one object each (the .cuh's
# ESMC_QMM_EACH_WEIGHT): the 36 GEMM instantiations in six compiles that run side by side.
WEIGHTS = [
    (quant, layout)
    for quant in ("cutlass::float_e2m1_t", "cutlass::uint4b_t", "uint8_t")
    for layout in ("esmc_qmm::ReorderedWeight", "cutlass::layout::RowMajor")
]


def build_commands(
    output: Path, work: Path, nvcc: str = "nvcc", mlx_root: Path | None = None, python_include: str | None = None
) -> tuple[list[list[str]], list[str]]:
    """(compile commands, link command) that build the extension into ``output``, objects in
    ``work``: the primitive, nanobind, and cutlass_qmm_gemm.cu once per weight type and layout, each
    its own nvcc (run side by side), then one link. Against this process's MLX and Python, or
    another's (``mlx_root``, an MLX CUDA install's ``mlx`` folder, and ``python_include``, that
    Python's headers: scripts/device_setup.py builds here for the GPU machine)."""
    found = shutil.which(nvcc)
    if found is None:
        raise BuildError(
            f"{nvcc} not found: the CUDA toolkit's compiler builds this extension (CUDA 13, as MLX's wheel)"
        )
    mlx_root = Path(mlx_root or Path(mx.__file__).resolve().parent)
    if not (mlx_root / "include" / "cutlass").is_dir() or not (mlx_root / "lib").is_dir():
        raise BuildError(
            f"{mlx_root} has no CUTLASS headers or libmlx: install MLX's CUDA build (pip install 'mlx[cuda13]')"
        )
    try:
        import nanobind
    except ImportError:
        raise BuildError(
            "nanobind not found: " + install_hint("cutlass") + " (nanobind 3.0 or 3.1: MLX 0.32's binding ABI)"
        ) from None
    if not nanobind.__version__.startswith(("3.0.", "3.1.")):
        raise BuildError(
            f"nanobind {nanobind.__version__} does not share MLX 0.32's binding ABI (nanobind 3.0 and 3.1 do): "
            + install_hint("cutlass")
        )
    nb_source = Path(nanobind.source_dir())
    flags = [
        "-std=c++20",
        "-O3",
        "-DNDEBUG",  # CUTLASS's device asserts are calls that serialize the wgmma pipeline
        "-DFMT_HEADER_ONLY",
        "-DNB_DOMAIN=mlx",  # mlx.core's nanobind domain: our functions take its arrays
        f"-arch={HOPPER}",  # wgmma and TMA: Hopper only
        "--expt-relaxed-constexpr",
        "--diag-suppress=186,997,2908",
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        f"-I{mlx_root / 'include'}",
        f"-I{_fmt_include()}",
        f"-I{nanobind.include_dir()}",
        f"-I{nb_source.parent / 'ext' / 'robin_map' / 'include'}",
        f"-I{python_include or sysconfig.get_paths()['include']}",
    ]
    units = [(SOURCE, []), (nb_source / "nb_combined.cpp", [])]
    units += [(GEMM_SOURCE, [f"-DESMC_QMM_QUANT={q}", f"-DESMC_QMM_LAYOUT={lay}"]) for q, lay in WEIGHTS]
    compiles, objects = [], []
    for i, (unit, defines) in enumerate(units):
        objects.append(str(work / f"unit{i}.o"))
        compiles.append([found, *flags, *defines, "-c", str(unit), "-o", objects[-1]])
    link = [found, f"-arch={HOPPER}", "-shared", *objects, f"-L{mlx_root / 'lib'}", "-lmlx"]
    link += ["-Xlinker", f"-rpath,{mlx_root / 'lib'}", "-o", str(output)]
    return compiles, link


def run_build(compiles: list[list[str]], link: list[str], jobs: int | None = None) -> None:
    """The compiles, ``jobs`` at a time (default: one a CPU), then the link; BuildError with
    nvcc's first errors when one fails."""
    jobs = max(1, jobs or os.cpu_count() or 1)
    pending, running = list(compiles), []
    while pending or running:
        while pending and len(running) < jobs:
            command = pending.pop(0)
            running.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        done = running.pop(0)
        _, stderr = done.communicate()
        if done.returncode != 0:
            for other in running:
                other.kill()
            errors = [line for line in stderr.splitlines() if " error" in line]
            raise BuildError("nvcc failed: " + ("; ".join(errors[:3]) or stderr.strip()[-500:]))
    done = subprocess.run(link, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError("linking the extension failed: " + done.stderr.strip()[-500:])


def build(nvcc: str = "nvcc", log=print, jobs: int | None = None) -> Path:
    """Build the extension for this MLX and Python into ``build_dir()``, its compiles ``jobs`` at
    a time; it is moved there only once the link has finished."""
    folder = build_dir()
    if folder is None:
        raise BuildError("the esmc-mlx cache is off (ESMC_MLX_CACHE=off): the extension is kept there")
    target = folder / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    if device.arch() != HOPPER:
        raise BuildError(
            f"CUTLASS's Hopper kernel runs on a compute capability 9.0 GPU only (this device: {device.arch() or 'none'})"
        )
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        partial = Path(work) / target.name
        compiles, link = build_commands(partial, Path(work), nvcc)
        jobs = max(1, jobs or os.cpu_count() or 1)
        log(f"Building {target.name} (CUTLASS: {len(compiles)} compiles, {min(jobs, len(compiles))} at a time) ...")
        run_build(compiles, link, jobs)
        os.replace(partial, target)
    _extension.cache_clear()
    return target
