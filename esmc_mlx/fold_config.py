"""The ESMFold2 architecture (transformers' ``EsmFold2Config``) as a tree of dataclasses.

Field names and defaults are transformers' own, so a ``config.json`` written by
``EsmFold2Model.save_pretrained`` reads as it is and the MLX modules port one to one. Unknown
fields are ignored (transformers writes many bookkeeping ones); a field of the wrong type is a
ConfigError naming it. The ESMC backbone's config is ``esmc_config``, read by ``ESMCConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .config import ESMCConfig, _shown
from .errors import ConfigError

MODEL_TYPE = "esmfold2"


def _check(value: Any, kind: type, where: str) -> Any:
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {_shown(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where} must be a number, got {_shown(value)}")
    if kind is int:
        if value != int(value) or value < 0:
            raise ConfigError(f"{where} must be a non-negative integer, got {_shown(value)}")
        return int(value)
    return float(value)


def _read(cls, raw: Any, where: str):
    """``cls`` from ``raw`` (a dict or None): known fields only, each checked; nested configs recursively."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} is not a JSON object (got {type(raw).__name__})")
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in raw:
            continue
        if raw[field.name] is None:
            if "None" in str(field.type):  # transformers' None is a value: no sigma cap, no chunking
                values[field.name] = None
            continue
        value, name = raw[field.name], f"{where}.{field.name}" if where else field.name
        nested = _NESTED.get((cls.__name__, field.name))
        if nested is not None:
            values[field.name] = _read(nested, value, name)
        elif field.name == "esmc_config":
            values[field.name] = ESMCConfig.from_dict(value)
        else:
            values[field.name] = _check(value, _KINDS[field.type], name)
    return cls(**values)


_KINDS = {"int": int, "float": float, "bool": bool, "int | None": int}


@dataclasses.dataclass(frozen=True)
class AtomEncoderConfig:
    hidden_size: int = 128
    output_dim: int = 384
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    head_dim: int | None = None
    intermediate_size: int = 256
    spatial_rope_base_frequency: float = 20.0
    num_spatial_rope_pairs_per_axis: int = 2
    num_uid_rope_pairs: int = 10
    uid_rope_base_frequency: float = 10000.0

    def __post_init__(self):
        if self.head_dim is None:
            if not self.num_attention_heads:
                raise ConfigError("atom_encoder.num_attention_heads must be positive")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        pairs = 3 * self.num_spatial_rope_pairs_per_axis + self.num_uid_rope_pairs
        if pairs > self.head_dim // 2:
            raise ConfigError(
                f"the 3D rotary embedding needs {pairs} frequency pairs, more than the {self.head_dim // 2} "
                f"of a head of width {self.head_dim}"
            )


@dataclasses.dataclass(frozen=True)
class DiffusionModuleConfig:
    sigma_data: float = 16.0
    hidden_size: int = 768
    fourier_dim: int = 256
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    head_dim: int | None = None
    intermediate_size: int = 1536
    pair_intermediate_size: int = 512
    atom_encoder: AtomEncoderConfig = dataclasses.field(default_factory=lambda: AtomEncoderConfig(output_dim=768))

    def __post_init__(self):
        if self.head_dim is None:
            if not self.num_attention_heads:
                raise ConfigError("diffusion_module.num_attention_heads must be positive")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.atom_encoder.output_dim != self.hidden_size:
            raise ConfigError(
                f"diffusion_module.atom_encoder.output_dim ({self.atom_encoder.output_dim}) is not its "
                f"hidden_size ({self.hidden_size})"
            )


@dataclasses.dataclass(frozen=True)
class StructureHeadConfig:
    diffusion_module: DiffusionModuleConfig = dataclasses.field(default_factory=DiffusionModuleConfig)
    num_distogram_bins: int = 128
    num_diffusion_samples: int = 8
    gamma_0: float = 0.605
    gamma_min: float = 1.107
    noise_scale: float = 0.0
    step_scale: float = 1.0
    inference_sigma_max_ratio: float = 160.0
    inference_sigma_min_ratio: float = 4e-4
    inference_exponent: float = 8.0
    inference_num_steps: int = 68
    inference_sigma_cap: float | None = 256.0


@dataclasses.dataclass(frozen=True)
class ConfidenceHeadConfig:
    num_hidden_layers: int = 4
    num_plddt_bins: int = 50
    num_pde_bins: int = 64
    num_pae_bins: int = 64
    min_dist: float = 2.0
    max_dist: float = 52.0
    distogram_bins: int = 128
    eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class MsaEncoderConfig:
    hidden_size: int = 128
    outer_hidden_size: int = 32
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    head_dim: int = 32
    intermediate_size: int = 512
    outer_product_chunk_size: int | None = None
    enabled: bool = True


@dataclasses.dataclass(frozen=True)
class LmEncoderConfig:
    num_hidden_layers: int = 4
    lm_dropout: float = 0.25
    per_loop_lm_dropout: bool = True


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """transformers' ``EsmFold2Config``: the folding model and its ESMC backbone (``esmc_config``)."""

    esmc_config: ESMCConfig
    hidden_size: int = 384
    pairwise_hidden_size: int = 256
    single_inputs_size: int = 451
    pair_transition_intermediate_size: int = 1024
    sliding_window: int = 128
    chunk_size: int | None = 64
    num_relative_residx_bins: int = 32
    num_relative_chain_bins: int = 2
    num_loops: int = 10
    num_res_types: int = 33
    max_atomic_number: int = 128
    char_vocab_size: int = 64
    max_chars: int = 4
    max_atoms_per_token: int = 23
    atom_feature_dim: int | None = None
    folding_trunk_num_hidden_layers: int = 24
    parcae_num_coda_layers: int = 2
    atom_encoder: AtomEncoderConfig = dataclasses.field(default_factory=AtomEncoderConfig)
    structure_head: StructureHeadConfig = dataclasses.field(default_factory=StructureHeadConfig)
    confidence_head: ConfidenceHeadConfig = dataclasses.field(default_factory=ConfidenceHeadConfig)
    msa_encoder: MsaEncoderConfig = dataclasses.field(default_factory=MsaEncoderConfig)
    lm_encoder: LmEncoderConfig = dataclasses.field(default_factory=LmEncoderConfig)

    def __post_init__(self):
        if self.atom_feature_dim is None:
            dim = 3 + 1 + 1 + self.max_atomic_number + self.char_vocab_size * self.max_chars
            object.__setattr__(self, "atom_feature_dim", dim)
        expected = self.single_inputs_size - (2 * self.num_res_types + 1)
        if self.atom_encoder.output_dim != expected:
            raise ConfigError(
                f"atom_encoder.output_dim ({self.atom_encoder.output_dim}) is not single_inputs_size "
                f"({self.single_inputs_size}) - (2 * num_res_types + 1) = {expected}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FoldConfig:
        """Read transformers' spelling; raise ConfigError naming a missing or malformed field."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config is not a JSON object (got {type(raw).__name__})")
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"model_type is {_shown(raw.get('model_type'))}, not {MODEL_TYPE!r}")
        if not isinstance(raw.get("esmc_config"), dict):
            raise ConfigError("config has no esmc_config (the ESMC backbone's config)")
        try:
            return _read(cls, raw, "")
        except TypeError as e:  # a dataclass refusing a value: name it rather than a traceback
            raise ConfigError(f"config: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """transformers' spelling, so the artifact's config loads in ``EsmFold2Config`` too."""
        out = dataclasses.asdict(self)
        out["esmc_config"] = self.esmc_config.to_dict()
        out["model_type"] = MODEL_TYPE
        out["architectures"] = ["EsmFold2Model"]
        return out


_NESTED = {
    ("FoldConfig", "atom_encoder"): AtomEncoderConfig,
    ("FoldConfig", "structure_head"): StructureHeadConfig,
    ("FoldConfig", "confidence_head"): ConfidenceHeadConfig,
    ("FoldConfig", "msa_encoder"): MsaEncoderConfig,
    ("FoldConfig", "lm_encoder"): LmEncoderConfig,
    ("StructureHeadConfig", "diffusion_module"): DiffusionModuleConfig,
    ("DiffusionModuleConfig", "atom_encoder"): AtomEncoderConfig,
}
_KINDS["float | None"] = float
