"""esmc-mlx: convert, quantize, validate and run ESMC protein language models with MLX."""

from ._version import __version__

from . import _blas  # noqa: E402  (must precede the first `import mlx.core`)

_blas.load_fast_blas()

from .errors import EsmcMlxError, EsmcMlxWarning, SequenceError, TokenizerError  # noqa: E402
from .runtime import ESMC, ESMCOutput, ESMCTokenizer  # noqa: E402
from .tasks import ProteinModel, load  # noqa: E402

__all__ = ["ESMC", "ESMCOutput", "ESMCTokenizer", "EsmcMlxError", "EsmcMlxWarning", "ProteinModel", "SequenceError",
           "TokenizerError", "load", "__version__"]
