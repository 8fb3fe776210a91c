"""esmc-mlx: convert, quantize, validate and run ESMC protein language models with MLX."""

__version__ = "0.1.0"

from . import _blas  # noqa: E402

_blas.load_mlx()  # a clear error for a broken MLX install; MLX's CPU GEMMs on OpenBLAS (Linux)

from .runtime import ESMC, ESMCOutput, ESMCTokenizer, TokenizerError, load  # noqa: E402

__all__ = ["ESMC", "ESMCOutput", "ESMCTokenizer", "TokenizerError", "load", "__version__"]
