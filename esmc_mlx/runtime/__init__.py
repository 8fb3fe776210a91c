"""The MLX runtime: model, tokenizer, load(). Imports neither torch nor transformers."""

from .load import load
from .model import ESMC, ESMCOutput
from .tokenizer import ESMCTokenizer, TokenizerError
from .fasta import read_fasta
from .jobs import embed_fasta, read_embeddings, score_csv
from .scoring import Embeddings, MutationScores, pseudo_perplexity

__all__ = ["ESMC", "ESMCOutput", "ESMCTokenizer", "Embeddings", "MutationScores", "TokenizerError", "embed_fasta",
           "load", "pseudo_perplexity", "read_embeddings", "read_fasta", "score_csv"]
