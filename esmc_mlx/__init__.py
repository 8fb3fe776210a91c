"""esmc-mlx: convert, quantize, validate and run ESMC protein language models with MLX."""

from . import _blas  # noqa: E402
from ._version import __version__

_blas.load_mlx()  # a clear error for a broken MLX install; MLX's CPU GEMMs on OpenBLAS (Linux)

from .errors import EsmcMlxError, EsmcMlxWarning, SequenceError, TokenizerError  # noqa: E402
from .runtime import ESMC, ESMCOutput, ESMCTokenizer  # noqa: E402
from .tasks import ProteinModel, load  # noqa: E402

__all__ = [
    "ESMC",
    "ESMCOutput",
    "ESMCTokenizer",
    "EsmcMlxError",
    "EsmcMlxWarning",
    "ProteinModel",
    "SequenceError",
    "TokenizerError",
    "load",
    "__version__",
]
