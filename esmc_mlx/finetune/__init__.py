"""Adapting ESMC to labeled sequences: LoRA (and QLoRA, on a quantized base that stays packed)
with a task head, from mlx-lm's LoRA layers and mlx's optimizers; predictions; adapters merged
into their base. mlx-lm is the ``finetune`` extra.

``finetune`` trains (``esmc-mlx finetune``), ``load_adapter`` gives a model whose ``predict``
answers, ``predict_csv`` is ``esmc-mlx predict``, ``fuse_adapter`` writes the merged model
(``esmc-mlx predict --fuse``). docs/finetune.md has the guide and an evaluation.
"""

from .adapter import (
    ADAPTER_FILES,
    adapter_files,
    check_adapter_base,
    fuse_adapter,
    is_adapter,
    load_adapter,
    render_card,
)
from .data import TASKS
from .model import AdaptedModel, Predictions
from .predict import predict_csv
from .train import finetune

__all__ = [
    "ADAPTER_FILES",
    "TASKS",
    "AdaptedModel",
    "Predictions",
    "adapter_files",
    "check_adapter_base",
    "finetune",
    "fuse_adapter",
    "is_adapter",
    "load_adapter",
    "predict_csv",
    "render_card",
]
