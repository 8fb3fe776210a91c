"""What runs where: pure functions from (a layer's weight, token count, dtype, device) to a plan.

Every choice of kernel is made here and nowhere else, once per layer and shape (cached), from
tuning tables keyed by the architecture they were measured on. A device with no table gets
MLX's own ops, plus the kernels proven for its architecture that need no tuning (``PORTABLE``).
Each kernel names the oldest architecture it compiles for (``REQUIRES``), and no plan holds a
kernel its device cannot run (tests/test_dispatch.py forces sm_80 ... sm_100). The models are
vLLM's mixed-precision kernel list (``can_implement``, ``get_min_capability``) and llama.cpp's
``ggml_cuda_should_use_mmq(type, cc, ne11)``. ``esmc-mlx info MODEL --plan`` prints the plans.
The figures behind each table are rows of docs/decisions.md; ``python -m benchmarks.paths_ab``
re-measures them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import platform
import re

import mlx.core as mx

from .. import settings
from .cuda import cutlass_qmm
from .cuda import device as cuda_device

# The oldest architecture each custom kernel compiles for (NVRTC; tests/test_gpu_plans.py
# compiles every planned kernel for sm_80, sm_86, sm_89, sm_90a and sm_100). "sm_90a": Hopper's
# wgmma / TMA, which run on compute capability 9.0 only; "sm_80": mma.sync, cp.async and
# plain CUDA, which run on sm_80 and every later GPU. None: MLX's own op.
REQUIRES = {
    "dequantize": "sm_80",
    "qmm_1d": "sm_80",
    "qmm_2d": "sm_80",
    "qmm_wg": "sm_90a",
    "split_sum": "sm_80",
    "qkv_heads": "sm_80",
    "add_layer_norm": "sm_80",
    "cutlass": "sm_90a",
}
# Kernels a CUDA device without a tuning table still runs: bit-exact with the MLX ops they
# replace and chosen at every size wherever they apply (no measured threshold to carry over).
PORTABLE = ("qkv_heads",)
# Multiprocessors of the usual GPU of each architecture, for plans of a device described by
# name (``info --plan --device cuda:sm_80``); the device in hand reports its own.
TYPICAL_SMS = {"sm_80": 108, "sm_86": 84, "sm_87": 16, "sm_89": 128, "sm_90a": 132, "sm_100": 148, "sm_120": 170}


def _arch_number(arch: str) -> int:
    found = re.fullmatch(r"sm_(\d{2,3})a?", arch)
    if found is None:
        raise ValueError(f"{arch!r} is not a CUDA architecture (sm_80, sm_90a ...)")
    return int(found.group(1))


@dataclasses.dataclass(frozen=True)
class Device:
    """Where a model runs: ``backend`` cpu, metal or cuda; ``arch`` the CPU's machine name, the
    Metal GPU's name or the CUDA architecture (sm_XY, with the 'a' from compute capability 9);
    ``sms`` a CUDA GPU's multiprocessors."""

    backend: str
    arch: str | None = None
    sms: int = 0

    def runs(self, requires: str | None) -> bool:
        """Whether a kernel that needs ``requires`` runs here: MLX's ops (None) everywhere; an
        arch-specific 'a' target only on its own architecture; any other from its number on."""
        if requires is None:
            return True
        if self.backend != "cuda" or self.arch is None:
            return False
        if requires.endswith("a"):
            return self.arch == requires
        return _arch_number(self.arch) >= _arch_number(requires)

    @classmethod
    def parse(cls, text: str) -> Device:
        """``cpu``, ``metal`` or ``cuda:sm_XY`` (``info --plan --device``)."""
        backend, _, arch = text.strip().lower().partition(":")
        if backend in ("cpu", "metal") and not arch:
            return cls(backend, platform.machine() if backend == "cpu" else None)
        if backend == "cuda" and arch:
            _arch_number(arch)
            return cls("cuda", arch, TYPICAL_SMS.get(arch, 0))
        raise ValueError(f"device {text!r}: use cpu, metal or cuda:sm_XY (for example cuda:sm_80, cuda:sm_90a)")


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: plans are cached per table
class Tuning:
    """One architecture's measured choices. Token counts are rows through a layer (every batch
    dimension flattened). Tables with a "small" and a "large" entry split weights by their
    smaller dimension at ``small_width``: the 300M's and 600M's weights (960, 1152 wide) run
    fastest on other paths than the 6B's (2560)."""

    measured_on: str
    # From this many tokens dequantize + matmul replaces MLX's quantized_matmul (mode name ->
    # tokens; "affine" covers every affine width without its own entry).
    crossover: dict
    small_width: int = 0
    # Token windows [lo, hi) in which the fused kernel (qmm) replaces the path above.
    fused: dict = dataclasses.field(default_factory=dict)
    # The most tokens at which CUTLASS takes the calls that would dequantize.
    cutlass_tokens: dict = dataclasses.field(default_factory=dict)
    # (fewest tokens, least share of the SMs busy) from which CUTLASS takes the fused window's calls.
    cutlass_over_fused: dict = dataclasses.field(default_factory=dict)
    # Residual add + LayerNorm in one kernel from this many values (fewer: MLX's two ops).
    add_norm_from: float = math.inf
    # This project's dequantize kernel for weights at least this wide (narrower: mx.dequantize).
    dequantize_from_width: float = math.inf
    dequantize_blocks_per_sm: int = 32  # the grid-stride loop's blocks: 4 waves of 8 resident blocks
    together_min_weights: int = 2  # a block's weights dequantized in one launch from this many
    # The fused kernel's tile: "1d" below qmm_2d_from tokens, "2d" from there, "wg" from
    # qmm_wg_from (8-bit weights only from qmm_wg_8bit_values values).
    qmm_2d_from: int = 65
    qmm_wg_from: float = math.inf
    qmm_wg_8bit_values: int = 8 << 20
    # CUTLASS's schedules: stream-K where whole tiles fill less of the waves than these (the
    # second for a single wave) and there are this many tile-K iterations to share; split-K
    # where whole tiles fill less than split_k_below of one wave and K is this long.
    stream_k_below: float = 0.9
    stream_k_one_wave_below: float = 0.7
    stream_k_min_iterations: int = 4096
    split_k_below: float = 0.3
    split_k_min_k: int = 2048
    split_k_min_k_added: int = 512  # a product whose slabs' sum also adds the residual stream
    split_k_min_slab: int = 256


# H200 (MLX 0.32.4, bf16, whole forwards of random-weight ESMC at B=1 and at the bench's shapes;
# docs/decisions.md has each figure). It serves every compute capability 9.0 GPU (H100, H200,
# GH200): the same SMs and instructions; the SM count comes from the device.
HOPPER = Tuning(
    measured_on="H200 (sm_90a, 132 SMs), MLX 0.32.4",
    crossover={
        "large": {"affine": 32, "mxfp4": 16, "mxfp8": 32, "nvfp4": 32},
        "small": {"affine": 32, "affine2": 64, "affine8": 128, "mxfp4": 32, "mxfp8": 32, "nvfp4": 512},
    },
    small_width=2048,
    fused={
        "large": {"affine4": (8, 257), "mxfp4": (8, 257), "affine8": (32, 257)},
        "small": {"affine4": (32, 1024), "mxfp4": (32, 1024), "affine8": (32, 384)},
    },
    cutlass_tokens={"large": 2048, "small": 4096},
    cutlass_over_fused={"small": (128, 0.0), "large": (128, 0.4)},
    add_norm_from=8 << 20,
    dequantize_from_width=1024,
    qmm_wg_from=129,
)
# This project's x86-64 CPU hosts, MLX + OpenBLAS (benchmarks/quant_matmul.py): MLX's CPU
# quantized_matmul runs at a few GFLOP/s, so dequantize + an fp32 GEMM wins early.
X86_CPU = Tuning(
    measured_on="2-core x86-64 host, MLX 0.32.4 + OpenBLAS",
    crossover={"all": {"affine": 8, "mxfp8": 4, "mxfp4": 32, "nvfp4": 32}},
)
# Keyed by Device.arch ("cpu-" + machine for CPUs). Metal and every CUDA architecture not named
# here: MLX's own ops (mx.quantized_matmul at every token count, as mlx-lm) and PORTABLE.
TUNING = {"sm_90a": HOPPER, "cpu-x86_64": X86_CPU}


def tuning_for(device: Device) -> Tuning | None:
    key = f"cpu-{device.arch}" if device.backend == "cpu" else device.arch
    return TUNING.get(key)


@dataclasses.dataclass(frozen=True)
class Target:
    """A device and what may run on it: its ``tuning`` (None: no table measured there),
    ``kernels`` (ESMC_MLX_KERNELS), ``cutlass`` (the extension is built and loads), ``force``
    (ESMC_MLX_PATH)."""

    device: Device
    tuning: Tuning | None = None
    kernels: bool = True
    cutlass: bool = False
    force: str | None = None

    @classmethod
    def of(cls, device: Device, **kw) -> Target:
        """The target of ``device`` with its measured table."""
        return cls(device, tuning_for(device), **kw)

    def allows(self, kernel: str) -> bool:
        """Whether this custom kernel may run here: custom kernels on, the device runs it, and
        either a table measured on this architecture or the kernel is PORTABLE."""
        return self.kernels and self.device.runs(REQUIRES[kernel]) and (self.tuning is not None or kernel in PORTABLE)


@dataclasses.dataclass(frozen=True)
class Weight:
    """A quantized layer's weight as the plans see it: ``rows`` x ``k`` unpacked, ``scales`` the
    scales' dtype name, ``in_range`` whether every mxfp4 scale suits CUTLASS's decode."""

    mode: str
    bits: int
    group_size: int
    rows: int
    k: int
    scales: str = "bfloat16"
    bias: bool = False
    in_range: bool = True

    @property
    def name(self) -> str:
        """ "affine4", "mxfp4" ...: how the tables name a quantization."""
        return f"affine{self.bits}" if self.mode == "affine" else self.mode

    @property
    def width(self) -> int:
        return min(self.rows, self.k)


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    requires: str | None  # None: MLX's own op

    def to_dict(self) -> dict:
        return {"name": self.name, "requires": self.requires}


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs: ``path`` (quantized, dequantize, fused, cutlass; for a float layer
    matmul; for the block's other steps the fusion's name or mlx), the launches in order, why,
    and the kernel's parameters: the fused kernel's ``tile`` and K ``splits``, CUTLASS's
    schedule in ``tile`` and split-K's slabs in ``splits``."""

    path: str
    kernels: tuple[Launch, ...]
    reason: str
    tile: str | None = None
    splits: int = 1

    def to_dict(self) -> dict:
        return {"path": self.path, "kernels": [k.to_dict() for k in self.kernels], "reason": self.reason}


MLX_MATMUL = Launch("mx.matmul", None)


# ---- the fused quantized matmul (cuda/qmm) ---------------------------------------------------
QMM_BW, QMM_BK = 128, 64  # a block's weight rows; K per pipeline step
QMM_2D_TILE = (64, 2, 1)  # tokens, m16 tiles a warp, warps along the tokens
QMM_WG_TOKENS = 256
QMM_RESIDENT = {16: 3, 32: 3, 64: 2, 128: 1, "2d": 1, "wg": 1}  # blocks an SM holds (registers)


def qmm_can_implement(w: Weight, dtype: str) -> tuple[bool, str]:
    """Whether the fused kernel takes this weight and input dtype."""
    if dtype not in ("bfloat16", "float16"):
        return False, f"the fused kernel's tensor cores take bf16 and fp16 inputs, not {dtype}"
    if w.bits not in (4, 8) or w.group_size < 16:
        return False, "the fused kernel takes 4- and 8-bit weights in groups of 16 or more"
    if w.k % QMM_BK or w.rows % 8:
        return False, f"the fused kernel needs K a multiple of {QMM_BK} and N of 8"
    return dequantize_can_implement(w, dtype)


def qmm_tile(w: Weight, tokens: int, target: Target) -> str:
    """The fused kernel's warp tile: "1d" (a warp 16 weight rows x all tokens), "2d" or, where
    Hopper's warpgroup MMA runs and takes the weight, "wg"."""
    t = target.tuning
    values = w.rows * w.k
    wg = tokens >= t.qmm_wg_from and (w.bits != 8 or values >= t.qmm_wg_8bit_values)
    if wg and target.allows("qmm_wg") and w.group_size >= 32:
        return "wg"
    return "2d" if tokens >= t.qmm_2d_from else "1d"


def qmm_splits(w: Weight, tokens: int, tile: str, sms: int) -> tuple[int, int]:
    """(tokens a block, K splits): a block's token tile (the 1d tile: the smallest of 16-128
    that holds the tokens) and, where the tiles fill less than half of one wave of resident
    blocks, K split into fp32 slabs up to that wave, each at least 4 steps, none empty."""
    if tile == "wg":
        bt, bw = QMM_WG_TOKENS, QMM_BW
    elif tile == "2d":
        bt, mi, wn = QMM_2D_TILE
        bw = (8 // wn) * 16 * mi
    else:
        bt, bw = next(b for b in (16, 32, 64, 128) if tokens <= b or b == 128), QMM_BW
    tiles = -(-w.rows // bw) * -(-tokens // bt)
    target = sms * QMM_RESIDENT[bt if tile == "1d" else tile]
    steps = w.k // QMM_BK
    splits = max(1, min(target // tiles, steps // 4)) if 2 * tiles <= target else 1
    per = -(-steps // splits)
    return bt, -(-steps // per)


# ---- this project's dequantize (cuda/dequantize) ---------------------------------------------
AFFINE_BITS, AFFINE_GROUPS = (2, 3, 4, 5, 6, 8), (32, 64, 128)
FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}  # mode -> (bits, group)
FLOATS = ("bfloat16", "float16", "float32")


def dequantize_can_implement(w: Weight, dtype: str) -> tuple[bool, str]:
    """Whether this project's dequantize (and the fused kernel's decode) takes the weight."""
    if dtype not in FLOATS:
        return False, f"no kernel writes {dtype}"
    if w.mode == "affine":
        ok = w.bits in AFFINE_BITS and w.group_size in AFFINE_GROUPS and w.scales in FLOATS
        return ok, "" if ok else "affine weights of 2-8 bits in groups of 32, 64 or 128 with float scales"
    ok = FP_MODES.get(w.mode) == (w.bits, w.group_size)
    return ok, "" if ok else f"{w.mode} in its own bits and group size"


def dequantize_launch(w: Weight, dtype: str, target: Target) -> Launch:
    """Who dequantizes the weight: this project's kernel (measured faster on wide weights) or
    mx.dequantize."""
    t = target.tuning
    if (
        target.allows("dequantize")
        and t
        and w.width >= t.dequantize_from_width
        and dequantize_can_implement(w, dtype)[0]
    ):
        return Launch(dequantize_kernel_name(w, dtype, 1), REQUIRES["dequantize"])
    return Launch("mx.dequantize", None)


def dequantize_kernel_name(w: Weight, dtype: str, weights: int) -> str:
    pairs = "_pairs" if w.mode == "mxfp4" and dtype == "bfloat16" else ""
    return f"esmc_dequantize{weights}_{w.mode}_{w.bits}_{w.group_size}{pairs}"


# ---- CUTLASS's mixed-input GEMM (cuda/cutlass_qmm) -------------------------------------------
TILE_ROWS, TILE_TOKENS, TILE_K = 128, 256, 64
NARROW_TILES = (128, 192)  # tokens, narrowest first
SPLIT_K_TILES = (TILE_TOKENS, 128)


def cutlass_can_implement(w: Weight, dtype: str) -> tuple[bool, str]:
    """Whether CUTLASS's kernel takes the weight: affine 4/8-bit in groups of 64 or 128 with bf16
    scales, or mxfp4 with K a multiple of 64 and every scale in range; N a multiple of 8."""
    if dtype != "bfloat16":
        return False, "CUTLASS's kernel is built for bf16 inputs"
    if w.rows % 8:
        return False, "CUTLASS's kernel needs N a multiple of 8"
    if w.mode == "mxfp4":
        ok = w.k % 64 == 0 and w.in_range
        return ok, "" if ok else "mxfp4 weights with K a multiple of 64 and scales below 2^2"
    ok = w.mode == "affine" and w.bits in (4, 8) and w.group_size in (64, 128) and w.scales == "bfloat16"
    return ok, "" if ok else "affine 4/8-bit weights in groups of 64 or 128 with bf16 scales, or mxfp4"


def _tiles(rows: int, tokens: int, width: int = TILE_TOKENS) -> int:
    return -(-rows // TILE_ROWS) * -(-tokens // width)


def _waves(rows: int, tokens: int, sms: int, width: int = TILE_TOKENS) -> int:
    return -(-_tiles(rows, tokens, width) // sms)


def _wave_fill(rows: int, tokens: int, sms: int, width: int = TILE_TOKENS) -> float:
    """The share of the SMs' waves whole tiles keep busy (80 tiles on 132 SMs: 0.61)."""
    return _tiles(rows, tokens, width) / (_waves(rows, tokens, sms, width) * sms)


def split_unit(w: Weight) -> int:
    """What each split-K slab of K must be a multiple of: whole K tiles and scale groups."""
    return TILE_K if w.mode == "mxfp4" else max(TILE_K, w.group_size)


def _split_k_slabs(rows: int, tokens: int, k: int, unit: int, width: int, t: Tuning, sms: int) -> int:
    """The most slabs whose whole tiles still take one wave, each a multiple of ``unit`` and at
    least ``split_k_min_slab``; 1 where none fits."""
    most = sms // _tiles(rows, tokens, width)
    fitting = [s for s in range(2, most + 1) if k % (s * unit) == 0 and k // s >= t.split_k_min_slab]
    return max(fitting, default=1)


def cutlass_schedule(w: Weight, tokens: int, t: Tuning, sms: int, added: bool = False) -> tuple[str, int]:
    """(schedule, slabs) for a CUTLASS call: split-K in the tile width whose slabs leave each
    tile the least K x tokens where whole tiles fill little of one wave and K is long; else
    stream-K where the last wave is short and there is K to share; else the narrowest tile that
    takes no more waves; else whole 256-token tiles ("persistent")."""
    rows, k, unit = w.rows, w.k, split_unit(w)
    min_k = t.split_k_min_k_added if added else t.split_k_min_k
    if _tiles(rows, tokens) < t.split_k_below * sms and k >= min_k:
        split = [(width, _split_k_slabs(rows, tokens, k, unit, width, t, sms)) for width in SPLIT_K_TILES]
        width, slabs = min((ws for ws in split if ws[1] > 1), key=lambda ws: ws[0] / ws[1], default=(TILE_TOKENS, 1))
        if slabs > 1:
            return ("split-k" if width == TILE_TOKENS else f"split-k-{width}"), slabs
    iterations = _tiles(rows, tokens) * -(-k // TILE_K)
    below = t.stream_k_below if _waves(rows, tokens, sms) > 1 else t.stream_k_one_wave_below
    if iterations >= t.stream_k_min_iterations and _wave_fill(rows, tokens, sms) < below:
        return "stream-k", 1
    for narrow in NARROW_TILES:
        if _waves(rows, tokens, sms, narrow) <= _waves(rows, tokens, sms):
            return f"persistent-{narrow}", 1
    return "persistent", 1


def tile_width(schedule: str) -> int:
    """The token width of the tiles a CUTLASS schedule runs."""
    width = schedule.rpartition("-")[2]
    return int(width) if width.isdigit() else TILE_TOKENS


def _sm_fill(w: Weight, tokens: int, t: Tuning, sms: int) -> float:
    """The share of the SMs' waves a CUTLASS call keeps busy, each tile counted once a slab."""
    schedule, slabs = cutlass_schedule(w, tokens, t, sms)
    return _wave_fill(w.rows, tokens, sms, tile_width(schedule)) * slabs


# ---- a quantized linear ----------------------------------------------------------------------
def _table(t: Tuning, w: Weight, table: dict):
    if "all" in table:
        return table["all"]
    return table.get("small" if w.width < t.small_width else "large", {})


@functools.lru_cache(maxsize=8192)
def linear(w: Weight, tokens: int, dtype: str, target: Target, added: bool = False) -> Plan:
    """The plan for ``tokens`` rows of ``dtype`` through a quantized linear. ``added``: the
    product goes into a residual add that a CUTLASS split-K sum can do (o_proj, down_proj)."""
    t, sms = target.tuning, target.device.sms
    # MLX's quantized_matmul on CUDA returns unstable values for K <= group size (measured:
    # affine 4/8-bit, K 64 and 128); no ESMC weight is that narrow, test models are.
    mlx_fails = target.device.backend == "cuda" and w.k <= w.group_size
    can = {
        "quantized": not mlx_fails,
        "dequantize": True,
        "fused": target.allows("qmm_1d") and qmm_can_implement(w, dtype)[0],
        "cutlass": target.cutlass and target.allows("cutlass") and cutlass_can_implement(w, dtype)[0],
    }
    if target.force and can[target.force]:
        path, reason = target.force, f"forced (ESMC_MLX_PATH={target.force})"
    else:
        path, reason = _automatic(w, tokens, t, sms, can, mlx_fails)
        if target.force:
            reason += f"; ESMC_MLX_PATH={target.force} cannot run this call here"
    if path == "quantized":
        return Plan(path, (Launch("mx.quantized_matmul", None),), reason)
    if path == "dequantize":
        return Plan(path, (dequantize_launch(w, dtype, target), MLX_MATMUL), reason)
    if path == "fused":
        tile = qmm_tile(w, tokens, target)
        bt, splits = qmm_splits(w, tokens, tile, sms)
        launches = [Launch(f"esmc_qmm_{tile}", REQUIRES[f"qmm_{tile}"])]
        if splits > 1:
            launches.append(Launch("esmc_split_sum", REQUIRES["split_sum"]))
        return Plan(path, tuple(launches), reason, tile if tile != "1d" else f"1d-{bt}", splits)
    schedule, slabs = cutlass_schedule(w, tokens, t or HOPPER, sms, added)
    return Plan(path, (Launch(f"cutlass_qmm:{schedule}", REQUIRES["cutlass"]),), reason, schedule, slabs)


def _automatic(w: Weight, tokens: int, t: Tuning | None, sms: int, can: dict, mlx_fails: bool) -> tuple[str, str]:
    """The tables' path: MLX's quantized_matmul below the crossover, dequantize + matmul from it
    (CUTLASS instead up to its token count); the fused kernel inside its window, unless CUTLASS
    takes the call and keeps enough of the SMs busy."""
    if mlx_fails:
        return "dequantize", f"MLX's quantized_matmul fails for K <= group size ({w.k} <= {w.group_size}) on CUDA"
    if t is None:
        return "quantized", "no measured table for this device: MLX's quantized_matmul, as mlx-lm"
    crossover = _table(t, w, t.crossover)
    crossover = crossover.get(w.name, crossover.get(w.mode, math.inf))
    if tokens < crossover:
        path, reason = "quantized", f"quantized_matmul below {crossover:g} tokens"
    else:
        path, reason = "dequantize", f"dequantize + matmul from {crossover:g} tokens"
        most = _table(t, w, t.cutlass_tokens) if t.cutlass_tokens else 0
        if can["cutlass"] and tokens <= most:
            path, reason = "cutlass", f"CUTLASS up to {most} tokens"
    lo, hi = _table(t, w, t.fused).get(w.name, (0, 0)) if t.fused else (0, 0)
    if can["fused"] and lo <= tokens < hi:
        fewest, fill = _table(t, w, t.cutlass_over_fused) if t.cutlass_over_fused else (math.inf, 0.0)
        if path == "cutlass" and tokens >= fewest and _sm_fill(w, tokens, t, sms) >= fill:
            reason += f" (over the fused kernel from {fewest} tokens at {fill:.0%} of the SMs busy)"
        else:
            path, reason = "fused", f"the fused kernel for {lo}-{hi - 1} tokens"
    return path, f"{reason} on {t.measured_on}"


def float_linear() -> Plan:
    return Plan("matmul", (MLX_MATMUL,), "a float weight: MLX's matmul")


# ---- the block's other steps (cuda/fusions) --------------------------------------------------
@functools.lru_cache(maxsize=1024)
def attention_heads(head_dim: int, fused_qkv: bool, dtype: str, target: Target) -> Plan:
    """The QK LayerNorm, RoPE and head layout after the q/k/v projection."""
    if target.allows("qkv_heads") and head_dim == 64 and fused_qkv and dtype in FLOATS:
        return Plan(
            "qkv_heads",
            (Launch("esmc_qkv_heads", REQUIRES["qkv_heads"]),),
            "one kernel in place of seven ops, bit-exact",
        )
    ops = (Launch("mx.fast.layer_norm", None), Launch("mx.fast.rope", None))
    return Plan(
        "mlx",
        ops,
        "MLX's ops" + ("" if target.device.backend != "cuda" else " (no fused q/k/v layout)" if not fused_qkv else ""),
    )


@functools.lru_cache(maxsize=1024)
def residual_norm(values: int, dtype: str, target: Target) -> Plan:
    """A residual add and the LayerNorm after it, over ``values`` values."""
    t = target.tuning
    if target.allows("add_layer_norm") and t is not None and values >= t.add_norm_from and dtype in FLOATS:
        return Plan(
            "add_layer_norm",
            (Launch("esmc_add_layer_norm", REQUIRES["add_layer_norm"]),),
            f"one kernel from {t.add_norm_from:,} values on {t.measured_on}",
        )
    why = (
        f"MLX's ops below {t.add_norm_from:,.0f} values"
        if t is not None and t.add_norm_from < math.inf
        else "MLX's ops"
    )
    return Plan("mlx", (Launch("mx.add", None), Launch("mx.fast.layer_norm", None)), why)


# ---- the target in hand ----------------------------------------------------------------------
def current_device() -> Device:
    if mx.default_device() == mx.cpu:
        return Device("cpu", platform.machine())
    if mx.metal.is_available():
        return Device("metal", str(mx.device_info().get("architecture", "")) or None)
    arch = cuda_device.arch()
    return Device("cuda", arch, cuda_device.sms() or TYPICAL_SMS.get(arch or "", 0))


_USED: list[Target] = []


def current() -> Target:
    """The target of MLX's default device under this process's settings (cached by both), or the
    one ``use`` put in place."""
    if _USED:
        return _USED[-1]
    return _current(str(mx.default_device()), settings.current())


@contextlib.contextmanager
def use(target: Target):
    """Plan every call for ``target`` while the block runs (a benchmark's side, a test)."""
    _USED.append(target)
    try:
        yield target
    finally:
        _USED.pop()


def described(name: str) -> Target:
    """The target of a device given by name (``Device.parse``) under this process's settings,
    CUTLASS counted as built where it runs."""
    chosen = settings.current()
    device = Device.parse(name)
    cutlass = device.runs(REQUIRES["cutlass"]) and chosen.kernels
    return Target.of(device, kernels=chosen.kernels, cutlass=cutlass, force=chosen.path)


@functools.lru_cache(maxsize=16)
def _current(device_key: str, chosen: settings.Settings) -> Target:
    device = current_device()
    built = device.backend == "cuda" and chosen.kernels and cutlass_qmm.available()
    return Target.of(device, kernels=chosen.kernels, cutlass=built, force=chosen.path)


# ---- a model's plans (esmc-mlx info MODEL --plan) --------------------------------------------
def _block_weights(config, record: dict, fused: bool, scales: str) -> list[tuple[str, Weight | None]]:
    """(layer name, weight or None for a float one) of each kind of block projection, in the
    runtime's layout (q/k/v and gate/up fused on a GPU where their parts are quantized alike),
    once per distinct kind across the blocks (mixed recipes quantize blocks differently)."""
    d, f = config.hidden_size, config.intermediate_size
    default = {k: record[k] for k in ("bits", "group_size", "mode") if k in record} if record else None
    groups = (
        ("self_attn", (("q_proj", d, d), ("k_proj", d, d), ("v_proj", d, d)), "qkv_proj"),
        ("self_attn", (("o_proj", d, d),), None),
        ("mlp", (("gate_proj", f, d), ("up_proj", f, d)), "gate_up_proj"),
        ("mlp", (("down_proj", d, f),), None),
    )
    out: dict[tuple, None] = {}
    for i in range(config.num_hidden_layers):
        for owner, parts, fused_name in groups:
            specs = []
            for name, rows, k in parts:
                q = record.get(f"esmc.layers.{i}.{owner}.{name}", default) if record else None
                if isinstance(q, dict) and "bits" in q:
                    mode = q.get("mode", "affine")
                    q = Weight(mode, q["bits"], q["group_size"], rows, k, scales if mode == "affine" else "uint8")
                specs.append(q if isinstance(q, Weight) else None)
            kinds = {None if s is None else (s.mode, s.bits, s.group_size) for s in specs}
            if fused and fused_name and len(kinds) == 1:
                first = specs[0]
                weight = None if first is None else dataclasses.replace(first, rows=sum(s.rows for s in specs))
                out[(f"{owner}.{fused_name}", weight)] = None
            else:
                for (name, _, _), spec in zip(parts, specs):
                    out[(f"{owner}.{name}", spec)] = None
    return list(out)


def model_plan(config, record: dict, stored_dtype: str, tokens: list[int], target: Target) -> list[dict]:
    """What runs for each kind of layer of a model at each token count on ``target``: one dict
    per (layer, tokens) with the plan's path, kernels (each with the architecture it requires)
    and reason."""
    device = target.device
    dtype = "float32" if device.backend == "cpu" else stored_dtype
    weights = _block_weights(config, record or {}, device.backend != "cpu", stored_dtype)
    rows = []
    for n in tokens:
        heads = attention_heads(config.head_dim, device.backend != "cpu", dtype, target)
        rows.append({"layer": "self_attn: q/k LayerNorm, RoPE, heads", "tokens": n, **heads.to_dict()})
        for name, weight in weights:
            plan = float_linear() if weight is None else linear(weight, n, dtype, target)
            entry = {"layer": name, "tokens": n, **plan.to_dict()}
            if weight is not None:
                entry["weight"] = f"{weight.name} g{weight.group_size} {weight.rows}x{weight.k}"
            if plan.tile:
                entry["tile"], entry["splits"] = plan.tile, plan.splits
            rows.append(entry)
        norm = residual_norm(n * config.hidden_size, dtype, target)
        rows.append({"layer": "residual add + LayerNorm", "tokens": n, **norm.to_dict()})
    return rows
