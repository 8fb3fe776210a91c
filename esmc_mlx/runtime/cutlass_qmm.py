"""CUTLASS's Hopper mixed-input GEMM for affine 4- and 8-bit and mxfp4 weights: an MLX C++
primitive, built on the machine, used wherever it is built unless ``ESMC_MLX_CUTLASS_QMM=0``
(issue 16, thirty-first to thirty-sixth sessions).

Why it exists: past the fused kernel's token window, a quantized layer on CUDA dequantizes its
weight to a bf16 copy and runs cuBLAS on it. At 1024 tokens on the 6B that copy's bytes are a
floor no dequantize kernel gets under (docs/benchmarks.md, "Misses"). CUTLASS's mixed-input GEMM
reads the packed weight itself and dequantizes it in registers on its way to the tensor cores.
Where it won in whole forwards on the H200, and by how much, is quantized.CUTLASS_TOKENS and
its comment; elsewhere the tables keep dequantize + matmul. With whole tiles per SM its outputs
equalled dequantize + matmul's to the bit in every whole forward compared; where those tiles
would leave the last wave short it runs stream-K (``schedule``), whose split sums round
differently (deterministically).

Why C++: ``mx.fast.cuda_kernel`` cannot launch it. CUTLASS's Hopper kernels take TMA
descriptors that the host encodes from the arrays' addresses, and a launch bound; a custom
kernel sees neither. An MLX extension's ``eval_gpu`` has the addresses and adds the kernel to
MLX's CUDA graph as MLX does with its own (cutlass_qmm.cu). CUTLASS's headers come with MLX's
CUDA wheel; the build needs nvcc, nanobind 3.0 or 3.1 (MLX 0.32's binding ABI, internals v22)
and fmt's headers (MLX's headers include them; torch ships a copy). CUTLASS's mainloop takes one
scale a row per K tile, at least 64 wide ("Consider increasing TileShapeK"), and mxfp4's groups
are 32: its scales go in as pairs (``scale_pairs``), each K tile's two, and the .cu's own
dequantize step picks one per half tile. mxfp8 does not take it (no e4m3 path written).

    pip install 'esmc-mlx[cutlass]'           # nanobind
    esmc-mlx build-cutlass                     # into <cache>/cutlass_qmm/mlx-<version>-<source hash>/
    esmc-mlx ...                               # used from then on (ESMC_MLX_CUTLASS_QMM=0: not)

A layer takes it where its weight qualifies (``eligible``) and the tables send its calls by
dequantize + matmul (QuantizedLinear.policy), at token counts up to its table's
CUTLASS_TOKENS (``ESMC_MLX_CUTLASS_QMM=1``: at every count, for benchmarks), and inside the
fused kernel's windows from its table's CUTLASS_OVER_FUSED, weight by weight (from 128 tokens:
every weight of the 300M, the 600M and the 6B; the 6B's o_proj and down_proj since split-K,
``schedule``, runs their few tiles in slabs of K side by side; the kernel that sums those slabs
also adds the residual stream and computes the LayerNorm after it, ``matmul``'s ``residual``
and ``norm``).
It keeps a copy of its scales and biases transposed to [K / group, N], as CUTLASS wants them
(1/16 of a byte a weight at groups of 64: 0.4 GB for the 6B; mxfp4's pairs 1/16 too), and one
of its packed weight in the order the kernel's threads read it (``reorder``: 5-16% off a call
with 4-bit weights, 1-7% with 8-bit; the weight's bytes again, 3.2 GB for the 6B).
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

from ..errors import EsmcMlxError, EsmcMlxWarning
from ..hashes import cache_root
from . import kernel_cache, kernels

ENV = "ESMC_MLX_CUTLASS_QMM"
SOURCE = Path(__file__).with_name("cutlass_qmm.cu")
HEADERS = (kernels.ROW_HEADER_FILE,)  # what SOURCE includes from this package
MODULE = "_cutlass_qmm"
# CUTLASS's tile (cutlass_qmm.cu): 128 weight rows by 256 tokens by 64 of K. At 1024 and 4096
# tokens it beat the 128 x 128 tile on every 6B weight (0.71-0.94x its time, standalone) and in
# whole forwards (thirty-second session).
TILE_ROWS, TILE_TOKENS, TILE_K = 128, 256, 64
# Its narrower tiles (QmmTile128, QmmTile192), whole tiles, the narrowest whose tiles take no
# more waves of the SMs than the 256-token ones: each finishes sooner. The 6B's o_proj at 1024
# tokens (80 or 120 tiles on 132 SMs) 32.1 -> 27.7 us with 192 (cuBLAS on bf16 22.2); on weights
# where it takes an extra wave it lost (q/k/v 62 -> 75, gate/up 117 -> 125; Nsight Compute,
# thirty-fourth issue-16 session). The 128-token tile (forty-third session, reordered weights; us,
# 192 -> 128, affine4 / affine8 / mxfp4): the 6B's q/k/v at 256 tokens 24.4 / 24.7 / 24.5 ->
# 19.8 / 21.1 / 21.5, at 128 tokens 22.0 / 23.6 / 23.4 -> 19.3 / 20.2 / 20.8, its gate/up at 128
# tokens 23.2 / 24.6 / 24.3 -> 20.0 / 21.1 / 21.3; the 300M's weights at 128-256 tokens 10-15%
# less. Four 6B layers' kernels at 1x256 1.160 / 1.171 / 1.157 -> 1.124 / 1.146 / 1.142x bf16's.
# (The thirty-ninth session tried it with a 64-token tile, in MLX's layout and without split-K,
# and dropped it: the o_proj and down_proj then ran 64-wide tiles.)
NARROW_TILES = (128, 192)  # tokens, narrowest first
SCHEDULES = ("persistent", "stream-k", "persistent-192", "persistent-128", "split-k", "split-k-128")
SCHEDULE_ENV = "ESMC_MLX_CUTLASS_SCHEDULE"  # one of SCHEDULES: every call so (benchmarks)
# Stream-K (every output tile's K iterations shared evenly among the SMs, partial sums fixed up
# in a fixed order) for a call whose whole tiles would fill less than STREAM_K_BELOW_FILL of the
# SMs' waves and that has at least STREAM_K_MIN_ITERATIONS tile-K iterations to share; whole tiles
# ("persistent") otherwise. Measured on the H200 (thirty-third issue-16 session, docs/benchmarks.md):
# - Per kernel (Nsight Compute, 6B, affine4, 1024 tokens; us, persistent -> stream-K; cuBLAS on
#   the bf16 weight beside): down_proj (80 tiles, 0.61 of a wave, 8640 iterations) 74.0 -> 60.3
#   (50.0); gate/up (432 tiles, 0.82, 17280) 120.4 -> 113.4 (98.9); o_proj (80 tiles, 0.61, 3200)
#   31.5 -> 32.7 (22.0); q/k/v (240 tiles, 0.91) 61.3 -> 68.5 (58.0).
# - Whole forwards, quantized / bf16 (affine4, affine8): 6B 1x1024 persistent 1.17, 1.16 ->
#   stream-K below the fill alone 1.13, 1.11; 1x2048 1.17, 1.15 -> 1.07, 1.07. The 300M at 1x1024
#   (all its weights under the fill; at most 2400 iterations a call): 0.92, 0.91 -> 1.10, 1.11,
#   where its host-bound forward pays for each call's workspace and fix-up: hence the floor.
# Where whole tiles take one wave, stream-K's fix-ups cost more than the idle SMs it puts to work
# unless those are at least a third (STREAM_K_ONE_WAVE_BELOW_FILL). Per kernel at 256 tokens (ncu,
# fortieth session; us, persistent -> stream-K): the 6B's gate/up (108 tiles, 0.82 of the wave)
# 30.8 -> 34.7 (affine4), 31.3 -> 33.4 (mxfp4), 30.8 -> 33.5 (affine8); its down_proj (20 tiles,
# 0.15) 71.4 -> 42.1; at 1024 tokens (80 tiles, 0.61) 74.0 -> 60.3 (thirty-third).
STREAM_K_BELOW_FILL = 0.9
STREAM_K_ONE_WAVE_BELOW_FILL = 0.7
STREAM_K_MIN_ITERATIONS = 4096
# Split-K (K cut into equal slabs run side by side as a batch of whole tiles, their fp32 partial
# products summed in order by a second kernel) for a call whose whole tiles fill less than
# SPLIT_K_BELOW_FILL of one wave and whose K is at least SPLIT_K_MIN_K: as many slabs as still fit
# that wave (``splits``), each at least SPLIT_K_MIN_SLAB of K. Unlike stream-K's fix-up (and
# CUTLASS's own split-K, the same scheduler: ~5 us more a part, fortieth session) no SM waits on
# another; the cost is the partial products' round trip (slabs x rows x tokens x 4 bytes, written
# and read once more), which a tile's K loop must be long enough to pay for. Per call (Nsight
# Compute, forty-third issue-16 session; us, affine4 / affine8 / mxfp4, the path before -> split):
# - 6B at 256 tokens (20 tiles, 0.15 of 132 SMs): o_proj (K 2560) fused 18.1 / 25.2 / 18.1 -> 5
#   slabs 15.9 / 16.0 / 15.8; down_proj (K 6912) fused 29.9 / 32.1 / 29.7 -> 6 slabs 22.8 / 22.9 /
#   22.5; at 128 tokens o 16.0 / 16.9 / 16.8 -> 14.4 / 14.4 / 14.2, down 28.7 / 31.7 / 31.2 ->
#   20.6 / 22.8 / 20.5 (cuBLAS on bf16: o 8.1, down 18.5 at 256).
# - Not where the tiles fill more or K is short: the 6B's q/k/v (60 tiles, 0.45) at 256 tokens
#   26.0 / 25.8 / 24.4 (128 x 192 tiles) -> 2 slabs 24.8 / 25.0 / 24.5, at 128 tokens 22.0 / 23.5 /
#   23.5 -> 24.3 / 26.8 / 23.3; the 300M's o_proj (K 960, 8 tiles) 10.8 -> 11.3, its q/k/v
#   (23 tiles) 11.2 -> 12.6, its gate/up (40) 11.7 -> 15.3, while its down_proj (K 2560) 21.5 ->
#   12.3 at 256 tokens and 22.3 -> 18.1 at 1024 (32 tiles, 0.24).
# A product added to the residual stream (``matmul``'s ``residual``: the o_proj and down_proj)
# splits from a shorter K, SPLIT_K_MIN_K_ADDED: its slabs' sum then does the add, whose own
# kernel and graph node it replaces (forty-fourth session, below ``adds_residual``).
SPLIT_K_BELOW_FILL = 0.3
SPLIT_K_MIN_K = 2048
SPLIT_K_MIN_K_ADDED = 512
SPLIT_K_MIN_SLAB = 256
# Split-K's tiles: of these token widths, the one whose slabs leave each tile the least K x tokens
# (``split_tile``), the first on a tie. 128-token tiles against 256 (Nsight Compute, forty-sixth
# issue-16 session; us, affine4 / affine8 / mxfp4, the slabs' sum included):
# - The 300M at 256 tokens: o_proj (3 slabs) 11.4 / 11.5 / 11.4 -> 9.2 / 9.3 / 9.4, down_proj (10
#   slabs -> 8) 12.5 / 12.5 / 12.4 -> 10.8 / 11.2 / 11.0; its eight layers' kernels at 1x256 affine4
#   0.604 -> 0.576 ms, affine8 0.621 -> 0.592 (bf16 0.504): 1.20 / 1.23 -> 1.14 / 1.18x bf16's.
# - The 6B at 128 tokens (a 256-token tile half empty): o_proj 14.1 / 14.3 / 14.0 -> 11.2 / 11.6 /
#   11.6, down_proj 21.0 / 22.7 / 20.7 -> 15.5 / 16.3 / 16.4. Whole forwards (host-bound) at 1x128
#   to 1x512: 0.93-0.99 of the time before in all 11 cells (benchmarks.cutlass_qmm_ab --sides
#   split-k-256,shipped).
# - Ties: the 6B's down_proj at 256 tokens (6 slabs of 256 or 3 of 128) 23.4 / 23.2 / 22.8 against
#   22.8 / 24.0 / 24.3, so the wider; the 300M's down_proj at 512 and 1024 tokens would take 13-17%
#   and 3-8% less with the narrower, which whole forwards there (host-bound) did not show: left.
SPLIT_K_TILES = (TILE_TOKENS, 128)
SPLITS_ENV = "ESMC_MLX_CUTLASS_SPLITS"  # split-K's slab count, where it runs (benchmarks)
# The kernel takes each weight in the layout of the .cu's ReorderAtom (each thread's eight values
# of a k-block side by side: one shared-memory load where MLX's layout took four sub-word ones),
# a copy made on the layer's first call and kept beside MLX's (which mx.quantized_matmul, the
# fused kernel and dequantize read): the packed weight's bytes once more for each weight CUTLASS
# has taken (the 6B's affine4 7.16 GB against 3.99 after forwards that reach every weight;
# benchmarks.cutlass_reorder_cost). Per call (Nsight Compute, forty-second issue-16 session; us,
# MLX's layout -> reordered, cutlass_qmm.schedule's choice): the 6B at 256 tokens, affine4 q/k/v
# 26.7 -> 23.4, o_proj 25.5 -> 21.9, gate/up 30.9 -> 29.3, down 60.7 -> 51.1 (affine8 1-7% less,
# mxfp4 4-11%); at 1024 tokens the gate/up 113.2 -> 104.8; the 300M's four weights 2-14% less.
# Whole forwards, quantized / bf16: the 6B at 1x1024 affine4 1.102 -> 1.027, affine8 1.083 ->
# 1.050; the 300M at 1x256 0.935 -> 0.866 and 0.890 -> 0.846. ESMC_MLX_CUTLASS_REORDER=0 keeps
# MLX's layout (and no copy).
REORDER_ENV = "ESMC_MLX_CUTLASS_REORDER"
REORDER_BLOCK = 16  # ReorderAtom's rows and K
HOPPER = "sm_90a"  # what the build targets (-arch); the kernel runs on nothing else


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


def runs_here() -> bool:
    """Whether the default device runs the extension's code: sm_90a, Hopper only."""
    return kernel_cache.device_arch() == HOPPER


def enabled() -> bool:
    """Built for this MLX and Python, on a Hopper GPU, and not turned off (``ESMC_MLX_CUTLASS_QMM=0``)."""
    return os.environ.get(ENV) != "0" and runs_here() and _extension() is not None


def why_unused() -> str | None:
    """Why quantized layers on this Hopper GPU do without the extension: turned off, or not built
    for this MLX and cutlass_qmm.cu (the bench says so beside its ratios, which move with it);
    None where they take it, or where it cannot run."""
    if not runs_here() or enabled():
        return None
    if os.environ.get(ENV) == "0":
        return f"turned off ({ENV}=0)"
    return "not built for this MLX and esmc-mlx (esmc-mlx build-cutlass builds it)"


def forced() -> bool:
    """``ESMC_MLX_CUTLASS_QMM=1``: every call the tables give to dequantize + matmul, whatever
    its token count (benchmarks.cutlass_qmm_ab's side)."""
    return os.environ.get(ENV) == "1"


def eligible(layer: nn.Module) -> bool:
    """Whether the kernel takes ``layer``'s weight: affine 4- or 8-bit in groups of 64 or 128
    (CUTLASS's K tile is 64) with bfloat16 scales, or mxfp4 with K a multiple of 64 (a K tile's
    two groups) and every scale in the kernel's range (``scale_pairs``); N a multiple of 8
    (16-byte rows of y)."""
    if layer["weight"].shape[0] % 8:
        return False
    if layer.mode == "mxfp4":  # K = 8 a packed word: a multiple of 64
        return layer["weight"].shape[1] % 8 == 0 and bool(kernel_scales(layer))
    if layer.mode != "affine" or layer.bits not in (4, 8) or layer.group_size not in (64, 128):
        return False
    return layer["scales"].dtype == mx.bfloat16


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
    is MLX's subnormal 2^-127, so 2^-1 here. The exact decode, 2^(e-127), is kernels.py's device
    function ``e8m0_bf16`` (CUDA source for the fused kernel; this one runs once a layer in MLX)."""
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
    rows, k = kernels.dequantized_shape(q, bits)
    if rows % REORDER_BLOCK or k % REORDER_BLOCK:
        raise ValueError(f"a reordered weight's rows and K must be multiples of {REORDER_BLOCK}: {rows} x {k}")
    v0 = 2 if bits == 8 else 1  # its own axis, or inside the byte
    # row block, v1, g; column block, v2, t, v0
    blocks = q.view(mx.uint8).reshape(rows // REORDER_BLOCK, 2, 8, k // REORDER_BLOCK, 2, 4, v0)
    return blocks.transpose(3, 0, 2, 5, 4, 1, 6).reshape(rows, -1).view(mx.uint32)


def reorders(layer: nn.Module) -> bool:
    """Whether ``layer`` hands the kernel its weight reordered: unless ``ESMC_MLX_CUTLASS_REORDER=0``
    or its rows are not whole blocks of the reorder (K is: whole groups of 64 or 128)."""
    return os.environ.get(REORDER_ENV) != "0" and layer["weight"].shape[0] % REORDER_BLOCK == 0


def reordered_weight(layer: nn.Module) -> mx.array:
    """``layer``'s weight in reorder's layout, made on the first call and kept on the layer (as
    kernel_scales keeps its scales)."""
    weight = getattr(layer, "cutlass_weight", None)
    if weight is None:
        weight = reorder(layer["weight"], layer.bits)
        mx.eval(weight)
        object.__setattr__(layer, "cutlass_weight", weight)  # not a parameter
    return weight


def tiles(rows: int, tokens: int, tile_tokens: int = TILE_TOKENS) -> int:
    """How many 128 x ``tile_tokens`` tiles cover a (rows x tokens) output."""
    return -(-rows // TILE_ROWS) * -(-tokens // tile_tokens)


def waves(rows: int, tokens: int, sms: int, tile_tokens: int = TILE_TOKENS) -> int:
    """How many rounds of ``sms`` SMs whole tiles of a (rows x tokens) output take."""
    return -(-tiles(rows, tokens, tile_tokens) // sms)


def wave_fill(rows: int, tokens: int, sms: int, tile_tokens: int = TILE_TOKENS) -> float:
    """The share of ``sms`` SMs' waves that whole tiles of a (rows x tokens) output keep busy: 80
    tiles on 132 SMs (the 6B's 2560-row weights at 1024 tokens) fill 0.61."""
    return tiles(rows, tokens, tile_tokens) / (waves(rows, tokens, sms, tile_tokens) * sms)


def sm_fill(rows: int, tokens: int, k: int, unit: int = TILE_K) -> float:
    """The share of this GPU's SMs' waves a call of ``tokens`` rows through a (rows x k) weight
    keeps busy: wave_fill of the tiles ``schedule`` picks, each counted once per slab where it
    splits K."""
    chosen, parts = plan(rows, tokens, k, unit)
    return wave_fill(rows, tokens, _extension().sm_count(), tile_width(chosen)) * parts


def split_unit(layer: nn.Module) -> int:
    """What each of split-K's slabs of K must be a multiple of: whole K tiles and whole scale
    groups (mxfp4's scale pairs: 64)."""
    return TILE_K if layer.mode == "mxfp4" else max(TILE_K, layer.group_size)


def tile_width(chosen: str) -> int:
    """The token width of the tiles schedule ``chosen`` (one of SCHEDULES) runs."""
    width = chosen.rpartition("-")[2]
    return int(width) if width.isdigit() else TILE_TOKENS


def splits(rows: int, tokens: int, k: int, unit: int = TILE_K, tile_tokens: int = TILE_TOKENS) -> int:
    """How many slabs split-K cuts a (rows x k) weight's K into for ``tokens`` rows: the most
    whose whole tiles (``tile_tokens`` wide) still take one wave of the SMs, each a multiple of
    ``unit`` and at least SPLIT_K_MIN_SLAB; 1 where none fits. ``SPLITS_ENV`` forces a count
    wherever it cuts K into whole units (elsewhere 1: a forward's other weights keep whole tiles)."""
    forced = os.environ.get(SPLITS_ENV, "")
    if forced.isdigit() and int(forced) >= 1:
        return int(forced) if k % (int(forced) * unit) == 0 else 1
    most = _extension().sm_count() // tiles(rows, tokens, tile_tokens)
    fitting = [s for s in range(2, most + 1) if k % (s * unit) == 0 and k // s >= SPLIT_K_MIN_SLAB]
    return max(fitting, default=1)


def split_tile(rows: int, tokens: int, k: int, unit: int = TILE_K) -> tuple[int, int]:
    """Split-K's tile width for a call, of SPLIT_K_TILES, and its slab count (``splits``): the
    width whose slabs leave each tile the least of K x tokens, the first on a tie, of those that
    split K; (TILE_TOKENS, 1) where none does."""
    split = [(t, splits(rows, tokens, k, unit, t)) for t in SPLIT_K_TILES]
    return min((ts for ts in split if ts[1] > 1), key=lambda ts: ts[0] / ts[1], default=(TILE_TOKENS, 1))


def schedule(rows: int, tokens: int, k: int, unit: int = TILE_K, added: bool = False) -> str:
    """Which of SCHEDULES a call of ``tokens`` rows through a (rows x k) weight takes
    (``SCHEDULE_ENV`` forces one): split-K, in ``split_tile``'s tiles, where whole tiles fill
    less than SPLIT_K_BELOW_FILL of one wave, K is at least SPLIT_K_MIN_K (SPLIT_K_MIN_K_ADDED
    for a product ``added`` to a residual stream) and splits (``splits``, slabs a multiple of
    ``unit``), else stream-K where the wide tiles leave the last wave short (in a single wave, a
    third of it idle) and there is K to share, else the narrowest of NARROW_TILES that takes no
    more waves, else whole wide tiles."""
    chosen = os.environ.get(SCHEDULE_ENV, "")
    if chosen in SCHEDULES:
        return chosen
    sms = _extension().sm_count()
    min_k = SPLIT_K_MIN_K_ADDED if added else SPLIT_K_MIN_K
    if tiles(rows, tokens) < SPLIT_K_BELOW_FILL * sms and k >= min_k:
        width, parts = split_tile(rows, tokens, k, unit)
        if parts > 1:
            return "split-k" if width == TILE_TOKENS else f"split-k-{width}"
    iterations = tiles(rows, tokens) * -(-k // TILE_K)
    below = STREAM_K_BELOW_FILL if waves(rows, tokens, sms) > 1 else STREAM_K_ONE_WAVE_BELOW_FILL
    if iterations >= STREAM_K_MIN_ITERATIONS and wave_fill(rows, tokens, sms) < below:
        return "stream-k"
    for narrow in NARROW_TILES:
        if waves(rows, tokens, sms, narrow) <= waves(rows, tokens, sms):
            return f"persistent-{narrow}"
    return "persistent"


def plan(rows: int, tokens: int, k: int, unit: int = TILE_K, added: bool = False) -> tuple[str, int]:
    """``schedule``'s choice for a call and its slab count: ``splits`` of its tiles under split-K,
    else 1."""
    chosen = schedule(rows, tokens, k, unit, added)
    return chosen, splits(rows, tokens, k, unit, tile_width(chosen)) if chosen.startswith("split-k") else 1


# The residual add in split-K's sum (QuantizedLinear.added_to; model.residual_norm hands each
# o_proj and down_proj its residual stream). H200, forty-fourth issue-16 session, the add by
# MLX's ops -> in the sum (docs/benchmarks.md):
# - Kernels of four 6B layers at 1x256 (Nsight Compute, python -m benchmarks.host_overhead
#   --layers 4 --profile, ESMC_MLX_FUSED_NORM=0 for the side before): affine4 0.563 -> 0.544 ms,
#   affine8 0.573 -> 0.546 (bf16 0.498): 1.13 / 1.15 -> 1.09 / 1.10x. The add's kernel (3.2 us a
#   call) is gone; the sum takes 4.8 us a call instead of 4.3.
# - Whole forwards, quantized / bf16 (python -m benchmarks.cutlass_qmm_ab --sides
#   ops-residual,shipped; a host-bound machine, the 6B's bf16 twin at 15.8-22.4 ms): 6B 1x256
#   0.88 -> 0.79 (affine4), 0.91 -> 0.82 (affine8), 0.91 -> 0.86 (mxfp4); 1x128 0.90 -> 0.88,
#   0.92 -> 0.85, 0.86 -> 0.80. The graph node it saves (two a block) is host time there.
# - SPLIT_K_MIN_K_ADDED 512 against 2048 (the 300M's o_proj, K 960, in 3 slabs against whole
#   128 x 128 tiles and the add's kernel; sides added-min-k-2048,shipped, another host-bound
#   machine): the 300M at 1x128, 1x256 and 1x1024 ahead in 7 of 9 cells (0.965-0.992 of the
#   time; affine4 behind at 1x256, 1.011, level at 1x1024); its eight layers' kernels at 1x256
#   affine4 1.21 -> 1.19x bf16's, affine8 1.23 -> 1.24.
# The LayerNorm after the residual add in the same kernel (sum_splits_norm in the .cu): the
# o_proj's post-attention LayerNorm and the down_proj's next input LayerNorm (or the final one)
# without a kernel and graph node of their own. MLX's LayerNorm took 4.1-4.6 us a call at 256
# tokens, while the sum went 2.7-3.9 -> 3.5-4.9 us (300M) with it. H200, forty-seventh issue-16
# session (Nsight Compute, python -m benchmarks.host_overhead --profile; the side before ran
# with NORM_IN_SUM False), layers' kernels over bf16's, affine4 / affine8 / mxfp4:
# - the 300M's eight layers at 1x256 1.137 / 1.164 / 1.155 -> 1.004 / 1.056 / 1.024; at 1x1024
#   affine4 1.175 -> 1.069;
# - the 6B's four layers at 1x256 affine4 1.082 -> 0.989, mxfp4 1.098 -> 0.997.
# Whole forwards (host-bound; benchmarks.cutlass_qmm_ab --sides norm-after-sum,shipped): the 6B
# at 1x256 0.736 -> 0.686 (affine4), 0.739 -> 0.717 (mxfp4); the 300M at 1x256 and 1x1024 level
# or ahead in 5 of 6 cells (affine8 at 1x256 0.698 -> 0.738; bf16's 1x256 twin read 8.0-11.2 ms in that run).
NORM_IN_SUM = True  # False: MLX's LayerNorm after the sum (benchmarks.cutlass_qmm_ab's "norm-after-sum")


def norms_in_sum(norm: nn.Module, width: int) -> bool:
    """Whether split-K's sum can hand back ``norm`` (an nn.LayerNorm) of the residual stream it
    makes as well, as mx.fast.layer_norm computes it: a bfloat16 weight (and bias, if any) of the
    product's ``width``, a row that fits the kernel's one block (kernels.fits_a_block)."""
    weight, bias = norm.get("weight"), norm.get("bias")
    if not NORM_IN_SUM or weight is None or not kernels.fits_a_block(width, mx.bfloat16) or not norm.eps > 0:
        return False
    return all(a.dtype == mx.bfloat16 and a.shape == (width,) for a in (weight, bias) if a is not None)


def adds_residual(layer: nn.Module, tokens: int) -> bool:
    """True when the call of ``tokens`` rows through ``layer`` can add a residual stream in the
    kernel that sums its split-K slabs (``matmul``'s ``residual``): split-K runs for it, in two
    slabs or more, and the layer has no bias (which would come before the division)."""
    rows, k = kernels.dequantized_shape(layer["weight"], layer.bits)
    return plan(rows, tokens, k, split_unit(layer), added=True)[1] > 1 and "bias" not in layer


def matmul(
    layer: nn.Module,
    x: mx.array,
    tokens: int,
    residual: mx.array | None = None,
    scale: float = 1.0,
    norm: nn.Module | None = None,
):
    """``x @ dequantize(layer's weight).T`` (+ its bias) by CUTLASS; x in bfloat16, ``tokens``
    rows of it (quantized.token_count). With ``residual`` (where ``adds_residual``): ``residual +
    that / scale``, from the kernel that sums the slabs, each operation rounded to bf16 as MLX's
    ops round it; with ``norm`` too (an nn.LayerNorm), that and ``norm`` of it, the LayerNorm from
    the same kernel where ``norms_in_sum``."""
    if residual is not None and "bias" in layer:
        raise ValueError("[cutlass_qmm] a residual is added to a product without bias only")
    if norm is not None and residual is None:
        raise ValueError("[cutlass_qmm] a LayerNorm comes with a residual only")
    scales = kernel_scales(layer)
    chosen, parts = plan(layer["weight"].shape[0], tokens, x.shape[-1], split_unit(layer), residual is not None)
    reordered = reorders(layer)
    weight = reordered_weight(layer) if reordered else layer["weight"]
    how = (chosen == "stream-k", tile_width(chosen), reordered, parts)
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


def build_command(
    output: Path, nvcc: str = "nvcc", mlx_root: Path | None = None, python_include: str | None = None
) -> list[str]:
    """The nvcc command line that builds the extension into ``output``: against this process's
    MLX and Python, or another's (``mlx_root``, an MLX CUDA install's ``mlx`` folder, and
    ``python_include``, that Python's headers: scripts/device_setup.py builds here for the GPU
    machine)."""
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
        "--diag-suppress=186,997,2908",
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        "-shared",
        f"-I{mlx_root / 'include'}",
        f"-I{_fmt_include()}",
        f"-I{nanobind.include_dir()}",
        f"-I{nb_source.parent / 'ext' / 'robin_map' / 'include'}",
        f"-I{python_include or sysconfig.get_paths()['include']}",
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
