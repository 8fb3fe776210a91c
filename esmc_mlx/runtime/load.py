"""``load(path_or_repo_id)`` -> (model, tokenizer), as mlx-lm's ``load``."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..artifact import FLOAT_DTYPES, quantization_record, read_model_config, tensor_files, weight_files
from ..errors import ConvertError
from ..resolve import resolve
from . import dispatch
from .cuda.fusions import CUDA
from .model import ESMC
from .quantized import backend, quantize_modules
from .tokenizer import ESMCTokenizer


def resolve_model_dir(path_or_repo_id: str | Path, revision: str | None = None) -> Path:
    """A local directory, an alias (``tiny``, ``300M`` ...) or a Hub repo id -> a local directory
    (the same sources ``esmc-convert`` accepts). Raises ConvertError / HubError."""
    source = resolve(str(path_or_repo_id), revision)
    if not source.is_pth and not source.path.is_dir():
        raise ConvertError(f"{path_or_repo_id}: a file, not a model directory")
    if source.is_pth:
        raise ConvertError(
            f"{path_or_repo_id}: a legacy checkpoint file, not a model directory; "
            f"convert it first: esmc-convert {path_or_repo_id}"
        )
    return source.path


def plan(
    path_or_repo_id: str | Path, tokens: list[int], device: str | None = None
) -> tuple[dispatch.Target, list[dict]]:
    """What runs for each kind of layer of a model at each of ``tokens`` on ``device`` (a name for
    ``dispatch.Device.parse``; default this machine's): the target and dispatch.model_plan's rows.
    Reads the artifact's config only. Raises ValueError for a device name it does not know."""
    target = dispatch.current() if device is None else dispatch.described(device)
    raw, config = read_model_config(resolve_model_dir(path_or_repo_id))
    return target, dispatch.model_plan(config, quantization_record(raw), raw.get("dtype", "float32"), tokens, target)


def apply_quantization(model: ESMC, record: dict, weights: dict) -> None:
    """Swap in quantized layers exactly where the artifact holds quantized weights (mlx-lm's
    rule: per-layer override from the record, else "has .scales"). Linears become
    ``runtime.quantized.QuantizedLinear``, which runs each call by its plan (runtime/dispatch.py)."""
    quantize_modules(model, record, lambda path: f"{path}.scales" in weights)


def _float_or_packed(name: str, tensor: mx.array, weights: dict) -> bool:
    """A float tensor, or a quantized layer's packed weight (uint32) or scales (uint8 in the
    microscaling modes)."""
    if mx.issubdtype(tensor.dtype, mx.floating):
        return True
    module = name.rpartition(".")[0]
    return name.endswith(".scales") or (name.endswith(".weight") and f"{module}.scales" in weights)


def compute_dtype_for_device(stored: mx.Dtype) -> mx.Dtype:
    """MLX's CPU backend runs bf16/fp16 matmuls at a few GFLOP/s against ~200 for fp32 BLAS:
    on the CPU, compute in fp32."""
    return mx.float32 if mx.default_device() == mx.cpu else stored


def compute_dtype(dtype) -> mx.Dtype | None:
    """``load``'s ``dtype`` as an MLX float dtype (a name is accepted), or ConvertError: an
    integer dtype cast every weight to integers without a word, a name or numpy dtype failed
    in MLX's astype."""
    if dtype is None:
        return None
    chosen = FLOAT_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if not isinstance(chosen, mx.Dtype) or chosen not in FLOAT_DTYPES.values():
        raise ConvertError(f"dtype {dtype!r}: choose one of mx.float32, mx.bfloat16, mx.float16 (or their names)")
    return chosen


def load(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    dtype: mx.Dtype | None = None,
    lazy: bool = False,
    fuse: bool | None = None,
    compile: bool | None = None,
    model_class: type[ESMC] = ESMC,
) -> tuple[ESMC, ESMCTokenizer]:
    """Load an esmc-mlx artifact (local directory or Hub repo id) and its tokenizer.

    ``dtype`` overrides the compute dtype of float parameters (default: stored dtype on GPU,
    float32 on the CPU backend). ``fuse``/``compile``: runtime optimizations (``ESMC.optimize``;
    default: what measured faster on the device — on a GPU both, on the CPU neither). A fused
    model runs q/k/v and gate/up as one matrix each, so its parameter names differ from the
    artifact's; pass ``fuse=False`` to keep transformers' layout. ``model_class``: an ``ESMC``
    subclass to build (``esmc_mlx.load`` passes the one with the task methods). Raises
    ConvertError for a directory that is not an artifact or a ``dtype`` that is not a float
    dtype (``mx.float16`` or its name), HubError for a failed download.
    """
    dtype = compute_dtype(dtype)
    directory = resolve_model_dir(path_or_repo_id, revision)
    raw, config = read_model_config(directory)
    weights = read_weights(directory)
    model = build(model_class(config), raw, weights, directory, dtype, lazy)
    prepare(model, fuse=False if lazy else fuse, compile=compile)
    return model, ESMCTokenizer()


def read_weights(directory: Path) -> dict[str, mx.array]:
    """Every tensor of an artifact's weight files, lazily, after the header checks. Raises
    ConvertError naming the file for a damaged one or a tensor that is neither float nor packed."""
    weights: dict[str, mx.array] = {}
    files = weight_files(directory)
    # truncated or damaged files, a tensor in two files: one error naming them, before MLX reads them
    where = tensor_files(files)
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise ConvertError(f"{f}: cannot read the weights ({e})") from None
    odd = [n for n, w in weights.items() if not _float_or_packed(n, w, weights)]
    if odd:
        raise ConvertError(
            f"{where[odd[0]]}: tensor {odd[0]} is {str(weights[odd[0]].dtype).split('.')[-1]}, not a float "
            "weight (only quantized weights and their scales are integers); convert the model again"
        )
    return weights


def build(model: ESMC, raw: dict, weights: dict, directory: Path, dtype: mx.Dtype | None, lazy: bool) -> ESMC:
    """``model`` with the artifact's ``weights`` in place: quantized layers where its record says,
    cast to ``dtype`` (default: stored on a GPU, float32 on the CPU), evaluated unless ``lazy``."""
    record = quantization_record(raw)
    if record:
        try:
            apply_quantization(model, record, weights)
        except ValueError as e:  # MLX refusing the record's bits / group size / mode, as a traceback
            raise ConvertError(
                f"{directory / 'config.json'}: its quantization record does not describe a quantization "
                f"MLX can run ({e}); convert the model again"
            ) from None
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ConvertError(
            f"{directory}: weights do not match config.json ({e}); if this is a checkpoint in "
            "another layout, convert it first with esmc-convert"
        ) from None
    stored = FLOAT_DTYPES.get(raw.get("dtype", "float32"), mx.float32)
    target = dtype or compute_dtype_for_device(stored)
    if target != stored:
        model.set_dtype(target)
    if not lazy:
        mx.eval(model.parameters())
    return model


def prepare(model: ESMC, fuse: bool | None = None, compile: bool | None = None) -> ESMC:
    """Make a model whose weights are in place ready to run on the default device: on a CUDA GPU
    the fused steps of cuda/fusions.py (each where its plan sends it), then the layout and
    compiling measured faster there (``ESMC.optimize``), in eval mode."""
    if backend() == "cuda":
        model.use_ops(CUDA)
    model.optimize(fuse=fuse, compile=compile)
    model.eval()
    return model
