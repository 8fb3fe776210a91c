"""Validation: does the MLX artifact compute what the original ESMC computes?

Every report answers two questions (docs/validation.md):
  * fidelity: the MLX runtime against transformers' EsmcForMaskedLM on the weights the
    artifact holds (dequantized when quantized): catches layout, packing and numerics bugs;
  * quality: the artifact against the original checkpoint (KL, top-1, relative errors,
    embedding cosine, Spearman of variant scores), with per-precision bounds.
Needs esmc-mlx[torch]; nothing in the runtime imports this package.
"""

from ..errors import ValidationError
from .core import Check, Report, prefetch_torch, validate, validation_available
from .reference import pick_device
from .thresholds import FIDELITY, QUALITY

__all__ = [
    "Check",
    "FIDELITY",
    "QUALITY",
    "Report",
    "ValidationError",
    "pick_device",
    "prefetch_torch",
    "validate",
    "validation_available",
]
