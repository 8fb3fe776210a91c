"""The MLX runtime: model, quantized layers, tokenizer, load(). Imports neither torch nor
transformers, and nothing above it (the tasks users run on a model live in ``esmc_mlx.tasks``)."""

from .load import load
from .model import ESMC, ESMCOutput
from .tokenizer import ESMCTokenizer

__all__ = ["ESMC", "ESMCOutput", "ESMCTokenizer", "load"]
