"""The ESMFold2 confidence head: pLDDT, PAE, PDE, resolved atoms, pTM and ipTM of sampled structures
(transformers' ``EsmFold2ConfidenceHead`` and its parts, same attribute names and output keys)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...fold_config import FoldConfig
from .layers import LayerNorm, piecewise
from .trunk import PairUpdateStack, pair_mask_of


def _gather_rows(source: mx.array, index: mx.array) -> mx.array:
    """``source[b, index[b, m]]``: ``[B, N, d]`` gathered along axis 1 by a ``[B, M]`` index."""
    return mx.take_along_axis(source, index[..., None].astype(mx.int32), axis=1)


def intra_token_index(atom_to_token: mx.array) -> mx.array:
    """Each atom's index within its token (a token's atoms are contiguous): a running count that
    restarts where ``atom_to_token`` changes."""
    same_as_prev = mx.pad(atom_to_token[:, 1:] == atom_to_token[:, :-1], [(0, 0), (1, 0)], constant_values=False)
    count = mx.cumsum(mx.ones(atom_to_token.shape, dtype=mx.int32), axis=-1)
    group_start = mx.cummax(mx.where(same_as_prev, 0, count), axis=-1)
    return count - group_start


def categorical_mean(logits: mx.array, start: float, end: float) -> mx.array:
    """Expected value (float32) of a categorical over ``logits.shape[-1]`` even bins spanning [start, end]."""
    num_bins = logits.shape[-1]
    edges = mx.linspace(start, end, num_bins + 1, dtype=mx.float32)
    centers = (edges[:-1] + edges[1:]) / 2
    return (mx.softmax(logits.astype(mx.float32), axis=-1, precise=True) @ centers[:, None]).squeeze(-1)


def _repeat(x: mx.array, n: int) -> mx.array:
    """torch's ``repeat_interleave(n, 0)``: each batch row n times in a row (sample-major)."""
    return x if n == 1 else mx.repeat(x, n, axis=0)


class ConfidenceInputEmbedder(nn.Module):
    """The confidence head's base pair representation: normed trunk pair states plus the encodings
    and the single inputs projected onto rows, columns and their outer product."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        s, d = config.single_inputs_size, config.pairwise_hidden_size
        self.single_inputs_norm = LayerNorm(s)
        self.pair_norm = LayerNorm(d)
        self.single_to_pair = nn.Linear(s, d, bias=False)
        self.single_to_pair_transpose = nn.Linear(s, d, bias=False)
        self.single_to_pair_prod_in1 = nn.Linear(s, d, bias=False)
        self.single_to_pair_prod_in2 = nn.Linear(s, d, bias=False)
        self.single_to_pair_prod_out = nn.Linear(d, d, bias=False)

    def __call__(
        self,
        single_inputs: mx.array,
        pair_states: mx.array,
        relative_position_encoding: mx.array,
        token_bonds_encoding: mx.array,
    ) -> mx.array:
        single = self.single_inputs_norm(single_inputs)
        pair = self.pair_norm(pair_states) + relative_position_encoding + token_bonds_encoding
        pair = pair + self.single_to_pair(single)[:, :, None]
        pair = pair + self.single_to_pair_transpose(single)[:, None]
        outer = self.single_to_pair_prod_in1(single)[:, :, None, :] * self.single_to_pair_prod_in2(single)[:, None]
        return pair + self.single_to_pair_prod_out(outer)


class RowAttentionPooling(nn.Module):
    """Pair rows pooled to single states: a softmax over valid keys of a learned score, then out_proj."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        self.attn_proj = nn.Linear(config.pairwise_hidden_size, 1, bias=False)
        self.out_proj = nn.Linear(config.pairwise_hidden_size, config.hidden_size, bias=False)

    def __call__(self, pair_states: mx.array, attention_mask: mx.array) -> mx.array:
        scores = self.attn_proj(pair_states).squeeze(-1)  # [B, L, L]
        scores = mx.where(attention_mask.astype(mx.bool_)[:, None, :], scores, mx.finfo(scores.dtype).min)
        weights = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(scores.dtype)
        return self.out_proj((weights[..., None, :] @ pair_states).squeeze(-2))


class ConfidenceHead(nn.Module):
    """pLDDT (per atom, token, complex, interface), resolved-atom logits, PAE, PDE, pTM, ipTM and per
    chain-pair ipTM for each of ``num_diffusion_samples`` structures per input."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        head = config.confidence_head
        self.eps = head.eps
        self.boundaries = mx.linspace(head.min_dist, head.max_dist, head.distogram_bins - 1, dtype=mx.float32)
        self.dist_bin_pairwise_embed = nn.Embedding(head.distogram_bins, config.pairwise_hidden_size)
        self.input_embedder = ConfidenceInputEmbedder(config)
        self.row_attention_pooling = RowAttentionPooling(config)
        self.folding_trunk = PairUpdateStack(config, head.num_hidden_layers)
        self.plddt_layernorm = LayerNorm(config.hidden_size)
        self.plddt_weight = mx.zeros((config.max_atoms_per_token, config.hidden_size, head.num_plddt_bins))
        self.pae_layernorm = LayerNorm(config.pairwise_hidden_size)
        self.pae_head = nn.Linear(config.pairwise_hidden_size, head.num_pae_bins, bias=False)
        self.pde_layernorm = LayerNorm(config.pairwise_hidden_size)
        self.pde_head = nn.Linear(config.pairwise_hidden_size, head.num_pde_bins, bias=False)
        self.resolved_layernorm = LayerNorm(config.hidden_size)
        self.resolved_weight = mx.zeros((config.max_atoms_per_token, config.hidden_size, 2))

    def _per_slot(self, x: mx.array, weight: mx.array, slot: mx.array) -> mx.array:
        """``x[..., c] @ weight[slot][c, b]`` per atom, without materialising ``weight[slot]``
        (``[atoms, hidden, bins]``: gigabytes for a large complex) as the reference's einsum does:
        every slot's logits of every atom (``[slots, atoms, bins]``, small), then each atom's own.
        (With ``mx.gather_mm`` here the confidence head aborted on CUDA at the published widths with a
        misaligned address: H100, MLX 0.32.4.)"""
        every = x[..., None, :, :] @ weight  # [..., slots, atoms, bins]
        index = mx.broadcast_to(slot[..., None, :, None].astype(mx.int32), (*every.shape[:-3], 1, *every.shape[-2:]))
        return mx.take_along_axis(every, index, axis=-3).squeeze(-3)

    def __call__(
        self,
        single_inputs: mx.array,
        pair_states: mx.array,
        predicted_coords: mx.array,
        distogram_atom_idx: mx.array,
        attention_mask: mx.array,
        atom_to_token: mx.array,
        atom_attention_mask: mx.array,
        asym_id: mx.array,
        mol_type: mx.array,
        relative_position_encoding: mx.array,
        token_bonds_encoding: mx.array,
        num_diffusion_samples: int = 1,
    ) -> dict[str, mx.array]:
        """Inputs at the unexpanded batch ``B`` (``atom_to_token`` zeroed at padding atoms), except
        ``predicted_coords``: ``[B * S, A, 3]`` sample-major, or ``[B, S, A, 3]``. Outputs have the
        expanded batch ``B * S`` first; keys and meaning as the reference's."""
        n = num_diffusion_samples
        compute_dtype = self.plddt_weight.dtype  # the reference's pae_head weight dtype
        pair = self.input_embedder(single_inputs, pair_states, relative_position_encoding, token_bonds_encoding)
        pair = _repeat(pair, n)
        atom_to_token = _repeat(atom_to_token, n)
        atom_mask = _repeat(atom_attention_mask, n).astype(mx.float32)
        rep_idx = _repeat(distogram_atom_idx, n)
        token_mask = _repeat(attention_mask, n).astype(mx.bool_)
        asym = _repeat(asym_id, n)
        is_ligand = (_repeat(mol_type, n) == 3).astype(mx.float32)  # 3: non-polymer (ligand)
        coords = predicted_coords.reshape(-1, *predicted_coords.shape[-2:])

        # Distances computed exactly, not through |x|^2 + |y|^2 - 2xy (the reference's cdist mode).
        rep_coords = _gather_rows(coords, rep_idx)
        rep_distances = mx.sqrt(mx.sum(mx.square(rep_coords[:, :, None] - rep_coords[:, None]), axis=-1))
        distance_bins = mx.sum(rep_distances[..., None] > self.boundaries, axis=-1)
        pair = pair + self.dist_bin_pairwise_embed(distance_bins)
        # A large pair is evaluated between the steps below, so that their temporaries never coexist.
        evaluate = piecewise(pair)
        if evaluate:
            mx.eval(pair)

        # The stack returns refined states, and the reference adds them to its input (in float32).
        pair = pair + self.folding_trunk(pair.astype(compute_dtype), pair_attention_mask=pair_mask_of(token_mask))
        pair = pair.astype(compute_dtype)
        if evaluate:
            mx.eval(pair)
        single = self.row_attention_pooling(pair, token_mask)

        out = self._atom_confidences(single, atom_to_token, atom_mask, rep_idx, rep_distances, is_ligand, asym)
        out["pae_logits"] = self.pae_head(self.pae_layernorm(pair))
        out["pae"] = categorical_mean(out["pae_logits"], 0.0, 32.0)
        out["pde_logits"] = self.pde_head(self.pde_layernorm(pair))
        out["pde"] = categorical_mean(out["pde_logits"], 0.0, 32.0)
        out["ptm"], out["iptm"], out["pair_chains_iptm"] = self._ptm_iptm(out["pae_logits"], token_mask, asym)
        return out

    def _atom_confidences(
        self,
        single: mx.array,
        atom_to_token: mx.array,
        atom_mask: mx.array,
        rep_idx: mx.array,
        rep_distances: mx.array,
        is_ligand: mx.array,
        asym: mx.array,
    ) -> dict[str, mx.array]:
        batch, num_tokens = single.shape[:2]
        single_at_atoms = _gather_rows(single, atom_to_token)
        slot = mx.minimum(intra_token_index(atom_to_token), self.plddt_weight.shape[0] - 1).astype(mx.uint32)
        plddt_logits = self._per_slot(self.plddt_layernorm(single_at_atoms), self.plddt_weight, slot)
        plddt_per_atom = categorical_mean(plddt_logits, 0.0, 1.0)

        rows = mx.arange(batch)[:, None]
        plddt_sum = (
            mx.zeros((batch, num_tokens), dtype=mx.float32).at[rows, atom_to_token].add(plddt_per_atom * atom_mask)
        )
        atom_count = mx.zeros((batch, num_tokens), dtype=mx.float32).at[rows, atom_to_token].add(atom_mask)
        plddt = plddt_sum / mx.maximum(atom_count, 1e-6)
        complex_plddt = mx.sum(plddt_per_atom * atom_mask, axis=-1) / (mx.sum(atom_mask, axis=-1) + self.eps)

        # Interface pLDDT: polymer tokens weigh 1 where within 8 A (the conventional contact cutoff) of
        # another chain, ligand tokens always weigh 2.
        inter_chain = (asym[:, :, None] != asym[:, None, :]).astype(mx.float32)
        near_contact = (rep_distances < 8).astype(mx.float32)
        interface = mx.max(near_contact * inter_chain * (1.0 - is_ligand)[..., None], axis=-1)
        token_weight = mx.where(is_ligand.astype(mx.bool_), mx.full(interface.shape, 2.0), interface)
        atom_weight = atom_mask * _gather_rows(token_weight[..., None], atom_to_token).squeeze(-1)
        complex_iplddt = mx.sum(plddt_per_atom * atom_weight, axis=-1) / (mx.sum(atom_weight, axis=-1) + self.eps)

        plddt_ca = mx.take_along_axis(plddt_per_atom, rep_idx.astype(mx.int32), axis=1)
        resolved_logits = self._per_slot(self.resolved_layernorm(single_at_atoms), self.resolved_weight, slot)
        return {
            "plddt_logits": plddt_logits,
            "plddt": plddt,
            "plddt_per_atom": plddt_per_atom,
            "plddt_ca": plddt_ca,
            "complex_plddt": complex_plddt,
            "complex_iplddt": complex_iplddt,
            "resolved_logits": resolved_logits,
        }

    def _ptm_iptm(self, pae_logits: mx.array, token_mask: mx.array, asym: mx.array):
        """pTM, ipTM and per chain-pair ipTM (max over rows of the row-mean TM term) from the PAE bins."""
        num_bins = pae_logits.shape[-1]
        bin_width = 32.0 / num_bins  # the PAE bins span 0-32 A
        # torch.arange(0.5 w, 32, w) in float32: each center computed in double, rounded once
        centers = mx.array([(i + 0.5) * bin_width for i in range(num_bins)], dtype=mx.float32)
        mask = token_mask.astype(mx.float32)
        num_residues = mx.sum(mask, axis=-1, keepdims=True)
        # TM-score's length scale d0(L) (Zhang & Skolnick, 2004); flooring L at 19 keeps it positive
        d0 = 1.24 * (mx.maximum(num_residues, 19) - 15) ** (1 / 3) - 1.8
        tm_per_bin = 1 / (1 + (centers / d0) ** 2)  # [B, bins]
        probs = mx.softmax(pae_logits.astype(mx.float32), axis=-1, precise=True)
        tm_expected = mx.sum(probs * tm_per_bin[:, None, None, :], axis=-1)  # [B, L, L]

        pair_mask = mask[:, :, None] * mask[:, None, :]
        ptm = mx.max(mx.sum(tm_expected * pair_mask, -1) / (mx.sum(pair_mask, -1) + self.eps), axis=-1)
        inter = (asym[:, :, None] != asym[:, None, :]).astype(mx.float32) * pair_mask
        iptm = mx.max(mx.sum(tm_expected * inter, -1) / (mx.sum(inter, -1) + self.eps), axis=-1)

        batch = pae_logits.shape[0]
        num_chains = int(mx.max(asym).item()) + 1 if batch > 0 else 1
        zeros = mx.zeros((batch,), dtype=tm_expected.dtype)
        rows = []
        for i in range(num_chains):
            in_i = (asym == i).astype(mx.float32) * mask
            if mx.sum(in_i).item() == 0:  # no token of chain i in any sample: the reference leaves zeros
                rows.append(mx.stack([zeros] * num_chains, axis=-1))
                continue
            cols = in_i[:, None, :]
            avg_tm = mx.sum(tm_expected * cols, -1) / (mx.sum(cols, -1) + self.eps)  # [B, L]
            row = []
            for j in range(num_chains):
                in_j = (asym == j).astype(mx.float32) * mask
                row.append(mx.maximum(mx.max(mx.where(in_j == 0, -mx.inf, avg_tm), axis=-1), 0.0))
            rows.append(mx.stack(row, axis=-1))
        return ptm, iptm, mx.stack(rows, axis=1)
