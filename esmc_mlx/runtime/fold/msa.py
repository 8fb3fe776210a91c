"""ESMFold2's MSA encoder (transformers' ``EsmFold2MSAEncoder``).

esmc-mlx folds without alignments, but the MSA-capable checkpoint (``biohub/ESMFold2``) runs
this encoder on the single-sequence MSA (the query as its only row) in every trunk loop, as the
reference does: skipping it would fold a different function.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...fold_config import FoldConfig
from .layers import LayerNorm, Transition
from .trunk import PairUpdateLayer


class OuterProductMean(nn.Module):
    def __init__(self, config: FoldConfig):
        super().__init__()
        msa = config.msa_encoder
        self.outer_hidden_size = msa.outer_hidden_size
        self.chunk_size = msa.outer_product_chunk_size
        self.norm = LayerNorm(msa.hidden_size)
        self.input_proj = nn.Linear(msa.hidden_size, 2 * msa.outer_hidden_size, bias=False)
        self.output_proj = nn.Linear(msa.outer_hidden_size**2, config.pairwise_hidden_size, bias=True)

    def __call__(self, msa_states: mx.array, msa_mask: mx.array) -> mx.array:
        """``msa_states`` (B, L, M, c), ``msa_mask`` (B, L, M) -> a pair update (B, L, L, pairwise)."""
        normed = self.norm(msa_states)
        projected = self.input_proj(normed) * msa_mask[..., None].astype(normed.dtype)
        left, right = mx.split(projected, 2, axis=-1)
        mask = msa_mask.astype(left.dtype)
        valid = mx.maximum((mask @ mask.swapaxes(-1, -2))[..., None], 1.0)
        b, n, m, c = left.shape
        right_flat = right.transpose(0, 2, 1, 3).reshape(b, m, n * c)  # (B, M, L*c)
        step = self.chunk_size or n
        parts = []
        for start in range(0, n, step):
            window = left[:, start : start + step]  # (B, l, M, c)
            rows = window.shape[1]
            outer = window.swapaxes(2, 3).reshape(b, rows * c, m) @ right_flat  # (B, l*c, L*c)
            outer = outer.reshape(b, rows, c, n, c).transpose(0, 1, 3, 2, 4).reshape(b, rows, n, c * c)
            parts.append(self.output_proj(outer) / valid[:, start : start + step])
        return mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


class MSAPairWeightedAveraging(nn.Module):
    def __init__(self, config: FoldConfig):
        super().__init__()
        msa = config.msa_encoder
        self.num_attention_heads, self.head_dim = msa.num_attention_heads, msa.head_dim
        inner = msa.num_attention_heads * msa.head_dim
        self.norm_single = LayerNorm(msa.hidden_size)
        self.bias_norm = LayerNorm(config.pairwise_hidden_size)
        self.bias_proj = nn.Linear(config.pairwise_hidden_size, msa.num_attention_heads, bias=False)
        self.v_proj = nn.Linear(msa.hidden_size, inner, bias=False)
        self.gate_proj = nn.Linear(msa.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, msa.hidden_size, bias=False)

    def __call__(self, msa_states: mx.array, pair_states: mx.array, pair_mask: mx.array) -> mx.array:
        b, n, m, _ = msa_states.shape
        h, d = self.num_attention_heads, self.head_dim
        normed = self.norm_single(msa_states)
        bias = self.bias_proj(self.bias_norm(pair_states))  # (B, L, L, H)
        bias = mx.where(pair_mask[..., None], bias, mx.finfo(bias.dtype).min)
        weights = mx.softmax(bias.astype(mx.float32), axis=-2).astype(bias.dtype)  # over the attended j
        values = self.v_proj(normed).reshape(b, n, m, h, d)
        gate = mx.sigmoid(self.gate_proj(normed)).reshape(b, n, m, h, d)
        # sum_j w[b,i,j,h] v[b,j,m,h,d]: per head, (B, H, L, L) @ (B, H, L, M*d)
        v = values.transpose(0, 3, 1, 2, 4).reshape(b, h, n, m * d)
        out = (weights.transpose(0, 3, 1, 2) @ v).reshape(b, h, n, m, d).transpose(0, 2, 3, 1, 4)
        return self.o_proj((gate * out).reshape(b, n, m, h * d))


class MSAEncoderLayer(PairUpdateLayer):
    """Outer-product mean into the pair, pair-weighted averaging into the MSA, then the pair
    update; the last layer updates the pair only (the checkpoints hold no MSA weights for it)."""

    def __init__(self, config: FoldConfig, updates_msa: bool = True):
        super().__init__(config)
        self.updates_msa = updates_msa
        self.outer_product_mean = OuterProductMean(config)
        if updates_msa:
            self.msa_pair_weighted_averaging = MSAPairWeightedAveraging(config)
            self.msa_transition = Transition(
                config.msa_encoder.hidden_size, config.msa_encoder.intermediate_size, config.chunk_size
            )

    def __call__(self, msa_states, pair_states, msa_mask, pair_mask):
        pair_states = pair_states + self.outer_product_mean(msa_states, msa_mask)
        if self.updates_msa:
            msa_states = msa_states + self.msa_pair_weighted_averaging(msa_states, pair_states, pair_mask)
            msa_states = self.msa_transition(msa_states)
        return msa_states, super().__call__(pair_states, pair_mask.astype(pair_states.dtype))


class MSAEncoder(nn.Module):
    def __init__(self, config: FoldConfig):
        super().__init__()
        msa = config.msa_encoder
        self.embed = nn.Linear(config.num_res_types + 2, msa.hidden_size, bias=False)
        self.project_inputs = nn.Linear(config.single_inputs_size, msa.hidden_size, bias=False)
        self.layers = [
            MSAEncoderLayer(config, updates_msa=i != msa.num_hidden_layers - 1) for i in range(msa.num_hidden_layers)
        ]

    def __call__(self, pair_states, single_inputs, msa_one_hot, has_deletion, deletion_value, msa_mask):
        """Inputs in the reference's transposed layout: ``msa_one_hot`` (B, L, M, res types), the
        deletion features and ``msa_mask`` (B, L, M)."""
        features = mx.concatenate([msa_one_hot, has_deletion[..., None], deletion_value[..., None]], axis=-1)
        msa_states = (
            self.embed(features.astype(self.embed.weight.dtype)) + self.project_inputs(single_inputs)[:, :, None]
        )
        token_mask = msa_mask[:, :, 0].astype(mx.bool_)
        pair_mask = token_mask[:, :, None] & token_mask[:, None, :]
        for layer in self.layers:
            msa_states, pair_states = layer(msa_states, pair_states, msa_mask, pair_mask)
        return pair_states
