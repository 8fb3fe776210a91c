"""Folding one protein or complex end to end: features -> trunk -> diffusion samples ->
confidence, the whole of transformers' ``EsmFold2Model.fold``, and what it returns."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ...runtime.fold.draws import Draws
from ...runtime.fold.load import load_fold as load_runtime
from ...runtime.fold.model import ESMFold2
from .features import protein_features
from .sampler import noise_schedule, sample_structure
from .structure import rank_samples, to_mmcif, to_pdb

# What the confidence head returns per sample, kept on a Structure (the logits stay behind:
# (S, L, L, 64) floats twice over, and the expected values are what users read).
KEPT = ("plddt", "plddt_per_atom", "plddt_ca", "complex_plddt", "complex_iplddt", "pae", "pde", "ptm", "iptm")


@dataclasses.dataclass
class Structure:
    """A folded protein or complex: ``S`` samples of its ``A`` atoms over ``L`` residues.

    ``coords`` (S, A, 3) in angstrom (padding atoms included: ``features["atom_attention_mask"]``
    marks the real ones); ``plddt`` (S, L) and ``plddt_per_atom`` (S, A) on a 0-1 scale; ``pae``,
    ``pde`` (S, L, L) in angstrom; ``ptm``, ``iptm`` (S,); ``pair_chains_iptm`` (S, C, C);
    ``distogram_logits`` (L, L, bins). ``best`` is the sample ranked first (highest pTM)."""

    chains: list[str]
    features: dict[str, np.ndarray]
    coords: np.ndarray
    distogram_logits: np.ndarray
    plddt: np.ndarray
    plddt_per_atom: np.ndarray
    plddt_ca: np.ndarray
    complex_plddt: np.ndarray
    complex_iplddt: np.ndarray
    pae: np.ndarray
    pde: np.ndarray
    ptm: np.ndarray
    iptm: np.ndarray
    pair_chains_iptm: np.ndarray
    seconds: float = 0.0

    @property
    def best(self) -> int:
        return rank_samples(self)

    def __repr__(self) -> str:
        s, a, _ = self.coords.shape
        return (
            f"Structure({len(self.chains)} chain{'s' if len(self.chains) > 1 else ''}, {sum(map(len, self.chains))} "
            f"residues, {s} sample{'s' if s > 1 else ''}, best {self.best}: pTM {self.ptm[self.best]:.3f}, "
            f"mean pLDDT {100 * self.plddt[self.best].mean():.1f})"
        )

    def _sample(self, sample: int | None) -> int:
        return self.best if sample is None else range(len(self.coords))[sample]

    def to_pdb(self, sample: int | None = None) -> str:
        """PDB text of one sample (default: the best), per-atom pLDDT (0-100) in the B-factor column."""
        i = self._sample(sample)
        return to_pdb(self.features, self.coords[i], 100 * self.plddt_per_atom[i])

    def to_mmcif(self, sample: int | None = None, name: str = "esmfold2") -> str:
        """mmCIF text of one sample (default: the best), per-atom pLDDT (0-100) as B_iso_or_equiv."""
        i = self._sample(sample)
        return to_mmcif(self.features, self.coords[i], 100 * self.plddt_per_atom[i], name=name)


def fold(
    model: ESMFold2,
    chains: str | Sequence[str],
    samples: int = 1,
    steps: int | None = None,
    loops: int | None = None,
    seed: int = 0,
    draws: Draws | None = None,
    compile: bool = False,
    stages: dict | None = None,
) -> Structure:
    """Fold one protein chain (a string) or a complex (a list of chains; ``"A|B"`` reads as two).

    ``samples``: diffusion samples drawn (the confidence head scores each); ``steps``: the Karras
    schedule's length before the config's sigma cap (default the config's, 68 in the published
    models); ``loops``: trunk recycling loops (default the config's, 10); ``seed`` seeds every random
    draw (the same seed folds the same structure), or ``draws`` supplies them (``Replay`` replays a
    reference's). ``compile``: trace the denoiser once and replay it every step (off by default: not
    measured faster anywhere, see docs/decisions.md). ``stages``: a dict that receives, per stage
    (features, trunk with the backbone, conditioning, sampler, confidence), its seconds and peak
    memory in bytes; each stage is then finished before the next begins (a profile: the same
    numbers, no overlap between stages). Raises FoldError for input the fold cannot take."""
    start = time.perf_counter()
    mark = _stage_marks(stages, start)
    if isinstance(chains, str):
        chains = chains.split("|")
    chains = list(chains)
    features = protein_features(chains)
    mark("features")
    draws = draws if draws is not None else Draws(seed)
    head = model.config.structure_head
    trunk = model.trunk(features, draws, num_loops=loops)
    mark("trunk", vars(trunk), vars(trunk.atom_inputs))
    mask = mx.array(features["attention_mask"]).astype(mx.bool_)
    atoms = trunk.atom_inputs
    conditioning = model.structure_head.prepare_conditioning(
        atoms, trunk.pair_states, trunk.relative_position_encoding, trunk.single_inputs, mask, samples
    )
    mark("conditioning", vars(conditioning))
    schedule, gammas = noise_schedule(head, steps)

    def denoise(noisy: mx.array, noise_level: mx.array) -> mx.array:
        return model.structure_head(noisy, noise_level, conditioning)

    if compile:
        # every step has the same shapes: one trace, replayed without Python, its elementwise ops fused
        denoise = mx.compile(denoise)

    coords = sample_structure(
        denoise, atoms.atom_attention_mask, schedule, gammas, head.noise_scale, head.step_scale, samples, draws
    )
    mark("sampler", coords)
    confidence = model.confidence_head(
        single_inputs=trunk.single_inputs,
        pair_states=trunk.pair_states,
        predicted_coords=coords,
        distogram_atom_idx=mx.array(features["distogram_atom_idx"]),
        attention_mask=mask,
        atom_to_token=atoms.atom_to_token,
        atom_attention_mask=atoms.atom_attention_mask,
        asym_id=mx.array(features["asym_id"]),
        mol_type=mx.array(features["mol_type"]),
        relative_position_encoding=trunk.relative_position_encoding,
        token_bonds_encoding=trunk.token_bonds_encoding,
        num_diffusion_samples=samples,
    )
    mark("confidence", confidence)
    kept = {k: np.array(confidence[k].astype(mx.float32)) for k in (*KEPT, "pair_chains_iptm")}
    return Structure(
        chains=chains,
        features=features,
        coords=np.array(coords),
        distogram_logits=np.array(trunk.distogram_logits[0].astype(mx.float32)),
        seconds=time.perf_counter() - start,
        **kept,
    )


def _stage_marks(stages: dict | None, start: float):
    """``mark(name, *trees)``: where ``stages`` is a dict, finish the arrays of ``trees`` and record
    the stage's seconds since the last mark (or ``start``) and its peak memory; else nothing."""
    if stages is None:
        return lambda name, *arrays: None
    last = start
    mx.reset_peak_memory()

    def mark(name: str, *trees) -> None:
        nonlocal last
        mx.eval([a for _, a in tree_flatten(list(trees)) if isinstance(a, mx.array)])
        mx.synchronize()
        now = time.perf_counter()
        stages[name] = {"seconds": now - last, "peak_bytes": mx.get_peak_memory()}
        last = now
        mx.reset_peak_memory()

    return mark


class FoldingModel(ESMFold2):
    """ESMFold2 with ``fold`` as a method; ``esmc_mlx.load_fold`` returns one."""

    def fold(self, chains: str | Sequence[str], **kwargs) -> Structure:
        """Fold one chain or a complex; see ``tasks.fold.fold``."""
        return fold(self, chains, **kwargs)


def load_fold(path_or_repo_id, revision: str | None = None, dtype=None) -> FoldingModel:
    """``esmc_mlx.runtime.fold.load.load_fold`` returning a ``FoldingModel`` (same arguments, same errors)."""
    return load_runtime(path_or_repo_id, revision, dtype, model_class=FoldingModel)
