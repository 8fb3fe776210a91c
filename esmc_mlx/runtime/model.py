"""ESMC in MLX: pre-LN transformer with QK-LayerNorm, RoPE, SwiGLU and an MLM head.

Module and parameter names mirror transformers' ``EsmcForMaskedLM`` (``esmc.layers.0.self_attn.
q_proj.weight`` ...), so an artifact's tensor names read the same in both worlds. The numerics
follow ``modeling_esmc.py``; see docs/numerics.md for each choice. The steps a backend may run
fused are ``Ops``'s; load() hands a CUDA GPU's model cuda/fusions.py's instead. Compiling,
chunking and the fused q/k/v layout are in execution.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import TRAINED_LENGTH, TRAINED_TOKENS, ESMCConfig
from ..errors import EsmcMlxWarning, ScoringError
from .execution import Execution, InFlight, check_inputs


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
        return sequence_id[:, None, :, None] == sequence_id[:, None, None, :]
    if attention_mask is not None:
        return attention_mask.astype(mx.bool_)[:, None, None, :]
    return None


def additive_mask(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """A boolean keep-mask as an additive bias (0 / dtype's lowest), same shape: MLX's CUDA
    attention expands a boolean mask to the full (B, H, L, L) first (1 GB more at L=4096)."""
    return mx.where(mask, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))


class Ops:
    """The steps of a block a backend may run fused, as MLX's plain ops."""

    def heads(self, attn: Attention, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as (B, H, L, head_dim) from the block's normed input: projections, QK
        LayerNorm over the whole width, RoPE."""
        q, k, v = attn.qkv(x)
        return (
            attn.rope(attn.split_heads(attn.q_norm(q))),
            attn.rope(attn.split_heads(attn.k_norm(k))),
            attn.split_heads(v),
        )

    def add_norm(self, x: mx.array, linear: nn.Module, h: mx.array, scale: float, norm: nn.Module | None):
        """ESMC's scaled residual add ``x + linear(h) / scale`` and ``norm`` of it (None without one)."""
        x = x + linear(h) / scale
        return x, None if norm is None else norm(x)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None) -> mx.array:
        """softmax(q k^T * scale + mask) v for (B, H, L, head_dim) heads."""
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def block(self, layer: Layer, x: mx.array):
        """A scope around a block's work for normed input ``x``."""
        return contextlib.nullcontext()


PLAIN = Ops()


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

    def split_heads(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def rope(self, x: mx.array) -> mx.array:
        # Non-interleaved (half split), absolute positions from 0; MLX computes the angles in fp32.
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=0)

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "qkv_proj" in self:  # the fused layout (execution.fuse): one GEMM instead of three
            return tuple(mx.split(self.qkv_proj(x), 3, axis=-1))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(self, x: mx.array, mask: mx.array | None, return_weights: bool = False):
        out, weights = self.attend(x, mask, return_weights)
        return self.o_proj(out), weights

    def attend(self, x: mx.array, mask: mx.array | None, return_weights: bool = False, ops: Ops = PLAIN):
        """The heads' attention output (B, L, d) before o_proj, and the weights (or None)."""
        B, L, _ = x.shape
        q, k, v = (PLAIN if return_weights else ops).heads(self, x)
        if mask is not None and mask.dtype == mx.bool_:
            mask = additive_mask(mask, q.dtype)
        weights = None
        if return_weights:
            scores = (q * self.scale) @ k.transpose(0, 1, 3, 2)
            if mask is not None:
                scores = scores + mask
            weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
            out = weights @ v
        else:
            out = ops.attention(q, k, v, self.scale, mask)
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1), weights


class MLP(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.gated(x))

    def gated(self, x: mx.array) -> mx.array:
        """SwiGLU's product, the input of down_proj."""
        if "gate_up_proj" in self:  # the fused layout (execution.fuse)
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return nn.silu(gate) * up


class Layer(nn.Module):
    def __init__(self, config: ESMCConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.residual_scale = config.residual_scale

    def __call__(self, x: mx.array, mask: mx.array | None, return_weights: bool = False):
        x, _, weights = self.step(x, self.input_layernorm(x), mask, None, return_weights)
        return x, weights

    def step(self, x, normed, mask, next_norm=None, return_weights: bool = False, ops: Ops = PLAIN):
        """The block on the residual stream ``x`` given ``normed = input_layernorm(x)``: the new
        stream, ``next_norm`` of it (the next block's input LayerNorm or the final one; None
        without one) and the attention weights. Residual adds are ``x + h / residual_scale``."""
        attn, mlp, scale = self.self_attn, self.mlp, self.residual_scale
        with ops.block(self, normed):
            out, weights = attn.attend(normed, mask, return_weights, ops)
            x, y = ops.add_norm(x, attn.o_proj, out, scale, self.post_attention_layernorm)
            x, normed = ops.add_norm(x, mlp.down_proj, mlp.gated(y), scale, next_norm)
        return x, normed, weights


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


class ESMC(Execution, nn.Module):
    """ESMC masked language model. Call it with token ids from ``ESMCTokenizer``."""

    def __init__(self, config: ESMCConfig, lm_head: bool = True):
        super().__init__()
        self.config = config
        self.esmc = Encoder(config)
        if lm_head:  # ESMFold2's backbone has none: it reads hidden states only
            self.lm_head = MaskedLMHead(config)
        object.__setattr__(self, "ops", PLAIN)  # not a module: the fused steps' implementation
        self.init_execution()

    def use_ops(self, ops: Ops) -> ESMC:
        """Run the fusible steps with ``ops`` (load() picks cuda/fusions.py's on a CUDA GPU)."""
        object.__setattr__(self, "ops", ops)
        self.reset_compiled()
        return self

    @property
    def dtype(self) -> mx.Dtype:
        return self.esmc.norm.weight.dtype

    def next_norms(self) -> list[nn.LayerNorm]:
        """The LayerNorm after each block: the next block's input norm, then the final norm."""
        layers = self.esmc.layers
        return [layer.input_layernorm for layer in layers[1:]] + [self.esmc.norm]

    def forward(
        self, input_ids, mask, output_hidden_states=False, output_attentions=False, chunk=None, blocks=None, upto=None
    ):
        """The forward as one lazy graph, or (``chunk``) evaluated every ``chunk`` blocks.
        ``blocks``: per-block callables (x, normed, mask) -> (x, normed) in place of the blocks.
        ``upto``: stop after that many blocks (no logits unless every block ran);
        ``output_hidden_states`` a set: only those hidden states kept (the others None)."""
        x = self.esmc.embed_tokens(input_ids)
        keep = output_hidden_states if isinstance(output_hidden_states, set) else None  # only these are kept
        hidden = [x if keep is None or 0 in keep else None] if output_hidden_states else None
        weights = [] if output_attentions else None
        layers = self.esmc.layers[:upto]
        normed = layers[0].input_layernorm(x) if layers else self.esmc.norm(x)
        in_flight = InFlight()  # at most two chunks' work in flight
        for i, (layer, next_norm) in enumerate(zip(layers, self.next_norms(), strict=False)):
            if blocks is not None:
                (x, normed), w = blocks[i](x, normed, mask), None
            else:
                x, normed, w = layer.step(x, normed, mask, next_norm, output_attentions, self.ops)
            if hidden is not None:
                hidden.append(x if keep is None or i + 1 in keep else None)
            if weights is not None:
                weights.append(w)
            if chunk is not None and (i + 1) % chunk == 0:
                try:
                    in_flight(x, normed)
                except ValueError:  # under mx.grad / vmap: no evaluation, every intermediate kept anyway
                    chunk = None
        complete = len(layers) == len(self.esmc.layers)
        if hidden is not None and complete:
            hidden[-1] = normed
        return ESMCOutput(
            logits=self.lm_head(normed) if complete and "lm_head" in self else None,
            last_hidden_state=normed if complete else x,
            hidden_states=tuple(hidden) if hidden is not None else None,
            attentions=tuple(weights) if weights is not None else None,
        )

    def _warn_long(self, residues: int) -> None:
        """Before the first pass over an input longer than ESMC's training crop: say so, and what
        the quadratic attention will cost."""
        message = (
            f"an input of {residues:,} residues is longer than the {TRAINED_LENGTH:,} residues ({TRAINED_TOKENS:,} "
            "tokens) ESMC was trained on; its outputs are extrapolation"
        )
        if residues + 2 > 4 * TRAINED_TOKENS:
            scores = self.config.num_attention_heads * (residues + 2) ** 2 * 4  # fp32 scores, one layer, one row
            message += (
                f". Attention grows with the square of the length: expect this to be slow and to need "
                f"about {scores / 2**30:,.1f} GB per sequence for attention alone"
            )
        warnings.warn(message, EsmcMlxWarning, stacklevel=3)

    def inputs(self, input_ids, attention_mask=None, sequence_id=None) -> tuple[mx.array, mx.array | None]:
        """(B, L) ids and the additive mask they attend with, checked (SequenceError) and warned
        about past ESMC's training length."""
        input_ids = mx.array(input_ids)
        if input_ids.ndim == 1:  # one unbatched sequence: its mask and chain ids too
            input_ids = input_ids[None]
            attention_mask = None if attention_mask is None else mx.array(attention_mask).reshape(1, -1)
            sequence_id = None if sequence_id is None else mx.array(sequence_id).reshape(1, -1)
        check_inputs(input_ids, attention_mask, sequence_id, self.config.vocab_size)
        if input_ids.shape[-1] - 2 > TRAINED_LENGTH:
            # the longest real row (batches may be padded wider than their longest sequence)
            tokens = input_ids.shape[-1] if attention_mask is None else int(np.asarray(attention_mask).sum(-1).max())
            if tokens - 2 > TRAINED_LENGTH:
                self._warn_long(tokens - 2)
        if sequence_id is None and attention_mask is not None and bool(np.all(np.asarray(attention_mask))):
            attention_mask = None  # no mask at all lets the fused attention kernels run
        mask = attention_mask_for(
            None if attention_mask is None else mx.array(attention_mask),
            None if sequence_id is None else mx.array(sequence_id),
        )
        if mask is not None:
            mask = additive_mask(mask, self.dtype)  # once, not per layer
        return input_ids, mask

    def hidden_states_at(self, input_ids, layers, attention_mask=None, sequence_id=None) -> dict[int, mx.array]:
        """``{N: hidden_states[N]}`` for each N of ``layers`` (0: the embeddings, i: after block i,
        n_layers: after the final norm), as the full forward gives them, running the blocks only
        up to the deepest asked for. Raises ScoringError for an N outside 0..n_layers."""
        n = self.config.num_hidden_layers
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, int | np.integer) or not 0 <= i <= n:
                raise ScoringError(f"hidden state {i!r}: this model has hidden states 0..{n}")
        input_ids, mask = self.inputs(input_ids, attention_mask, sequence_id)
        wanted = {int(i) for i in layers}
        out = self.forward(input_ids, mask, wanted, chunk=self.chunk_for(input_ids), upto=max(wanted, default=0))
        return {int(i): out.hidden_states[i] for i in layers}

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
        ignored). Positions are absolute from 0 across chains. ``output_attentions``: each
        block's attention weights (B, H, L, L). Raises SequenceError for ids that are not
        integers in the vocabulary, an empty batch, a mask of another shape.
        """
        input_ids, mask = self.inputs(input_ids, attention_mask, sequence_id)
        if not output_hidden_states and not output_attentions and self.use_compiled(input_ids, mask):
            logits, x = self.compiled_forward(input_ids, mask)
            return ESMCOutput(logits=logits, last_hidden_state=x)
        return self.forward(input_ids, mask, output_hidden_states, output_attentions, self.chunk_for(input_ids))
