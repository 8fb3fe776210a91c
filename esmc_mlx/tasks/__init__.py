"""What users run on a loaded model: embeddings, variant scores, pseudo-perplexity, the embed and
score jobs over files, FASTA and mutant parsing, data-parallel runs under ``mlx.launch``.

Built on ``esmc_mlx.runtime`` and nothing above it. ``ProteinModel`` is the runtime's ``ESMC``
with these jobs as methods; ``esmc_mlx.load`` returns one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from ..runtime import ESMC, ESMCTokenizer
from ..runtime import load as load_runtime
from .fasta import Record, parse_fasta, read_fasta
from .jobs import embed_fasta, score_csv
from .sae import SAEFeatures, sae_features
from .scan import Scan, scan
from .scoring import Embeddings, MutationScores, embed, pseudo_perplexity, score_mutations
from .store import read_embeddings


class ProteinModel(ESMC):
    """ESMC with the jobs users run on it as methods (the functions of ``esmc_mlx.tasks``)."""

    def embed(self, sequences: str | Sequence[str], **kwargs) -> Embeddings:
        """Mean-pooled (and optionally per-residue) embeddings; see ``tasks.scoring.embed``."""
        return embed(self, sequences, **kwargs)

    def score_mutations(self, sequence: str, mutations: Sequence[str], **kwargs) -> MutationScores:
        """Masked-marginal / wild-type-marginal variant scores; see ``tasks.scoring.score_mutations``."""
        return score_mutations(self, sequence, mutations, **kwargs)

    def scan(self, sequence: str, **kwargs) -> Scan:
        """Every single substitution scored, with per-position entropy; see ``tasks.scan.scan``."""
        return scan(self, sequence, **kwargs)

    def pseudo_perplexity(self, sequences: str | Sequence[str], **kwargs):
        """Pseudo-perplexity per sequence; see ``tasks.scoring.pseudo_perplexity``."""
        return pseudo_perplexity(self, sequences, **kwargs)

    def sae_features(self, sequences: str | Sequence[str], sae, layer=None, normalize: bool = False, **kwargs):
        """Sparse autoencoder features of every token, one ``SAEFeatures`` per sequence (a dict
        of them for several SAEs or layers); see ``tasks.sae.sae_features``."""
        return sae_features(self, sequences, sae, layer=layer, normalize=normalize, **kwargs)


def load(
    path_or_repo_id: str | Path, revision: str | None = None, dtype: mx.Dtype | None = None, **kwargs
) -> tuple[ProteinModel, ESMCTokenizer]:
    """``esmc_mlx.runtime.load`` returning a ``ProteinModel`` (same arguments, same errors)."""
    return load_runtime(path_or_repo_id, revision, dtype, model_class=ProteinModel, **kwargs)


__all__ = [
    "Embeddings",
    "MutationScores",
    "ProteinModel",
    "Record",
    "SAEFeatures",
    "Scan",
    "embed",
    "embed_fasta",
    "load",
    "parse_fasta",
    "pseudo_perplexity",
    "read_embeddings",
    "read_fasta",
    "sae_features",
    "scan",
    "score_csv",
    "score_mutations",
]
