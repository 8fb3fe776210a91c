"""``load_fold(path_or_repo_id)``: an esmc-mlx fold artifact as an MLX ESMFold2."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ...errors import ConvertError
from ...fold_artifact import BACKBONE, keeps_float32, read_fold_config
from ..load import build, compute_dtype, prepare, read_weights, resolve_model_dir
from ..model import ESMC
from .model import ESMFold2


def load_fold(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    dtype: mx.Dtype | str | None = None,
    model_class: type[ESMFold2] = ESMFold2,
) -> ESMFold2:
    """Load a fold artifact (a local directory, an alias or a Hub repo id): the folding model and
    its ESMC backbone (quantized where the artifact is).

    ``dtype``: the compute dtype of float weights (default: as stored on a GPU, float32 on the
    CPU); the tensors the reference keeps in float32 (norms, the Fourier embedding, the distogram
    head) stay float32 whatever it says. Raises ConvertError for a directory that is not a fold
    artifact or does not match its config, HubError for a failed download."""
    dtype = compute_dtype(dtype)
    directory = resolve_model_dir(path_or_repo_id, revision)
    raw, config = read_fold_config(directory)
    weights = read_weights(directory)
    backbone = {n: w for n, w in weights.items() if n.startswith(BACKBONE)}
    folding = {n: w for n, w in weights.items() if not n.startswith(BACKBONE)}
    esmc = build(ESMC(config.esmc_config, lm_head=False), raw, backbone, directory, dtype, lazy=False)
    prepare(esmc)
    model = model_class(config, esmc)
    try:
        model.load_weights(list(folding.items()), strict=True)
    except ValueError as e:
        raise ConvertError(f"{directory}: weights do not match config.json ({e}); convert the model again") from None
    target = dtype or (mx.float32 if mx.default_device() == mx.cpu else None)
    if target is not None:
        cast = [(n, w if keeps_float32(n) else w.astype(target)) for n, w in tree_flatten(model.parameters())]
        model.update(tree_unflatten(cast))
    mx.eval(model.parameters())
    model.eval()
    return model
