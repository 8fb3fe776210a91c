"""ESMFold2 in MLX: the folding model around an ESMC backbone (transformers' ``EsmFold2Model``).

The math of the trunk's forward: featurized inputs -> single and pair representations ->
recycling loops -> the final pair representation and the distogram. The diffusion sampler that
turns it into coordinates, and the confidence head's call, are driven from ``tasks/fold``
(as the reference keeps its sampling loop apart, in ``generation_esmfold2.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...fold_config import FoldConfig
from ..execution import hash_parameter
from ..model import ESMC
from .atoms import AtomInputs
from .backbone import lm_hidden_states
from .confidence import ConfidenceHead
from .diffusion import DiffusionModule
from .draws import Draws
from .inputs import InputEmbedder
from .msa import MSAEncoder
from .trunk import LanguageModelEncoder, PairUpdateStack, Parcae, pair_mask_of, run_trunk_loops


@dataclasses.dataclass
class TrunkOutput:
    """What the structure and confidence heads read of the trunk (transformers' ``EsmFold2TrunkOutput``)."""

    distogram_logits: mx.array  # (B, L, L, bins), float32
    pair_states: mx.array  # (B, L, L, pairwise), float32
    single_inputs: mx.array  # (B, L, single_inputs_size)
    relative_position_encoding: mx.array
    token_bonds_encoding: mx.array
    atom_inputs: AtomInputs


def atom_inputs(features: dict, config: FoldConfig) -> AtomInputs:
    """The featurizer's raw atom arrays as the atom stack reads them: categorical fields one-hot,
    padding zeroed (the reference's ``_prepare_features``; its Linears have no bias)."""
    mask = mx.array(features["atom_attention_mask"]).astype(mx.bool_)
    keep = mask.astype(mx.float32)
    element = mx.array(np.eye(config.max_atomic_number, dtype=np.float32)[features["ref_element"]])
    chars = mx.array(np.eye(config.char_vocab_size, dtype=np.float32)[features["ref_atom_name_chars"]])
    return AtomInputs(
        ref_pos=mx.array(features["ref_pos"], dtype=mx.float32),
        ref_charge=mx.array(features["ref_charge"]).astype(mx.float32),
        atom_attention_mask=mask,
        ref_element=element * keep[..., None],
        ref_atom_name_chars=chars * keep[..., None, None],
        ref_space_uid=mx.array(features["ref_space_uid"]),
        atom_to_token=mx.array(features["atom_to_token"]) * mask.astype(mx.int64),
    )


class ESMFold2(nn.Module):
    """The folding model. ``esmc`` (the backbone) is held beside the module tree, not in it: it
    loads, quantizes and runs as any ESMC does, and its names in an artifact are ESMC's own."""

    def __init__(self, config: FoldConfig, esmc: ESMC | None = None):
        super().__init__()
        self.config = config
        self.input_embedder = InputEmbedder(config)
        self.language_model = LanguageModelEncoder(config)
        self.folding_trunk = PairUpdateStack(config, config.folding_trunk_num_hidden_layers)
        self.lm_encoder = PairUpdateStack(config, config.lm_encoder.num_hidden_layers)
        self.parcae = Parcae(config)
        self.structure_head = DiffusionModule(config)
        self.distogram_head = nn.Linear(config.pairwise_hidden_size, config.structure_head.num_distogram_bins)
        self.confidence_head = ConfidenceHead(config)
        if config.msa_encoder.enabled:
            self.msa_encoder = MSAEncoder(config)
        object.__setattr__(self, "esmc", esmc if esmc is not None else ESMC(config.esmc_config, lm_head=False))

    @property
    def dtype(self) -> mx.Dtype:
        """The folding model's compute dtype: its projections' (the distogram head stays float32)."""
        return self.parcae.out_proj.weight.dtype

    def fingerprint(self) -> str:
        """A sha256 naming these weights, the backbone's included, as ``ESMC.fingerprint`` names an
        ESMC's (the same artifact loaded anywhere, in any compute dtype): what a fold job records so
        that a rerun resumes only with the same model."""
        digest = hashlib.sha256(self.esmc.fingerprint().encode())
        digest.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        for name, array in sorted(tree_flatten(self.parameters()), key=lambda t: t[0]):
            hash_parameter(digest, name, array)
        return digest.hexdigest()

    def trunk(self, features: dict, draws: Draws, num_loops: int | None = None) -> TrunkOutput:
        """The reference's ``EsmFold2Model.forward`` on one featurized complex (``tasks.fold``'s
        arrays, batch 1), taking its random numbers from ``draws``."""
        config = self.config
        mask = mx.array(features["attention_mask"]).astype(mx.bool_)
        res_type = np.eye(config.num_res_types, dtype=np.float32)[features["res_type"]]
        res_type = mx.array(res_type) * mask[..., None].astype(mx.float32)
        atoms = atom_inputs(features, config)
        ints = {k: mx.array(features[k]) for k in ("token_index", "residue_index", "asym_id", "sym_id", "entity_id")}
        single, initial_pair, relpos, bonds = self.input_embedder(
            atom_inputs=atoms,
            res_type_one_hot=res_type,
            profile=res_type,  # a single-sequence MSA's profile is the sequence's one-hot
            deletion_mean=mx.zeros(mask.shape),
            token_bonds=mx.array(features["token_bonds"]),
            num_tokens=mask.shape[1],
            **ints,
        )
        hidden = lm_hidden_states(self.esmc, features["input_ids"][0], features["asym_id"][0])
        lm_pair = self.language_model(hidden)
        pair_mask = pair_mask_of(mask)
        inject = None
        if "msa_encoder" in self:
            # the query as a depth-1 MSA (B, L, M=1, ...), as the reference folds without alignments
            msa_kwargs = dict(
                single_inputs=single,
                msa_one_hot=res_type[:, :, None],
                has_deletion=mx.zeros(mask.shape + (1,)),
                deletion_value=mx.zeros(mask.shape + (1,)),
                msa_mask=mask[:, :, None].astype(mx.float32),
            )

            def inject(pair):
                return self.msa_encoder(pair, **msa_kwargs)

        out = run_trunk_loops(
            config,
            initial_pair,
            lm_pair,
            pair_mask,
            folding_trunk=self.folding_trunk,
            lm_encoder=self.lm_encoder,
            parcae=self.parcae,
            distogram_head=self.distogram_head,
            draws=draws,
            num_loops=num_loops,
            inject=inject,
        )
        return TrunkOutput(out.distogram_logits, out.pair_states, single, relpos, bonds, atoms)
