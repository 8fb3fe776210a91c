"""The ESMFold2 folding trunk: the pair-update stacks, the language-model pair encoder, the parcae
recurrence over recycling loops and the distogram (transformers' ``modeling_esmfold2`` twins).

Attribute names are transformers' own, so checkpoint names need no mapping. A trunk's random
numbers (the initial pair state, each loop's language-model dropout) come from a ``Draws`` object,
in the order the reference draws them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ...fold_config import FoldConfig
from ..execution import InFlight
from .draws import Draws
from .layers import LayerNorm, Transition, join_chunks, piecewise


def pair_mask_of(attention_mask: mx.array) -> mx.array:
    """``[B, L]`` token mask -> the float32 ``[B, L, L]`` pair mask the trunk and its stacks take."""
    m = attention_mask.astype(mx.float32)
    return m[:, :, None] * m[:, None, :]


class SingleToPair(nn.Module):
    """downproject -> [outer product, outer difference] -> two-layer GELU MLP, at ``pairwise_hidden_size``."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        d = config.pairwise_hidden_size
        self.downproject = nn.Linear(d, d)
        self.output_fc1 = nn.Linear(2 * d, d)
        self.output_fc2 = nn.Linear(d, d)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.downproject(x)
        pairs = mx.concatenate([x[:, :, None] * x[:, None, :], x[:, :, None] - x[:, None, :]], axis=-1)
        return self.output_fc2(nn.gelu(self.output_fc1(pairs)))


class LanguageModelEncoder(nn.Module):
    """ESMC hidden states ``[B, L, n_layers + 1, d_lm]`` -> pair states ``[B, L, L, pairwise]``: a softmax
    mix over the layers (``layer_weights``) of their normed projections, then ``single_to_pair``."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        lm = config.esmc_config
        self.single_to_pair = SingleToPair(config)
        self.pair_output_norm = LayerNorm(config.pairwise_hidden_size)
        self.pair_input_norm = LayerNorm(lm.hidden_size)
        self.pair_proj = nn.Linear(lm.hidden_size, config.pairwise_hidden_size, bias=False)
        self.layer_weights = mx.zeros((lm.num_hidden_layers + 1,))

    def __call__(self, hidden_states: mx.array) -> mx.array:
        # The compute dtype (the reference casts to pair_proj's weight dtype; layer_weights shares it
        # and stays a plain array when pair_proj is quantized).
        hidden_states = hidden_states.astype(self.layer_weights.dtype)
        projected = self.pair_proj(self.pair_input_norm(hidden_states))  # [B, L, n + 1, pairwise]
        weights = mx.softmax(self.layer_weights, axis=0, precise=True)
        mixed = (weights[None, :] @ projected).squeeze(-2)  # [B, L, pairwise]
        return self.pair_output_norm(self.single_to_pair(mixed))


class TriangleMultiplicativeUpdate(nn.Module):
    """Gated triangle multiplicative update, outgoing (``sum_k a[i,k] b[j,k]``) or incoming
    (``sum_k a[k,i] b[k,j]``). The O(L^3) contraction runs ``chunk_size`` output rows at a time, as
    the reference's does; the projections around it run ``chunk_size`` pair rows at a time. Each
    chunk is evaluated before the next where the pair is ``piecewise``."""

    def __init__(self, config: FoldConfig, outgoing: bool = True):
        super().__init__()
        self.dim = d = config.pairwise_hidden_size
        self.flow = "outgoing" if outgoing else "incoming"
        self.norm_start = LayerNorm(d)
        self.norm_mix = LayerNorm(d)
        self.proj_bundle = nn.Linear(d, 4 * d, bias=False)
        self.proj_emit = nn.Linear(d, d, bias=False)
        self.proj_gate = nn.Linear(d, d, bias=False)
        self.chunk_size = config.chunk_size

    def _layout(self, stream: mx.array) -> mx.array:
        """``[B, L, L, d]`` -> ``[B, d, i, k]`` (the left stream) or ``[B, d, j, k]`` (the right one):
        either flow's contraction is then one batched matmul over channels, ``left @ right^T``."""
        return stream.transpose((0, 3, 1, 2) if self.flow == "outgoing" else (0, 3, 2, 1))

    def _triangular_contract(self, left_t: mx.array, right_t: mx.array, rows: slice) -> mx.array:
        """Output rows ``rows`` of the contraction, ``[B, rows, L, d]``, from the ``_layout`` streams."""
        return (left_t[:, :, rows] @ right_t.swapaxes(-1, -2)).transpose(0, 2, 3, 1)

    def __call__(self, pair: mx.array, visibility: mx.array | None = None) -> mx.array:
        n, d = pair.shape[1], self.dim
        step = self.chunk_size or n
        evaluate = piecewise(pair)

        def streams(rows: slice) -> mx.array:
            """The gated left and right streams of pair rows ``rows``, in ``_layout`` ([B, 2 d, ...])."""
            signal, gate_logits = mx.split(self.proj_bundle(self.norm_start(pair[:, rows])), 2, axis=-1)
            routed = signal * mx.sigmoid(gate_logits)
            if visibility is not None:
                # cast to the compute dtype, so masking does not promote the contraction to float32
                routed = routed * visibility[:, rows, :, None].astype(routed.dtype)
            return self._layout(routed)

        def emitted(rows: slice) -> mx.array:
            mixed = self.proj_emit(self.norm_mix(self._triangular_contract(left_t, right_t, rows)))
            return mixed * mx.sigmoid(self.proj_gate(self.norm_start(pair[:, rows])))

        # The streams are built a chunk of pair rows at a time straight into the contraction's
        # layout: the 4 d-wide bundle and the masked copies never exist whole (their L^2 x 4 d
        # float32 is 4 GiB at 1,024 residues of width 256).
        axis = 2 if self.flow == "outgoing" else 3  # where the pair's row axis lands in _layout
        both = join_chunks(streams, n, step, axis, evaluate)
        if step >= n:
            both = mx.contiguous(both)
        left_t, right_t = both[:, :d], both[:, d:]
        return join_chunks(emitted, n, step, 1, evaluate)


class PairUpdateLayer(nn.Module):
    """tri_mul_out, tri_mul_in (residual), then the chunked pair transition."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        self.tri_mul_out = TriangleMultiplicativeUpdate(config, outgoing=True)
        self.tri_mul_in = TriangleMultiplicativeUpdate(config, outgoing=False)
        self.pair_transition = Transition(
            config.pairwise_hidden_size, config.pair_transition_intermediate_size, config.chunk_size
        )

    def __call__(self, pair: mx.array, pair_attention_mask: mx.array | None = None) -> mx.array:
        pair = pair + self.tri_mul_out(pair, visibility=pair_attention_mask)
        pair = pair + self.tri_mul_in(pair, visibility=pair_attention_mask)
        return self.pair_transition(pair)


class PairUpdateStack(nn.Module):
    """``num_layers`` PairUpdateLayers; returns the refined pair states (not a delta)."""

    def __init__(self, config: FoldConfig, num_layers: int):
        super().__init__()
        self.layers = [PairUpdateLayer(config) for _ in range(num_layers)]

    def __call__(self, pair: mx.array, pair_attention_mask: mx.array | None = None) -> mx.array:
        in_flight = InFlight()  # one lazy graph a loop held 11.4 GB above the weights at 256 residues (H100)
        for layer in self.layers:
            pair = layer(pair, pair_attention_mask=pair_attention_mask)
            in_flight(pair)
        return pair


class Parcae(nn.Module):
    """The trunk's diagonal linear recurrence whose time axis is the recycling loop: each loop decays
    the state per channel and injects the normed pair input through a discretized input matrix."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        d = config.pairwise_hidden_size
        self.input_norm = LayerNorm(d)
        # the reference's initial values (a per-step decay of 1/sqrt(5)); a checkpoint replaces them
        self.log_state_decay = mx.zeros((d,))
        delta0 = -math.log(math.sqrt(1.0 / 5.0))
        self.log_delta = mx.full((d,), delta0 + math.log(-math.expm1(-delta0)))
        self.input_matrix_continuous = mx.eye(d)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.output_stack = PairUpdateStack(config, config.parcae_num_coda_layers)

    def discretize(self) -> tuple[mx.array, mx.array]:
        """``(state_decay [d], input_matrix [d, d])``: loop-invariant, computed once per fold."""
        delta = nn.softplus(self.log_delta)
        state_decay = mx.exp(-delta * mx.exp(self.log_state_decay))
        return state_decay, delta[:, None] * self.input_matrix_continuous

    def __call__(
        self, state: mx.array, injected_pair_states: mx.array, state_decay: mx.array, input_matrix: mx.array
    ) -> mx.array:
        """One step: ``state_decay * state + input_norm(injected) @ input_matrix^T``."""
        return state_decay * state + self.input_norm(injected_pair_states) @ input_matrix.T

    def decode_state(self, state: mx.array, pair_attention_mask: mx.array | None = None) -> mx.array:
        """The final state projected by ``out_proj`` and refined by ``output_stack``."""
        return self.output_stack(self.out_proj(state), pair_attention_mask=pair_attention_mask)


class TrunkOutput(NamedTuple):
    pair_states: mx.array  # [B, L, L, pairwise], float32
    distogram_logits: mx.array  # [B, L, L, num_distogram_bins], distogram_head's dtype (float32)


def run_trunk_loops(
    config: FoldConfig,
    initial_pair_states: mx.array,
    lm_pair_states: mx.array | None,
    pair_mask: mx.array,
    *,
    folding_trunk: PairUpdateStack,
    lm_encoder: PairUpdateStack,
    parcae: Parcae,
    distogram_head: nn.Linear,
    draws: Draws,
    num_loops: int | None = None,
    inject: Callable[[mx.array], mx.array] | None = None,
) -> TrunkOutput:
    """The trunk of ``EsmFold2Model.forward`` after the input embedder and the language-model encoder:
    the truncated-normal initial state, ``max(1, num_loops + 1)`` parcae steps each followed by the
    folding trunk (the language-model pair states, dropped out afresh every loop, refined by
    ``lm_encoder`` and added to ``initial_pair_states``), the decode, and the symmetrised distogram.

    ``initial_pair_states`` and ``lm_pair_states`` are ``[B, L, L, pairwise]`` in the compute dtype,
    ``pair_mask`` the float32 ``[B, L, L]`` of ``pair_mask_of``. Without MSA input, as the reference
    runs when no MSA is given. Draws: one ``truncated_normal``, then one ``keep`` per loop when the
    config's per-loop dropout is on and language-model states are given. ``inject``: what turns
    ``initial_pair_states`` into each loop's input (the MSA encoder, where the model has one).
    """
    num_loops = config.num_loops if num_loops is None else num_loops
    dtype = initial_pair_states.dtype
    width = initial_pair_states.shape[-1]
    # "SmallInit" scaling of the reference's _init_pair_state: Var = 2 / (5 * width)
    std = math.sqrt(2.0 / (5.0 * width))
    pair_states = draws.truncated_normal(tuple(initial_pair_states.shape), std).astype(dtype)

    state_decay, input_matrix = parcae.discretize()
    state_decay, input_matrix = state_decay.astype(dtype), input_matrix.astype(dtype)

    p = config.lm_encoder.lm_dropout
    per_loop_dropout = lm_pair_states is not None and config.lm_encoder.per_loop_lm_dropout and p > 0.0
    refined_lm = None
    if lm_pair_states is not None and not per_loop_dropout:
        # the same input every loop: the reference refines it again each loop; once gives the same numbers
        refined_lm = lm_encoder(lm_pair_states, pair_attention_mask=pair_mask)

    for _ in range(max(1, num_loops + 1)):
        lm = refined_lm
        if per_loop_dropout:
            keep = draws.keep(tuple(lm_pair_states.shape), p).astype(lm_pair_states.dtype)
            lm = lm_encoder(lm_pair_states * keep / (1.0 - p), pair_attention_mask=pair_mask)
            del keep
        injected = initial_pair_states if inject is None else inject(initial_pair_states)
        injected = injected if lm is None else injected + lm
        pair_states = parcae(pair_states, injected, state_decay, input_matrix)
        del lm, injected  # not held (two pair sizes) while the folding trunk runs
        pair_states = folding_trunk(pair_states, pair_attention_mask=pair_mask)
        # one loop's graph at a time: its L^2-sized temporaries are freed before the next loop
        mx.eval(pair_states)

    pair_states = parcae.decode_state(pair_states, pair_attention_mask=pair_mask).astype(mx.float32)
    symmetric = pair_states + pair_states.transpose(0, 2, 1, 3)
    return TrunkOutput(pair_states, distogram_head(symmetric.astype(distogram_head.weight.dtype)))
