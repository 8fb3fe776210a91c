"""Quantization specs, per-tensor plans and the quantization record in config.json.

The arithmetic is MLX's own (``mx.quantize``, ``nn.QuantizedLinear``); this module only decides
which tensor gets which (mode, bits, group size), and records it the way mlx-lm does so that
``load`` rebuilds exactly the quantized layers. See docs/quantization.md.

What is quantized by default: the seven projections of every transformer block (q, k, v, o,
gate, up, down), i.e. >99% of the weights. What stays in the artifact's float dtype unless the
user passes ``quantize_head=True`` (``--quantize-head``): the token embedding (64 x d), every
LayerNorm, and the LM head (dense d x d, layer norm, decoder 64 x d). They are 0.4% of the
300M's parameters, 0.13% of the 6B's, and they carry the output distribution: every logit goes
through the head, so its error is not averaged away across 30-80 blocks as a block's is.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx

from ..artifact import expected_shapes
from ..config import ESMCConfig
from ..errors import QuantizeError
from .fast import quantize  # mx.quantize, with a 3x faster bit-identical mxfp4 path on the CPU

AFFINE_BITS = (8, 6, 5, 4, 3, 2)
AFFINE_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
# Microscaling formats: group size and bits are fixed by the format (MLX's table).
FIXED_MODES = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}
# Mixed recipes (mlx-lm's mixed_X_Y, after llama.cpp's Q4_K_M): affine, (low bits, high bits).
# Which layers get the high bits: see QuantPlan._more_bits.
MIXED_RECIPES = {
    "mixed_2_6": (2, 6),
    "mixed_3_4": (3, 4),
    "mixed_3_6": (3, 6),
    "mixed_4_6": (4, 6),
    "mixed_4_8": (4, 8),
}
SPECS = (*map(str, AFFINE_BITS), *FIXED_MODES, *MIXED_RECIPES)

BLOCK_LINEAR = re.compile(r"esmc\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)")
# Quantized only with quantize_head: the embedding (QuantizedEmbedding) and the head's linears.
HEAD = re.compile(r"esmc\.embed_tokens|lm_head\.(?:dense|decoder)")
# Projections whose error reaches the residual stream without a normalization in between:
# v (through attention and o_proj) and down. q and k go through ESMC's QK LayerNorm first,
# gate and up through the SwiGLU product and then down.
HIGH_BIT_MODULES = ("self_attn.v_proj", "mlp.down_proj")


@dataclasses.dataclass(frozen=True)
class QuantParams:
    mode: str
    bits: int
    group_size: int

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def parse_spec(spec: str, group_size: int | None = None) -> tuple[str, QuantParams]:
    """``--q SPEC [--group-size N]`` -> (normalized spec, default params). Needs no model, so
    callers check it before downloading anything. Raises QuantizeError naming the bad option."""
    spec = str(spec).strip().lower()
    if group_size is not None and type(group_size) is not int:  # "64" read as "64 is not one of 32, 64, 128"
        raise QuantizeError(
            f"group_size={group_size!r} (--group-size): give an int, one of "
            f"{', '.join(map(str, AFFINE_GROUP_SIZES))} (affine modes)"
        )
    if spec in FIXED_MODES:
        fixed_group, bits = FIXED_MODES[spec]
        if group_size not in (None, fixed_group):
            raise QuantizeError(f"--q {spec} has a fixed group size of {fixed_group}; got --group-size {group_size}")
        return spec, QuantParams(spec, bits, fixed_group)
    if spec not in MIXED_RECIPES and not (spec.isdigit() and int(spec) in AFFINE_BITS):
        raise QuantizeError(f"--q {spec!r} is not a quantization spec; choose one of: {', '.join(SPECS)}")
    group = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if group not in AFFINE_GROUP_SIZES:
        raise QuantizeError(
            f"--group-size {group_size} is not one of {', '.join(map(str, AFFINE_GROUP_SIZES))} (affine modes)"
        )
    bits = MIXED_RECIPES[spec][0] if spec in MIXED_RECIPES else int(spec)
    return spec, QuantParams("affine", bits, group)


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """Which (mode, bits, group size) each layer of a model gets."""

    spec: str
    default: QuantParams
    config: ESMCConfig
    quantize_head: bool = False

    @classmethod
    def parse(cls, spec: str, group_size: int | None, config: ESMCConfig, quantize_head: bool = False) -> QuantPlan:
        """Parse the spec and check that every layer it quantizes has a width its group size
        divides (raises QuantizeError naming the layer otherwise)."""
        spec, default = parse_spec(spec, group_size)
        plan = cls(spec, default, config, quantize_head)
        for name, shape in expected_shapes(config).items():
            plan.params_for(name, shape)
        return plan

    def params_for(self, name: str, shape: tuple[int, ...]) -> QuantParams | None:
        """Quantization of the tensor ``name`` (an MLX ``...weight`` name), or None to keep it."""
        if not name.endswith(".weight"):
            return None
        layer = name[: -len(".weight")]
        block = BLOCK_LINEAR.fullmatch(layer)
        head = self.quantize_head and HEAD.fullmatch(layer)
        if not (block or head):
            return None
        params = self.default
        if self.spec in MIXED_RECIPES and (head or self._more_bits(int(block.group(1)), block.group(2))):
            params = dataclasses.replace(params, bits=MIXED_RECIPES[self.spec][1])
        if shape[-1] % params.group_size:
            raise QuantizeError(
                f"{layer}: input width {shape[-1]} is not divisible by the group size {params.group_size} "
                f"of --q {self.spec}" + (" (choose --group-size 32 or 64)" if params.mode == "affine" else "")
            )
        return params

    def _more_bits(self, layer: int, module: str) -> bool:
        """Mixed recipes: v_proj and down_proj (HIGH_BIT_MODULES) of the first and last eighth
        of the blocks and of every third block between get the high bit width; everything
        else the low one. This is mlx-lm's rule (from llama.cpp's Q4_K_M) with ESMC's depth
        (300M: 14 of 30 blocks, 600M: 18 of 36, 6B: 40 of 80). Why these: the outer blocks
        turn token embeddings into contextual features and features into logits, and v/down
        write into the residual stream unnormalized; q/k errors are damped by ESMC's QK
        LayerNorm. The rule is not tuned on ESMC quality (no trained weights here)."""
        n = self.config.num_hidden_layers
        sensitive = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
        return sensitive and module in HIGH_BIT_MODULES

    def record(self, quantized: dict[str, QuantParams]) -> dict:
        """config.json ``quantization`` entry (mlx-lm convention): the default params, plus one
        entry per layer whose params differ from them. The runtime quantizes a layer when it is
        listed here or when the weights hold its ``.scales`` (mlx-lm's loading rule)."""
        out = self.default.as_dict()
        out.update({layer: p.as_dict() for layer, p in sorted(quantized.items()) if p != self.default})
        return out


def quantize_tensor(name: str, weight: mx.array, params: QuantParams) -> dict[str, mx.array]:
    """``name`` (``...weight``) -> the tensors ``nn.QuantizedLinear`` holds (weight, scales[, biases])."""
    prefix = name[: -len(".weight")]

    parts = quantize(weight, group_size=params.group_size, bits=params.bits, mode=params.mode)
    out = {f"{prefix}.weight": parts[0], f"{prefix}.scales": parts[1]}
    if len(parts) > 2 and parts[2] is not None:
        out[f"{prefix}.biases"] = parts[2]
    return out


def refuse_quantized(names, where: str) -> None:
    """Quantized weights cannot be quantized again (nor converted): say so, before any work."""
    if any(n.endswith(".scales") for n in names):
        raise QuantizeError(
            f"{where} is already quantized; quantize from the float checkpoint (or a float MLX directory) instead"
        )
