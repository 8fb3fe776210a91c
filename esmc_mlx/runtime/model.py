"""ESMC in MLX: pre-LN transformer with QK-LayerNorm, RoPE, SwiGLU and an MLM head.

Module and parameter names mirror transformers' ``EsmcForMaskedLM`` (``esmc.layers.0.self_attn.
q_proj.weight`` ...), so an artifact's tensor names read the same in both worlds. The numerics
follow ``modeling_esmc.py``; see docs/numerics.md for each choice.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..config import ESMCConfig


@dataclasses.dataclass
class ESMCOutput:
    logits: mx.array  # (B, L, vocab_size)
    last_hidden_state: mx.array  # (B, L, d), after the final LayerNorm
    # embeddings, then each block's output; the last entry is last_hidden_state (as transformers)
    hidden_states: tuple[mx.array, ...] | None = None
    attentions: tuple[mx.array, ...] | None = None  # each (B, H, L, L)


def attention_mask_for(attention_mask: mx.array | None, sequence_id: mx.array | None) -> mx.array | None:
    """Boolean mask broadcastable to (B, H, L, L); True where a query may attend to a key.

    ``sequence_id`` (chain ids, -1 on padding) wins over ``attention_mask``, as in transformers:
    tokens attend only within their own chain. ``attention_mask`` masks padded keys only.
    """
    if sequence_id is not None:
        return (sequence_id[:, None, :, None] == sequence_id[:, None, None, :])
    if attention_mask is not None:
        return attention_mask.astype(mx.bool_)[:, None, None, :]
    return None


class Attention(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        # QK LayerNorm spans the whole hidden width (all heads at once), without bias.
        self.q_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, bias=False)

    def _heads(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def _rope(self, x: mx.array) -> mx.array:
        # Non-interleaved (half split) rotation, absolute positions from 0; MLX computes the
        # angles in fp32 whatever x's dtype.
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=0)

    def __call__(self, x: mx.array, mask: mx.array | None, return_weights: bool = False):
        B, L, _ = x.shape
        q = self._rope(self._heads(self.q_norm(self.q_proj(x))))
        k = self._rope(self._heads(self.k_norm(self.k_proj(x))))
        v = self._heads(self.v_proj(x))
        weights = None
        if return_weights:
            scores = (q * self.scale) @ k.transpose(0, 1, 3, 2)
            if mask is not None:
                scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
            weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
            out = weights @ v
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out), weights


class MLP(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.residual_scale = config.residual_scale

    def __call__(self, x: mx.array, mask: mx.array | None, return_weights: bool = False):
        attn, weights = self.self_attn(self.input_layernorm(x), mask, return_weights)
        x = x + attn / self.residual_scale
        x = x + self.mlp(self.post_attention_layernorm(x)) / self.residual_scale
        return x, weights


class Encoder(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=False)


class MaskedLMHead(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        d = config.hidden_size
        self.dense = nn.Linear(d, d)
        self.layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(d, config.vocab_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.decoder(self.layer_norm(nn.gelu(self.dense(x))))  # nn.gelu is the erf form


class ESMC(nn.Module):
    """ESMC masked language model. Call it with token ids from ``ESMCTokenizer``."""

    def __init__(self, config: ESMCConfig):
        super().__init__()
        self.config = config
        self.esmc = Encoder(config)
        self.lm_head = MaskedLMHead(config)

    @property
    def dtype(self) -> mx.Dtype:
        return self.esmc.norm.weight.dtype

    # The jobs users run; implemented in scoring.py, exposed here as the Python API.
    def embed(self, sequences, **kwargs):
        """Mean-pooled (and optionally per-residue) embeddings; see ``scoring.embed``."""
        from .scoring import embed

        return embed(self, sequences, **kwargs)

    def score_mutations(self, sequence, mutations, **kwargs):
        """Masked-marginal / wild-type-marginal variant scores; see ``scoring.score_mutations``."""
        from .scoring import score_mutations

        return score_mutations(self, sequence, mutations, **kwargs)

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array | None = None,
        sequence_id: mx.array | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> ESMCOutput:
        """Logits and hidden states for (B, L) token ids, right padded.

        ``attention_mask`` (B, L): 1 for tokens, 0 for padding. ``sequence_id`` (B, L): chain
        ids, -1 for padding; tokens attend only within their chain (``attention_mask`` is then
        ignored). Positions are absolute from 0 across chains.
        """
        input_ids = mx.array(input_ids)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        mask = attention_mask_for(
            None if attention_mask is None else mx.array(attention_mask),
            None if sequence_id is None else mx.array(sequence_id),
        )
        x = self.esmc.embed_tokens(input_ids)
        hidden = [x] if output_hidden_states else None
        weights = [] if output_attentions else None
        for layer in self.esmc.layers:
            x, w = layer(x, mask, output_attentions)
            if hidden is not None:
                hidden.append(x)
            if weights is not None:
                weights.append(w)
        x = self.esmc.norm(x)
        if hidden is not None:
            hidden[-1] = x
        return ESMCOutput(
            logits=self.lm_head(x),
            last_hidden_state=x,
            hidden_states=tuple(hidden) if hidden is not None else None,
            attentions=tuple(weights) if weights is not None else None,
        )
