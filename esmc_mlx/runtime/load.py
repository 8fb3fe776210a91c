"""``load(path_or_repo_id)`` -> (model, tokenizer), as mlx-lm's ``load``."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import mlx.core as mx

from ..config import ConfigError, ESMCConfig
from ..errors import ConvertError
from .model import ESMC
from .tokenizer import ESMCTokenizer


def resolve_model_dir(path_or_repo_id: str | Path, revision: str | None = None) -> Path:
    """A local MLX directory as is; anything else is fetched from the Hub."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(path_or_repo_id).count("/") != 1:
        raise ConvertError(f"{path_or_repo_id}: not an MLX model directory or a Hub repo id")
    from ..hub.download import download_checkpoint

    return download_checkpoint(str(path_or_repo_id), revision)[0]


def read_model_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise ConvertError(f"{directory}: no config.json (is this an esmc-mlx output directory?)")
    return json.loads(path.read_text())


def apply_quantization(model: ESMC, record: dict, weights: dict) -> None:
    """Swap in quantized layers exactly where the artifact holds quantized weights (mlx-lm's
    rule: per-layer override from the record, else "has .scales"). Linears become
    ``runtime.quantized.QuantizedLinear``, which picks quantized or dequantize-then-float
    matmul per call by token count and backend."""
    from .quantized import quantize_modules

    quantize_modules(model, record, lambda path: f"{path}.scales" in weights)


def compute_dtype_for_device(stored: mx.Dtype) -> mx.Dtype:
    """MLX's CPU backend runs bf16/fp16 matmuls at a few GFLOP/s against ~200 for fp32 BLAS:
    on the CPU, compute in fp32."""
    return mx.float32 if mx.default_device() == mx.cpu else stored


def load(path_or_repo_id: str | Path, revision: str | None = None, dtype: mx.Dtype | None = None,
         lazy: bool = False, fuse: bool | None = None, compile: bool | None = None) -> tuple[ESMC, ESMCTokenizer]:
    """Load an esmc-mlx artifact (local directory or Hub repo id) and its tokenizer.

    ``dtype`` overrides the compute dtype of float parameters (default: stored dtype on GPU,
    float32 on the CPU backend). ``fuse``/``compile``: runtime optimizations (``ESMC.optimize``;
    default: what measured faster on the device — on a GPU both, on the CPU neither). A fused
    model runs q/k/v and gate/up as one matrix each, so its parameter names differ from the
    artifact's; pass ``fuse=False`` to keep transformers' layout. Raises ConvertError for a
    directory that is not an artifact.
    """
    directory = resolve_model_dir(path_or_repo_id, revision)
    raw = read_model_config(directory)
    try:
        config = ESMCConfig.from_dict(raw)
    except ConfigError as e:
        raise ConvertError(f"{directory / 'config.json'}: {e}") from None
    files = sorted(glob.glob(str(directory / "model*.safetensors")))
    if not files:
        raise ConvertError(f"{directory}: no model*.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(f))
    model = ESMC(config)
    record = raw.get("quantization") or raw.get("quantization_config")
    if record:
        apply_quantization(model, record, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ConvertError(f"{directory}: weights do not match config.json: {e}") from None
    stored = getattr(mx, raw.get("dtype", "float32"), mx.float32)
    target = dtype or compute_dtype_for_device(stored)
    if target != stored:
        model.set_dtype(target)
    if not lazy:
        mx.eval(model.parameters())
    model.optimize(fuse=False if lazy else fuse, compile=compile)
    model.eval()
    return model, ESMCTokenizer()
