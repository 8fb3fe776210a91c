"""esmc-mlx: convert, quantize, validate and run ESMC protein language models with MLX."""

__version__ = "0.1.0"

from . import _blas  # noqa: E402  (must precede the first `import mlx.core`)

_blas.load_fast_blas()

from .runtime import ESMC, ESMCOutput, ESMCTokenizer, TokenizerError, load  # noqa: E402

__all__ = ["ESMC", "ESMCOutput", "ESMCTokenizer", "TokenizerError", "load", "__version__"]
