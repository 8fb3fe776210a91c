"""Quantization specs, per-tensor plans and the quantization record in config.json.

The arithmetic is MLX's own (``mx.quantize``, ``nn.QuantizedLinear``); this module only decides
which tensor gets which (mode, bits, group size), and records it the way mlx-lm does so that
``load`` rebuilds exactly the quantized layers.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx

from ..config import ESMCConfig
from ..errors import QuantizeError

AFFINE_BITS = (8, 6, 5, 4, 3, 2)
AFFINE_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
# Microscaling formats have one group size fixed by the format, and fixed bits.
FIXED_MODES = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}
# Mixed recipes (mlx-lm's mixed_X_Y idea adapted to ESMC): (low bits, high bits).
MIXED_RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6),
                 "mixed_4_8": (4, 8)}
# Only the transformer blocks' projections are quantized by default. Embedding (64 x d), norms
# and the LM head are < 1% of the weights and carry the output distribution: they stay in the
# artifact's float dtype.
QUANTIZED_LINEAR = re.compile(r"esmc\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")


@dataclasses.dataclass(frozen=True)
class QuantParams:
    mode: str
    bits: int
    group_size: int

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """Which (mode, bits, group size) each linear layer of a model gets."""

    spec: str
    default: QuantParams
    config: ESMCConfig

    @classmethod
    def parse(cls, spec: str, group_size: int | None, config: ESMCConfig) -> "QuantPlan":
        """Parse ``--q SPEC [--group-size N]``; raise QuantizeError naming the bad option."""
        spec = str(spec).strip().lower()
        if spec in FIXED_MODES:
            fixed_group, bits = FIXED_MODES[spec]
            if group_size not in (None, fixed_group):
                raise QuantizeError(f"--q {spec} has a fixed group size of {fixed_group}; got --group-size {group_size}")
            return cls(spec, QuantParams(spec, bits, fixed_group), config)
        group = DEFAULT_GROUP_SIZE if group_size is None else int(group_size)
        if group not in AFFINE_GROUP_SIZES:
            raise QuantizeError(f"--group-size {group_size} is not one of {', '.join(map(str, AFFINE_GROUP_SIZES))}")
        if spec in MIXED_RECIPES:
            return cls(spec, QuantParams("affine", MIXED_RECIPES[spec][0], group), config)
        if spec.isdigit() and int(spec) in AFFINE_BITS:
            return cls(spec, QuantParams("affine", int(spec), group), config)
        choices = [*map(str, AFFINE_BITS), *FIXED_MODES, *MIXED_RECIPES]
        raise QuantizeError(f"--q {spec!r} is not a quantization spec; choose one of: {', '.join(choices)}")

    def params_for(self, name: str, shape: tuple[int, ...]) -> QuantParams | None:
        """Quantization of the tensor ``name`` (an MLX ``...weight`` name), or None to keep it."""
        if not name.endswith(".weight"):
            return None
        match = QUANTIZED_LINEAR.fullmatch(name[: -len(".weight")])
        if not match:
            return None
        params = self.default
        if self.spec in MIXED_RECIPES and self._more_bits(int(match.group(1)), match.group(2)):
            params = dataclasses.replace(params, bits=MIXED_RECIPES[self.spec][1])
        if shape[-1] % params.group_size:
            raise QuantizeError(
                f"{name}: input width {shape[-1]} is not divisible by the group size {params.group_size} "
                f"of --q {self.spec}"
            )
        return params

    def _more_bits(self, layer: int, module: str) -> bool:
        """Mixed recipes: the value and down projections of the first and last eighth of the
        blocks, and of every third block between, get the high bit width (mlx-lm's choice,
        after llama.cpp's Q4_K_M): these are the projections whose error reaches the residual
        stream unnormalized, and the outer blocks are the most sensitive."""
        n = self.config.num_hidden_layers
        sensitive = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
        return sensitive and module in ("self_attn.v_proj", "mlp.down_proj")

    def record(self, overrides: dict[str, QuantParams]) -> dict:
        """config.json ``quantization`` entry (mlx-lm convention): defaults plus per-layer
        overrides for layers whose params differ from the defaults."""
        out = self.default.as_dict()
        out.update({layer: p.as_dict() for layer, p in sorted(overrides.items()) if p != self.default})
        return out


def quantize_tensor(name: str, weight: mx.array, params: QuantParams) -> dict[str, mx.array]:
    """``name`` (``...weight``) -> the tensors ``nn.QuantizedLinear`` holds (weight, scales[, biases])."""
    prefix = name[: -len(".weight")]
    parts = mx.quantize(weight, group_size=params.group_size, bits=params.bits, mode=params.mode)
    out = {f"{prefix}.weight": parts[0], f"{prefix}.scales": parts[1]}
    if len(parts) > 2 and parts[2] is not None:
        out[f"{prefix}.biases"] = parts[2]
    return out
