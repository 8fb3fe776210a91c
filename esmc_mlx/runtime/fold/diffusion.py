"""The ESMFold2 denoiser: noise conditioning, the pair-biased token transformer and the diffusion module
around the atom encoder/decoder (transformers' ``EsmFold2DiffusionModule`` and its parts).

Everything that does not depend on the noise level is built once per fold by
``DiffusionModule.prepare_conditioning``; a denoising step is ``DiffusionModule.__call__``.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ...fold_config import DiffusionModuleConfig, FoldConfig
from .atoms import AtomDecoder, AtomEncoder, AtomInputs
from .layers import AdaptiveLayerNorm, FourierEmbedding, LayerNorm, SwiGLU, Transition, piecewise


@dataclasses.dataclass
class DenoiserConditioning:
    """What every denoising step reuses, masks folded in (transformers' ``EsmFold2DenoiserConditioning``).

    With S diffusion samples of a batch of B: ``atom_embeds`` (B*S, A, atom_hidden), the RoPE
    ``position_embeddings`` (cos, sin) (B*S, A, head_dim), ``atom_mask`` and ``atom_to_token`` (B*S, A),
    ``projected_single_inputs`` (B*S, L, hidden). The two masks stay at batch 1 when B is 1 (they only
    broadcast): ``attention_mask`` the additive (B or B*S, 1, A, A) atom window, ``token_attention_bias``
    one additive (B or B*S, heads, L, L) bias per token-transformer layer.
    """

    atom_embeds: mx.array
    attention_mask: mx.array
    position_embeddings: tuple[mx.array, mx.array]
    atom_mask: mx.array
    atom_to_token: mx.array
    projected_single_inputs: mx.array
    token_attention_bias: list[mx.array]


class DiffusionAttention(nn.Module):
    """Gated multi-head self-attention over tokens with a ready-made additive pair bias."""

    def __init__(self, config: FoldConfig, diffusion_config: DiffusionModuleConfig):
        super().__init__()
        hidden = diffusion_config.hidden_size
        self.head_dim = diffusion_config.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, hidden, bias=True)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def __call__(self, hidden_states: mx.array, attention_bias: mx.array) -> mx.array:
        batch, length, _ = hidden_states.shape

        def heads(x: mx.array) -> mx.array:
            return x.reshape(batch, length, -1, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = (heads(proj(hidden_states)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scaling, mask=attention_bias)
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return self.o_proj(out * mx.sigmoid(self.gate_proj(hidden_states)))


class DiffusionLayer(nn.Module):
    """adaLN-conditioned pair-bias attention and SwiGLU, each residual gated on the single stream."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        diffusion_config = config.structure_head.diffusion_module
        hidden = diffusion_config.hidden_size
        self.input_layernorm = AdaptiveLayerNorm(hidden)
        self.self_attn = DiffusionAttention(config, diffusion_config)
        self.attn_gate = nn.Linear(hidden, hidden, bias=True)
        self.post_attention_layernorm = AdaptiveLayerNorm(hidden)
        self.mlp = SwiGLU(hidden, diffusion_config.intermediate_size)
        self.mlp_gate = nn.Linear(hidden, hidden, bias=True)
        self.pair_norm = LayerNorm(config.pairwise_hidden_size)
        self.pair_bias_proj = nn.Linear(config.pairwise_hidden_size, diffusion_config.num_attention_heads, bias=False)

    def compute_pair_bias(self, pair_states: mx.array, attention_mask: mx.array | None = None) -> mx.array:
        """This layer's additive bias (B, heads, L, L): the per-head projection of the normed pair
        states, padded keys (``attention_mask`` (B, L) False) given the bias dtype's lowest value."""
        bias = self.pair_bias_proj(self.pair_norm(pair_states)).transpose(0, 3, 1, 2)
        if attention_mask is not None:
            dtype = bias.dtype
            padding = mx.where(
                attention_mask.astype(mx.bool_)[:, None, None, :],
                mx.array(0, dtype),
                mx.array(mx.finfo(dtype).min, dtype),
            )
            bias = bias + padding
        return bias

    def __call__(self, hidden_states: mx.array, single_states: mx.array, attention_bias: mx.array) -> mx.array:
        attn_output = self.self_attn(self.input_layernorm(hidden_states, single_states), attention_bias)
        hidden_states = hidden_states + mx.sigmoid(self.attn_gate(single_states)) * attn_output
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states, single_states))
        return hidden_states + mx.sigmoid(self.mlp_gate(single_states)) * mlp_output


class DiffusionTransformer(nn.Module):
    """The token transformer of the denoiser, one pair bias per layer."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        num_layers = config.structure_head.diffusion_module.num_hidden_layers
        self.layers = [DiffusionLayer(config) for _ in range(num_layers)]

    def compute_pair_biases(self, pair_states: mx.array, attention_mask: mx.array | None = None) -> list[mx.array]:
        """One bias per layer. Where ``pair_states`` is ``piecewise`` it is evaluated first and each bias
        as it is made, so that one layer's normed pair exists at a time."""
        evaluate = piecewise(pair_states)
        if evaluate:
            mx.eval(pair_states)
        biases = []
        for layer in self.layers:
            biases.append(layer.compute_pair_bias(pair_states, attention_mask))
            if evaluate:
                mx.eval(biases[-1])
        return biases

    def __call__(
        self, token_hidden_states: mx.array, single_states: mx.array, attention_biases: list[mx.array]
    ) -> mx.array:
        hidden_states = token_hidden_states
        for layer, bias in zip(self.layers, attention_biases):
            hidden_states = layer(hidden_states, single_states, bias)
        return hidden_states


class DiffusionConditioning(nn.Module):
    """Pair and single conditioning of the denoiser; only the single half depends on the noise level."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        diffusion_config = config.structure_head.diffusion_module
        pairwise, hidden = config.pairwise_hidden_size, diffusion_config.hidden_size
        self.sigma_data = diffusion_config.sigma_data
        self.pair_input_norm = LayerNorm(2 * pairwise)
        self.pair_proj = nn.Linear(2 * pairwise, pairwise, bias=False)
        self.pair_transition_0 = Transition(pairwise, diffusion_config.pair_intermediate_size, chunk_size=None)
        self.pair_transition_1 = Transition(pairwise, diffusion_config.pair_intermediate_size, chunk_size=None)
        self.single_input_norm = LayerNorm(config.single_inputs_size)
        self.single_proj = nn.Linear(config.single_inputs_size, hidden, bias=False)
        self.fourier = FourierEmbedding(diffusion_config.fourier_dim)
        self.noise_norm = LayerNorm(diffusion_config.fourier_dim)
        self.noise_proj = nn.Linear(diffusion_config.fourier_dim, hidden, bias=False)
        self.single_transition_0 = Transition(hidden, diffusion_config.intermediate_size, chunk_size=None)
        self.single_transition_1 = Transition(hidden, diffusion_config.intermediate_size, chunk_size=None)

    def compute_pair_repr(self, pair_trunk: mx.array, relative_position_encoding: mx.array) -> mx.array:
        """The noise-independent pair conditioning. ``pair_trunk`` is float32 (the trunk's output), so
        the concatenation and its norm are float32; ``pair_proj`` takes its own dtype."""
        pair = mx.concatenate([pair_trunk, relative_position_encoding], axis=-1)
        pair = self.pair_proj(self.pair_input_norm(pair).astype(self.pair_proj.weight.dtype))
        # the unchunked transitions (the reference's choice) one at a time where the pair is large
        for transition in (self.pair_transition_0, self.pair_transition_1):
            if piecewise(pair):
                mx.eval(pair)
            pair = transition(pair)
        return pair

    def compute_single_repr(self, single_inputs: mx.array) -> mx.array:
        """``single_inputs`` projected to the diffusion width; noise-independent."""
        return self.single_proj(self.single_input_norm(single_inputs))

    def __call__(self, noise_level: mx.array, single_states: mx.array) -> mx.array:
        """``single_states`` (from ``compute_single_repr``) plus the Fourier embedding of the float32
        per-sample ``noise_level`` (N,), through the two transitions."""
        log_noise = 0.25 * mx.log(mx.maximum(noise_level / self.sigma_data, 1e-20))
        noise = self.noise_norm(self.fourier(log_noise)).astype(self.noise_proj.weight.dtype)
        single_states = single_states + self.noise_proj(noise)[:, None]
        return self.single_transition_1(self.single_transition_0(single_states))


class DiffusionModule(nn.Module):
    """The denoiser: ``prepare_conditioning`` once per fold, then one ``__call__`` per sampling step."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        diffusion_config = config.structure_head.diffusion_module
        hidden = diffusion_config.hidden_size
        self.sigma_data = diffusion_config.sigma_data
        self.conditioning = DiffusionConditioning(config)
        self.coords_linear = nn.Linear(6, diffusion_config.atom_encoder.hidden_size, bias=False)
        self.atom_encoder = AtomEncoder(config, diffusion_config.atom_encoder)
        self.atom_decoder = AtomDecoder(config)
        self.single_to_token = nn.Linear(hidden, hidden, bias=False)
        self.token_transformer = DiffusionTransformer(config)
        self.single_step_norm = LayerNorm(hidden)
        self.token_norm = LayerNorm(hidden)

    def prepare_conditioning(
        self,
        atom_inputs: AtomInputs,
        pair_trunk: mx.array,
        relative_position_encoding: mx.array,
        single_inputs: mx.array,
        attention_mask: mx.array | None = None,
        num_diffusion_samples: int = 1,
    ) -> DenoiserConditioning:
        """The step-invariant conditioning for ``batch * num_diffusion_samples`` denoiser rows (sample
        rows of one input adjacent, as ``repeat_interleave``).

        The atom window mask and the per-layer token biases are the only large tensors (the biases
        are ~366 MiB per fold at 1,000 residues unexpanded); they stay at batch 1 when the batch is 1
        and broadcast over the samples. The single inputs are projected after expanding, as the
        reference does (a Linear's result may depend on the batch size in the last bits)."""
        samples = num_diffusion_samples
        encoder = self.atom_encoder
        atom_embeds, (cos, sin) = encoder.embed_atoms(atom_inputs)
        window_mask = encoder.build_attention_mask(atom_inputs.atom_attention_mask, atom_embeds)
        pair = self.conditioning.compute_pair_repr(pair_trunk, relative_position_encoding)
        biases = self.token_transformer.compute_pair_biases(pair, attention_mask)
        if single_inputs.shape[0] != 1:
            window_mask = mx.repeat(window_mask, samples, axis=0)
            biases = [mx.repeat(bias, samples, axis=0) for bias in biases]

        def expand(x: mx.array) -> mx.array:
            return mx.repeat(x, samples, axis=0)

        return DenoiserConditioning(
            atom_embeds=expand(atom_embeds),
            attention_mask=window_mask,
            position_embeddings=(expand(cos), expand(sin)),
            atom_mask=expand(atom_inputs.atom_attention_mask),
            atom_to_token=expand(atom_inputs.atom_to_token),
            projected_single_inputs=self.conditioning.compute_single_repr(expand(single_inputs)),
            token_attention_bias=biases,
        )

    def __call__(self, noisy_coords: mx.array, noise_level: mx.array, conditioning: DenoiserConditioning) -> mx.array:
        """Denoised coordinates (N, A, 3) float32 from float32 ``noisy_coords`` (N, A, 3) at the float32
        per-row ``noise_level`` (N,), N = batch * samples."""
        sigma_data = self.sigma_data
        single_states = self.conditioning(noise_level, conditioning.projected_single_inputs)

        scale = mx.sqrt(noise_level * noise_level + sigma_data * sigma_data)
        normalized = noisy_coords / scale[:, None, None]
        # The second coordinate slot is unused in this release: coords_linear sees [coords, 0].
        coord_input = mx.concatenate([normalized, mx.zeros_like(normalized)], axis=-1)
        coord_embeds = self.coords_linear(coord_input.astype(self.coords_linear.weight.dtype))
        atom_embeds = conditioning.atom_embeds
        token_states, atom_states = self.atom_encoder(
            atom_embeds + coord_embeds,
            atom_embeds,
            conditioning.attention_mask,
            conditioning.position_embeddings,
            conditioning.atom_mask,
            conditioning.atom_to_token,
            single_states.shape[1],
        )
        token_states = token_states + self.single_to_token(self.single_step_norm(single_states))
        token_states = self.token_transformer(token_states, single_states, conditioning.token_attention_bias)
        token_states = self.token_norm(token_states)
        coord_update = self.atom_decoder(
            token_states,
            atom_states,
            atom_embeds,
            conditioning.attention_mask,
            conditioning.position_embeddings,
            conditioning.atom_to_token,
        )
        # The float32 noise-level scalars keep the coordinates float32 whatever the weights' dtype.
        sigma_sq, noise_sq = sigma_data * sigma_data, noise_level * noise_level
        skip = (sigma_sq / (sigma_sq + noise_sq))[:, None, None]
        out = ((sigma_data * noise_level) / mx.sqrt(sigma_sq + noise_sq))[:, None, None]
        return skip * noisy_coords + out * coord_update
