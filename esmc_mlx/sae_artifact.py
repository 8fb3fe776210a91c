"""A sparse autoencoder (SAE) folder in the published ESMC format (the ``esm`` package's
``EsmcSaeModel``, e.g. ``biohub/esmc-6b-2024-12-sae-k64-codebook16384``): its config, file names,
tensor names and shapes, its quantization record and the files a push uploads.

Layout::

    config.json               d_model, codebook_dim, k, available_layers,
                              use_residual_update_instead_of_states (absent: false)
    layer_{i}.safetensors     one backbone layer's SAE: W_enc (d_model, codebook_dim),
                              W_dec (codebook_dim, d_model), b_dec (d_model), idf and max (codebook_dim)

An esmc-mlx SAE keeps that layout and adds ``dtype`` (the matrices' float dtype) or
``quantization`` (mlx-lm's record: mode, bits, group_size) to config.json. A quantized matrix
is stored as ``nn.QuantizedLinear`` holds its weight: ``W_enc.weight`` is ``W_enc`` transposed
(codebook_dim, d_model) and packed, with ``W_enc.scales`` (and ``.biases``); ``W_dec.weight``
is ``W_dec`` transposed (d_model, codebook_dim) likewise. The vectors stay float32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .artifact import FLOAT_DTYPES, ArtifactKind, register_artifact_kind, safetensors_header
from .errors import ConfigError
from .readers import read_json

CONFIG_NAME = "config.json"
MATRICES = ("W_enc", "W_dec")
VECTORS = ("b_dec", "idf", "max")
MODEL_TYPE = "esmc_sae"


def layer_file(layer: int) -> str:
    return f"layer_{layer}.safetensors"


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclasses.dataclass(frozen=True)
class SAEConfig:
    d_model: int
    codebook_dim: int
    k: int
    available_layers: tuple[int, ...]
    use_residual_update_instead_of_states: bool = False
    dtype: str = "float32"  # the matrices' float dtype (quantized: the dtype of their scales)
    quantization: dict | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str = CONFIG_NAME) -> SAEConfig:
        """ConfigError naming ``where`` and the field for a config that is not an SAE's."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: not a JSON object")
        missing = [f for f in ("d_model", "codebook_dim", "k") if f not in raw]
        if missing:
            raise ConfigError(
                f"{where}: not a sparse autoencoder config (no {', '.join(missing)}; an SAE's config.json "
                "holds d_model, codebook_dim, k and available_layers)"
            )
        for name in ("d_model", "codebook_dim", "k"):
            if not _count(raw[name]) or raw[name] == 0:
                raise ConfigError(f"{where}: {name} must be a positive integer, got {raw[name]!r}")
        if raw["k"] > raw["codebook_dim"]:
            raise ConfigError(f"{where}: k = {raw['k']} is larger than codebook_dim = {raw['codebook_dim']}")
        layers = raw.get("available_layers", [0])  # esm's default when the key is absent
        if not isinstance(layers, list) or not layers or not all(_count(i) for i in layers):
            raise ConfigError(f"{where}: available_layers must be a non-empty list of layer indices, got {layers!r}")
        residual = raw.get("use_residual_update_instead_of_states", False)
        if not isinstance(residual, bool):
            raise ConfigError(f"{where}: use_residual_update_instead_of_states must be true or false, got {residual!r}")
        dtype = raw.get("dtype", "float32")
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{where}: dtype {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
        q = raw.get("quantization")
        if q is not None and not (
            isinstance(q, dict) and q.get("mode") == "affine" and q.get("bits") == 8 and _count(q.get("group_size"))
        ):
            raise ConfigError(f"{where}: quantization {q!r} is not one esmc-mlx writes for an SAE (affine, 8 bits)")
        return cls(raw["d_model"], raw["codebook_dim"], raw["k"], tuple(sorted(set(layers))), residual, dtype, q)

    def to_dict(self) -> dict:
        out = {
            "model_type": MODEL_TYPE,
            "d_model": self.d_model,
            "codebook_dim": self.codebook_dim,
            "k": self.k,
            "available_layers": list(self.available_layers),
            "use_residual_update_instead_of_states": self.use_residual_update_instead_of_states,
        }
        if self.dtype != "float32" or self.quantization:
            out["dtype"] = self.dtype
        if self.quantization:
            out["quantization"] = dict(self.quantization)
        return out

    @property
    def precision(self) -> str:
        """``float32``, ``bfloat16``, ``float16`` or ``8bit``: the row of the SAE's bounds."""
        return f"{self.quantization['bits']}bit" if self.quantization else self.dtype

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of one ``layer_{i}.safetensors``."""
        d, c = self.d_model, self.codebook_dim
        shapes = {"b_dec": (d,), "idf": (c,), "max": (c,)}
        if not self.quantization:
            return {"W_enc": (d, c), "W_dec": (c, d), **shapes}
        bits, group = self.quantization["bits"], self.quantization["group_size"]
        for name, (rows, cols) in (("W_enc", (c, d)), ("W_dec", (d, c))):
            shapes[f"{name}.weight"] = (rows, cols * bits // 32)
            shapes[f"{name}.scales"] = shapes[f"{name}.biases"] = (rows, cols // group)
        return shapes


CONFIG_BYTES = 1 << 20  # an SAE's config.json lists its layers: a few hundred bytes


def read_sae_json(directory: Path) -> dict:
    """config.json of an SAE folder as a JSON object, through the bounded reader
    (``readers.read_json``); ConfigError naming the file when it is missing, too large, too
    deeply nested, not UTF-8, not JSON or not an object."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"{directory}: no {CONFIG_NAME}; not a sparse autoencoder folder")
    raw = read_json(path, ConfigError, max_bytes=CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return raw


def read_sae_config(directory: Path) -> SAEConfig:
    """The SAE config of ``directory``, every field checked (``SAEConfig.from_dict``); ConfigError
    naming the file (and the field) when missing, damaged or not an SAE's."""
    return SAEConfig.from_dict(read_sae_json(directory), str(Path(directory) / CONFIG_NAME))


def is_sae_directory(directory: Path) -> bool:
    """Whether ``directory`` holds an SAE (its config.json has a codebook) rather than a model; a
    config.json that cannot be read beside SAE layer files is a damaged SAE's (reading it says
    what is wrong)."""
    try:
        raw = read_sae_json(directory)
    except ConfigError:
        return (Path(directory) / CONFIG_NAME).is_file() and any(Path(directory).glob("layer_*.safetensors"))
    return "codebook_dim" in raw and "d_model" in raw


def check_layer_file(path: Path, config: SAEConfig) -> None:
    """ConfigError naming the file and tensor when a layer file is damaged (the header check:
    cut, overlapping offsets), lacks a tensor, or holds one of another shape or dtype (read from
    the header: nothing is loaded)."""
    try:
        header = safetensors_header(path)
    except Exception as e:  # ConvertError: damaged or truncated
        raise ConfigError(str(e)) from None
    for name, shape in config.expected_shapes().items():
        if name not in header:
            raise ConfigError(f"{path}: no tensor {name} (an SAE layer holds {', '.join(config.expected_shapes())})")
        if tuple(header[name]["shape"]) != shape:
            raise ConfigError(
                f"{path}: tensor {name} has shape {tuple(header[name]['shape'])}, config.json says {shape}"
            )
        packed = name.endswith(".weight") and config.quantization
        wanted = ("U32",) if packed else _FLOAT_SAFETENSORS
        if header[name]["dtype"] not in wanted:
            raise ConfigError(
                f"{path}: tensor {name} is {header[name]['dtype']}, not {' or '.join(wanted)} "
                "(an SAE's matrices and vectors are float; a quantized matrix is packed in U32)"
            )


_FLOAT_SAFETENSORS = ("F32", "F16", "BF16")


def sae_files(directory: Path) -> list[str]:
    """What an SAE folder is made of (the ``sae`` artifact kind): config.json and every
    available layer's file (ConfigError naming one that is missing). Its model card and
    validation report go with it (``artifact.published_files``); nothing else in the folder."""
    directory = Path(directory)
    config = read_sae_config(directory)
    names = [CONFIG_NAME]
    for i in config.available_layers:
        if not (directory / layer_file(i)).is_file():
            raise ConfigError(f"{directory}: config.json lists layer {i} but {layer_file(i)} is missing")
        names.append(layer_file(i))
    return names


register_artifact_kind(ArtifactKind("sae", CONFIG_NAME, sae_files, is_sae_directory))
