"""The MLX runtime: model, tokenizer, load(). Imports neither torch nor transformers."""

from .load import load
from .model import ESMC, ESMCOutput
from .tokenizer import ESMCTokenizer, TokenizerError

__all__ = ["ESMC", "ESMCOutput", "ESMCTokenizer", "TokenizerError", "load"]
