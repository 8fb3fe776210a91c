"""Facts about an MLX model directory, for `esmc-mlx info` and the model card."""

from __future__ import annotations

import json
from pathlib import Path

from .config import ESMCConfig
from .convert.sources import safetensors_header


def describe(model_dir: Path) -> dict:
    """Architecture, parameter count, storage, bits per weight (stored bytes x 8 / parameters)."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    config = ESMCConfig.from_dict(raw)
    files = sorted(model_dir.glob("model*.safetensors"))
    tensor_bytes, names = 0, set()
    for f in files:
        for name, t in safetensors_header(f).items():
            if name != "__metadata__":
                tensor_bytes += t["data_offsets"][1] - t["data_offsets"][0]
                names.add(name)
    q = raw.get("quantization")
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
        "size on disk": _human(sum(f.stat().st_size for f in files)),
        "shards": len(files),
        "source": source.get("id", "unknown") + (f"@{source['revision']}" if source.get("revision") else ""),
    }


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
