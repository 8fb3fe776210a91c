"""ESMFold2 structure prediction around the MLX model: protein chains to features, the diffusion
sampler over a denoiser, structure files (PDB, mmCIF)."""

from .features import atom_counts, chain_tag, chains_from_text, check_chain, protein_features
from .job import FoldSummary, fold_job
from .predict import FoldingModel, Structure, fold, load_fold
from .sampler import (
    center_random_augmentation,
    inference_noise_schedule,
    noise_schedule,
    random_rotations,
    sample_structure,
    weighted_rigid_align,
)
from .structure import rank_samples, to_mmcif, to_pdb

__all__ = [
    "FoldSummary",
    "FoldingModel",
    "Structure",
    "fold",
    "fold_job",
    "load_fold",
    "atom_counts",
    "center_random_augmentation",
    "chain_tag",
    "chains_from_text",
    "check_chain",
    "inference_noise_schedule",
    "noise_schedule",
    "protein_features",
    "random_rotations",
    "rank_samples",
    "sample_structure",
    "to_mmcif",
    "to_pdb",
    "weighted_rigid_align",
]
