"""esmc-mlx: convert, quantize, validate and run ESMC protein language models with MLX."""

import os

from . import _blas  # noqa: E402
from ._version import __version__

_blas.load_mlx()  # a clear error for a broken MLX install; MLX's CPU GEMMs on OpenBLAS (Linux)

from .hashes import cache_root  # noqa: E402

# MLX's CUDA backend compiles its own kernels at first use and keeps them under /tmp, which a
# reboot or a fresh container empties: keep them in esmc-mlx's cache, so that a machine
# compiles them once (on the H200, a fresh machine's first 6B validation spent about 8 s in the
# compiler). Read by MLX at its first compile. MLX would compile ours (runtime/cuda/) in every
# process; runtime/cuda/kernel_cache.py puts them in this same directory.
if "MLX_PTX_CACHE_DIR" not in os.environ and (_root := cache_root()) is not None:
    os.environ["MLX_PTX_CACHE_DIR"] = str(_root / "ptx")

from .errors import EsmcMlxError, EsmcMlxWarning, SequenceError, TokenizerError  # noqa: E402
from .finetune import load_adapter  # noqa: E402
from .runtime import ESMC, ESMCOutput, ESMCTokenizer  # noqa: E402
from .runtime.sae import SparseAutoencoder, load_sae  # noqa: E402
from .tasks import ProteinModel, load, read_embeddings  # noqa: E402
from .tasks.fold import FoldingModel, Structure, load_fold  # noqa: E402

__all__ = [
    "ESMC",
    "ESMCOutput",
    "ESMCTokenizer",
    "EsmcMlxError",
    "EsmcMlxWarning",
    "FoldingModel",
    "ProteinModel",
    "SequenceError",
    "SparseAutoencoder",
    "Structure",
    "TokenizerError",
    "load",
    "load_adapter",
    "load_fold",
    "load_sae",
    "read_embeddings",
    "__version__",
]
