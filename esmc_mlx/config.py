"""The ESMC architecture as one dataclass, read from every config spelling in use.

Spellings accepted (see docs/formats.md):
  * transformers' ``EsmcConfig``: ``hidden_size``, ``num_attention_heads``,
    ``num_hidden_layers``, ``intermediate_size``, ``rope_parameters`` ...
  * the ``esm`` package's: the same names, fewer fields;
  * pre-alignment names: ``d_model``, ``n_heads``, ``n_layers``;
  * mlx-lm's ESMC port (``model_type: esmc``): those, plus ``rope_base`` and
    ``residue_scaling_base`` (must be 36: ESMC divides residuals by sqrt(n_layers / 36)).
Checkpoints without a config (the legacy ``.pth``) get one from tensor shapes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .errors import ConfigError
from .vocab import VOCAB

HEAD_DIM = 64  # every released ESMC uses 64-wide heads (300M 960/15, 600M 1152/18, 6B 2560/40)
VOCAB_SIZE = 64  # logits width; the tokenizer uses the first 33 ids
TRAINED_TOKENS = 2048  # ESMC's training crop (ESM C paper), <cls> and <eos> included
TRAINED_LENGTH = TRAINED_TOKENS - 2  # residues; longer inputs run, but outside what it learned


def default_intermediate_size(hidden_size: int) -> int:
    """ESMC's SwiGLU width: 8/3 · d rounded up to a multiple of 256."""
    return int(math.ceil(8 * hidden_size / 3 / 256) * 256)


def _integer(value: Any, field: str) -> int:
    """A config integer: 12 or 12.0 (some writers emit floats), never "12a", 12.5 or true."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise ConfigError(f"{field} must be a positive integer, got {_shown(value)}")
    return int(value)


def _number(value: Any, field: str) -> float:
    """A config number (a float or an integer), never a string, a bool, NaN or Inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{field} must be a number, got {_shown(value)}")
    return float(value)


def _shown(value: Any) -> str:
    """A value in a message, cut short (a 5,000-digit number or a long string stays readable)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"


@dataclasses.dataclass(frozen=True)
class ESMCConfig:
    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{field} must be a positive integer, got {_shown(value)}")
        if self.vocab_size < len(VOCAB):  # every token id must have a row of the embedding
            raise ConfigError(f"vocab_size must be at least the tokenizer's {len(VOCAB)} tokens, got {self.vocab_size}")
        if not (self.layer_norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError(
                f"layer_norm_eps and rope_theta must be positive, got {self.layer_norm_eps!r} and {self.rope_theta!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def residual_scale(self) -> float:
        """Every residual branch is divided by this (ESM3 depth scaling)."""
        return math.sqrt(self.num_hidden_layers / 36)

    @property
    def num_parameters(self) -> int:
        d, f, n, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        per_layer = 4 * d * d + 3 * d * f + 2 * d + 2 * d + 2 * d  # attn, mlp, q/k norms, 2 LNs
        head = d * d + d + 2 * d + d * v + v
        return v * d + n * per_layer + d + head

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ESMCConfig:
        """Read any of the known spellings; raise ConfigError naming what is missing."""
        if not isinstance(raw, dict):  # a JSON list, null, a number: not a config at all
            raise ConfigError(f"config is not a JSON object (got {type(raw).__name__})")

        def pick(*names, default=None):
            for name in names:
                if raw.get(name) is not None:
                    return raw[name]
            return default

        hidden = pick("hidden_size", "d_model")
        heads = pick("num_attention_heads", "n_heads")
        layers = pick("num_hidden_layers", "n_layers")
        missing = [
            n
            for n, v in [("hidden_size", hidden), ("num_attention_heads", heads), ("num_hidden_layers", layers)]
            if v is None
        ]
        if missing:
            raise ConfigError(f"config has no {', '.join(missing)} (nor an older spelling of it)")
        hidden = _integer(hidden, "hidden_size")
        heads = _integer(heads, "num_attention_heads")
        layers = _integer(layers, "num_hidden_layers")
        if heads < 1:
            raise ConfigError(f"num_attention_heads must be a positive integer, got {heads!r}")
        rope = pick("rope_parameters", "rope_scaling", default={}) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters must be an object, got {_shown(rope)}")
        theta = _number(pick("rope_theta", "rope_base", default=rope.get("rope_theta", 10000.0)), "rope_theta")
        base = _number(pick("residue_scaling_base", default=36), "residue_scaling_base")
        if base != 36:
            raise ConfigError(
                f"residue_scaling_base {base:g}: ESMC divides residuals by sqrt(n_layers / 36); another base is not ESMC"
            )
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"unsupported rope_type {_shown(rope['rope_type'])}: ESMC uses plain RoPE")
        if pick("num_key_value_heads", default=heads) != heads:
            raise ConfigError("ESMC has no grouped-query attention: num_key_value_heads must equal num_attention_heads")
        head_dim = pick("head_dim")
        if head_dim is not None and _integer(head_dim, "head_dim") * heads != hidden:
            raise ConfigError(f"head_dim {head_dim} x {heads} heads != hidden_size {hidden}")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            intermediate_size=_integer(
                pick("intermediate_size", "d_ff", default=default_intermediate_size(hidden)), "intermediate_size"
            ),
            vocab_size=_integer(pick("vocab_size", default=VOCAB_SIZE), "vocab_size"),
            rope_theta=theta,
            layer_norm_eps=_number(pick("layer_norm_eps", default=1e-5), "layer_norm_eps"),
        )

    def to_dict(self) -> dict[str, Any]:
        """transformers' EsmcConfig spelling, so the output config loads there too."""
        return {
            "model_type": "esmc",
            "architectures": ["EsmcForMaskedLM"],
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "layer_norm_eps": self.layer_norm_eps,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "pad_token_id": 1,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "mask_token_id": 32,
        }
