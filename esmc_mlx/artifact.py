"""The MLX artifact's facts, in one place: tensor names and shapes, the dtype map, the
quantization record's reading, the precision label, the weight files an index names, and the
safetensors header check. Everything above the bottom layer reads these; none of it imports mlx
beyond dtypes, so ``info`` and the model card stay cheap.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import mlx.core as mx

from .config import ESMCConfig
from .errors import ConfigError, ConvertError

FLOAT_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
SAFETENSORS_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP_MODES = ("mxfp4", "mxfp8", "nvfp4")  # quantization modes whose name says their bits


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.bfloat16`` -> ``"bfloat16"`` (the spelling config.json uses)."""
    return next(k for k, v in FLOAT_DTYPES.items() if v == dtype)


def expected_shapes(config: ESMCConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter an ESMC of ``config`` has, in MLX (= transformers) names, with its shape.

    The runtime model builds exactly these parameters (tests/test_architecture.py checks it);
    written out here so that the converter and the validator need not build a model."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"esmc.embed_tokens.weight": (v, d)}
    for i in range(config.num_hidden_layers):
        p = f"esmc.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "input_layernorm.bias": (d,),
            **{p + f"self_attn.{x}_proj.weight": (d, d) for x in "qkvo"},
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,), p + "post_attention_layernorm.bias": (d,),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f),
        })
    shapes.update({
        "esmc.norm.weight": (d,),
        "lm_head.dense.weight": (d, d), "lm_head.dense.bias": (d,),
        "lm_head.layer_norm.weight": (d,), "lm_head.layer_norm.bias": (d,),
        "lm_head.decoder.weight": (v, d), "lm_head.decoder.bias": (v,),
    })
    return shapes


def quantization_record(config: dict) -> dict | None:
    """config.json's quantization entry (mlx-lm writes both spellings; either is read)."""
    return config.get("quantization") or config.get("quantization_config") or None


def quantized_bits(record: dict) -> list[int]:
    """Every bit width a quantization record uses, sorted (one for uniform specs)."""
    overrides = [v for v in record.values() if isinstance(v, dict)]
    return sorted({int(record["bits"]), *(int(v.get("bits", record["bits"])) for v in overrides)})


def precision_label(config: dict) -> str:
    """The storage precision in words: "mxfp4", "4-bit affine", "mixed 3/6-bit affine", "bfloat16"."""
    q = quantization_record(config)
    if not q:
        return config.get("dtype", "float32")
    mode, bits = q.get("mode", "affine"), quantized_bits(q)
    if len(bits) > 1:
        return f"mixed {'/'.join(map(str, bits))}-bit {mode}"
    return mode if mode in FP_MODES else f"{q['bits']}-bit {mode}"


def read_config(directory: Path) -> dict:
    """An artifact's config.json as a dict; ConvertError naming the file if missing or unreadable."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConvertError(f"{directory}: not an MLX model directory (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: unreadable config ({e})") from None
    if not isinstance(raw, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return raw


def read_model_config(directory: Path) -> tuple[dict, ESMCConfig]:
    """(config.json as a dict, the architecture it describes); ConvertError naming the file."""
    raw = read_config(directory)
    try:
        return raw, ESMCConfig.from_dict(raw)
    except ConfigError as e:
        raise ConvertError(f"{Path(directory) / 'config.json'}: {e}") from None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files that make up the model in ``directory``: those its index names, or
    the single ``model.safetensors``. Any other ``model*.safetensors`` beside them (a stray
    ``model_old.safetensors``) is refused rather than silently loaded or ignored."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({directory / name for name in weight_map.values()})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{index}: unreadable index ({e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConvertError(f"{index} names shards that are missing: {', '.join(missing)}")
    elif (directory / SINGLE_FILE).is_file():
        files = [directory / SINGLE_FILE]
    else:
        raise ConvertError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
    strays = sorted(set(directory.glob("model*.safetensors")) - set(files))
    if strays:
        raise ConvertError(
            f"{directory}: {', '.join(f.name for f in strays)} not named by "
            f"{INDEX_FILE if index.is_file() else SINGLE_FILE}; move it out of the model directory")
    return files


def safetensors_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header; raise ConvertError if the file is damaged.

    Hand-written because mx.load of a truncated file fails late and without naming the file;
    this check is a few lines of the documented format (8-byte length, JSON, data).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"header length {length} exceeds the file size {size}")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError) as e:
        raise ConvertError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if 8 + length + end != size:
        raise ConvertError(
            f"{path}: truncated or corrupt safetensors file (header describes {8 + length + end} bytes, "
            f"file has {size})"
        )
    return header


def sha256(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GB"


def describe(model_dir: Path) -> dict:
    """Architecture, parameter count, storage, bits per weight (stored bytes x 8 / parameters):
    what ``esmc-mlx info`` prints and the model card shows."""
    model_dir = Path(model_dir)
    raw, config = read_model_config(model_dir)
    files = weight_files(model_dir)
    tensor_bytes, names = 0, set()
    for f in files:
        for name, t in safetensors_header(f).items():
            if name != "__metadata__":
                tensor_bytes += t["data_offsets"][1] - t["data_offsets"][0]
                names.add(name)
    q = quantization_record(raw)
    if q:
        overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
        storage = f"{q['mode']} {q['bits']}-bit, group size {q['group_size']}"
        if overrides:
            kinds = sorted({f"{v['bits']}-bit" for v in overrides.values()})
            storage += f" ({len(overrides)} layers at {', '.join(kinds)})"
        spec = (raw.get("esmc_mlx", {}).get("quantization") or {}).get("spec")
        storage = (f"{spec}: " if spec and spec.startswith("mixed") else "") + storage  # name the recipe
        storage += f"; {sum(n.endswith('.scales') for n in names)} layers quantized"
        head_quantized = "lm_head.decoder.scales" in names or "esmc.embed_tokens.scales" in names
        storage += f"; {'norms' if head_quantized else 'embedding, norms, LM head'} {raw.get('dtype')}"
    else:
        storage = raw.get("dtype", "float32")
    source = raw.get("esmc_mlx", {}).get("source", {})
    return {
        "directory": str(model_dir),
        "architecture": (f"ESMC, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                         f"{config.num_attention_heads} heads, MLP {config.intermediate_size}"),
        "parameters": f"{config.num_parameters:,}",
        "storage": storage,
        "bits per weight": round(tensor_bytes * 8 / config.num_parameters, 3),
        "size on disk": human_size(sum(f.stat().st_size for f in files)),
        "shards": len(files),
        "source": source.get("id", "unknown") + (f"@{source['revision']}" if source.get("revision") else ""),
    }
