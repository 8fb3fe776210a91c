"""The input embedder of ESMFold2: single inputs and the initial pair state (transformers'
``EsmFold2InputEmbedder`` and ``EsmFold2RelativePositionEncoding``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...fold_config import FoldConfig
from .atoms import AtomEncoder, AtomInputs


class RelativePositionEncoding(nn.Module):
    """Pair encoding of relative residue index, token index, chain (sym_id) offset and same entity.

    ``embed.weight`` is (pairwise_hidden_size, 2 * (2 * residue_bins + 2) + 1 + (2 * chain_bins + 2)).
    """

    def __init__(self, config: FoldConfig):
        super().__init__()
        self.num_relative_residx_bins = config.num_relative_residx_bins
        self.num_relative_chain_bins = config.num_relative_chain_bins
        num_features = 2 * (2 * self.num_relative_residx_bins + 2) + (2 * self.num_relative_chain_bins + 2) + 1
        self.embed = nn.Linear(num_features, config.pairwise_hidden_size, bias=False)

    def _one_hot(self, diff: mx.array, num_bins: int, keep: mx.array) -> mx.array:
        """``2 * num_bins + 2`` classes in ``embed``'s dtype: the clipped offset, or the last
        ("out of context") class where ``keep`` is False."""
        binned = mx.where(keep, mx.clip(diff + num_bins, 0, 2 * num_bins), 2 * num_bins + 1)
        return (binned[..., None] == mx.arange(2 * num_bins + 2)).astype(self.embed.weight.dtype)

    def __call__(
        self,
        residue_index: mx.array,
        asym_id: mx.array,
        sym_id: mx.array,
        entity_id: mx.array,
        token_index: mx.array,
    ) -> mx.array:
        def pairwise(x: mx.array, op) -> mx.array:
            return op(x[:, :, None], x[:, None, :])

        same_chain = pairwise(asym_id, mx.equal)
        same_residue = pairwise(residue_index, mx.equal)
        same_entity = pairwise(entity_id, mx.equal)
        residue_bins, chain_bins = self.num_relative_residx_bins, self.num_relative_chain_bins
        features = mx.concatenate(
            [
                self._one_hot(pairwise(residue_index, mx.subtract), residue_bins, same_chain),
                self._one_hot(pairwise(token_index, mx.subtract), residue_bins, same_chain & same_residue),
                same_entity[..., None].astype(self.embed.weight.dtype),
                # The chain offset is for pairs across chains, so its keep mask is inverted.
                self._one_hot(pairwise(sym_id, mx.subtract), chain_bins, ~same_chain),
            ],
            axis=-1,
        )
        return self.embed(features)


class InputEmbedder(nn.Module):
    """Atom encoder + residue features -> ``single_inputs``; the initial pair state from them plus the
    relative-position and token-bond encodings."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        self.atom_encoder = AtomEncoder(config, config.atom_encoder)
        self.pair_init_1 = nn.Linear(config.single_inputs_size, config.pairwise_hidden_size, bias=False)
        self.pair_init_2 = nn.Linear(config.single_inputs_size, config.pairwise_hidden_size, bias=False)
        self.rel_pos = RelativePositionEncoding(config)
        self.token_bonds = nn.Linear(1, config.pairwise_hidden_size, bias=False)

    def __call__(
        self,
        atom_inputs: AtomInputs,
        res_type_one_hot: mx.array,
        profile: mx.array,
        deletion_mean: mx.array,
        token_index: mx.array,
        residue_index: mx.array,
        asym_id: mx.array,
        sym_id: mx.array,
        entity_id: mx.array,
        token_bonds: mx.array,
        num_tokens: int,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(single_inputs (B, L, single_inputs_size), initial_pair_states (B, L, L, pairwise),
        relative_position_encoding, token_bonds_encoding); the last two are already in the pair
        states and are returned for the diffusion module and the confidence head."""
        encoder = self.atom_encoder
        atom_embeds, position_embeddings = encoder.embed_atoms(atom_inputs)
        # No coordinates exist yet: the layer stream and its conditioning are the same embeddings.
        atom_encoding = encoder(
            atom_embeds,
            atom_embeds,
            encoder.build_attention_mask(atom_inputs.atom_attention_mask, atom_embeds),
            position_embeddings,
            atom_inputs.atom_attention_mask,
            atom_inputs.atom_to_token,
            num_tokens,
        )[0]
        dtype = atom_encoding.dtype
        single_inputs = mx.concatenate(
            [
                atom_encoding,
                res_type_one_hot.astype(dtype),
                profile.astype(dtype),
                deletion_mean[..., None].astype(dtype),
            ],
            axis=-1,
        )
        pair = self.pair_init_1(single_inputs)[:, :, None] + self.pair_init_2(single_inputs)[:, None]
        relative_position_encoding = self.rel_pos(residue_index, asym_id, sym_id, entity_id, token_index)
        token_bonds_encoding = self.token_bonds(token_bonds.astype(self.token_bonds.weight.dtype))
        pair = pair + relative_position_encoding + token_bonds_encoding
        return single_inputs, pair, relative_position_encoding, token_bonds_encoding
