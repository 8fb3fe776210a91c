"""The atom stack of ESMFold2: per-atom embedding, sliding-window atom attention with 3D RoPE, and the
atom <-> token maps (transformers' ``EsmFold2AtomEncoder``, ``EsmFold2AtomDecoder`` and their parts).

Attribute names are transformers' own. The 4D atom mask is additive (0 / the dtype's lowest) in the
atom embeddings' dtype: MLX's CUDA attention expands a boolean mask to (B, H, A, A) first.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ...fold_config import AtomEncoderConfig, FoldConfig
from .layers import LayerNorm, SwiGLU, rms_norm


@dataclasses.dataclass
class AtomInputs:
    """Reference-conformer atom features, categorical fields one-hot and padding zeroed (as after
    transformers' ``EsmFold2Model._prepare_features``).

    ref_pos: (B, A, 3) float32 reference coordinates. ref_charge: (B, A) formal charge.
    atom_attention_mask: (B, A) bool, True on real atoms. ref_element: (B, A, max_atomic_number)
    one-hot. ref_atom_name_chars: (B, A, max_chars, char_vocab_size) one-hot. ref_space_uid: (B, A)
    int group id (the atom's token). atom_to_token: (B, A) int token index, 0 on padding.
    """

    ref_pos: mx.array
    ref_charge: mx.array
    atom_attention_mask: mx.array
    ref_element: mx.array
    ref_atom_name_chars: mx.array
    ref_space_uid: mx.array
    atom_to_token: mx.array


class RotaryEmbedding3D(nn.Module):
    """RoPE over the atom's x/y/z reference position and its space uid (transformers'
    ``EsmFold2RotaryEmbedding``): cos/sin at the full head width, angles built in float32."""

    def __init__(self, atom_config: AtomEncoderConfig):
        super().__init__()
        self.num_spatial_pairs_per_axis = atom_config.num_spatial_rope_pairs_per_axis
        self.num_uid_pairs = atom_config.num_uid_rope_pairs
        self.spatial_rope_base_frequency = atom_config.spatial_rope_base_frequency
        self.uid_rope_base_frequency = atom_config.uid_rope_base_frequency
        self.num_inactive_channels = (
            atom_config.head_dim // 2 - 3 * self.num_spatial_pairs_per_axis - self.num_uid_pairs
        )

    def __call__(self, ref_pos: mx.array, ref_space_uid: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        spatial, uid = self.num_spatial_pairs_per_axis, self.num_uid_pairs
        # 1 / base**(i / n) in float32, as the reference computes its inverse frequencies.
        spatial_inv = 1.0 / mx.power(
            mx.array(self.spatial_rope_base_frequency, mx.float32), mx.arange(spatial, dtype=mx.float32) / spatial
        )
        uid_inv = 1.0 / mx.power(
            mx.array(self.uid_rope_base_frequency, mx.float32), mx.arange(uid, dtype=mx.float32) / uid
        )
        inactive = self.num_inactive_channels
        inv_freq = mx.concatenate([mx.tile(spatial_inv, 3), uid_inv, mx.zeros((inactive,), mx.float32)])
        uid_pos = ref_space_uid.astype(mx.float32)[..., None]
        positions = mx.concatenate(
            [
                mx.repeat(ref_pos.astype(mx.float32), spatial, axis=-1),
                mx.broadcast_to(uid_pos, (*ref_space_uid.shape, uid + inactive)),
            ],
            axis=-1,
        )
        freqs = positions * inv_freq
        emb = mx.concatenate([freqs, freqs], axis=-1)
        return mx.cos(emb).astype(dtype), mx.sin(emb).astype(dtype)


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def attendable_rows(mask: mx.array) -> mx.array:
    """True for each query row of a (boolean or additive) attention mask that sees at least one key."""
    if mask.dtype == mx.bool_:
        return mx.any(mask, axis=-1, keepdims=True)
    return mx.max(mask, axis=-1, keepdims=True) == 0


class AtomAttention(nn.Module):
    """Sliding-window self-attention over atoms: RMS-normed q/k, 3D RoPE, sigmoid-gated output.

    A query row with no attendable key (padding far from any real atom) gives 0, as the reference's
    ``nan_to_num`` of torch's all-masked softmax does; MLX's kernels would give a uniform average.
    """

    def __init__(self, config: FoldConfig, atom_config: AtomEncoderConfig):
        super().__init__()
        hidden = atom_config.hidden_size
        self.head_dim = atom_config.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, hidden, bias=False)

    def __call__(
        self, hidden_states: mx.array, attention_mask: mx.array, position_embeddings: tuple[mx.array, mx.array]
    ) -> mx.array:
        batch, length, _ = hidden_states.shape

        def heads(x: mx.array) -> mx.array:
            return x.reshape(batch, length, -1, self.head_dim).transpose(0, 2, 1, 3)

        q = rms_norm(heads(self.q_proj(hidden_states)))
        k = rms_norm(heads(self.k_proj(hidden_states)))
        v = heads(self.v_proj(hidden_states))
        cos, sin = (p[:, None] for p in position_embeddings)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scaling, mask=attention_mask)
        out = mx.where(attendable_rows(attention_mask), out, mx.array(0, out.dtype))
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return self.o_proj(out * mx.sigmoid(self.gate_proj(hidden_states)))


class AtomLayer(nn.Module):
    """adaLN-modulated atom attention and SwiGLU, modulation ``adaln_linear(silu(atom_conditioning))``.
    ``input_layernorm`` and ``post_attention_layernorm`` are weightless RMSNorms (no tensors)."""

    def __init__(self, config: FoldConfig, atom_config: AtomEncoderConfig):
        super().__init__()
        hidden = atom_config.hidden_size
        self.adaln_linear = nn.Linear(hidden, 6 * hidden, bias=False)
        self.self_attn = AtomAttention(config, atom_config)
        self.mlp = SwiGLU(hidden, atom_config.intermediate_size)

    def __call__(
        self,
        hidden_states: mx.array,
        atom_conditioning: mx.array,
        attention_mask: mx.array,
        position_embeddings: tuple[mx.array, mx.array],
    ) -> mx.array:
        modulation = self.adaln_linear(nn.silu(atom_conditioning))
        if modulation.ndim == 2:
            modulation = modulation[:, None]
        attn_shift, attn_scale, attn_gate, mlp_shift, mlp_scale, mlp_gate = mx.split(modulation, 6, axis=-1)
        attn_in = rms_norm(hidden_states) * (1 + attn_scale) + attn_shift
        hidden_states = hidden_states + attn_gate * self.self_attn(attn_in, attention_mask, position_embeddings)
        mlp_in = rms_norm(hidden_states) * (1 + mlp_scale) + mlp_shift
        return hidden_states + mlp_gate * self.mlp(mlp_in)


def scatter_atom_to_token(
    atom_features: mx.array, atom_to_token: mx.array, num_tokens: int, atom_mask: mx.array | None = None
) -> mx.array:
    """(B, A, d) -> (B, num_tokens, d): the mean over each token's atoms, padding atoms (``atom_mask``
    False) left out; a token with no atom gets 0."""
    batch, _, hidden = atom_features.shape
    index = atom_to_token
    slots = num_tokens
    if atom_mask is not None:
        index = mx.where(atom_mask, index, num_tokens)  # a spare slot, dropped below
        slots += 1
    rows = mx.arange(batch)[:, None]
    dtype = atom_features.dtype
    sums = mx.zeros((batch, slots, hidden), dtype).at[rows, index].add(atom_features)
    counts = mx.zeros((batch, slots), dtype).at[rows, index].add(mx.ones(index.shape, dtype))
    return (sums / mx.maximum(counts, 1)[..., None])[:, :num_tokens]


def gather_along_dim1(source: mx.array, index: mx.array) -> mx.array:
    """``source`` (B, N, d) gathered along axis 1 by ``index`` (B, M): (B, M, d)."""
    return mx.take_along_axis(source, index[..., None], axis=1)


class AtomEncoder(nn.Module):
    """Embeds atoms, runs the atom layers, pools atoms into tokens (transformers' ``EsmFold2AtomEncoder``).
    ``atom_config`` is the call site's atom sub-config (the trunk's or the diffusion module's)."""

    def __init__(self, config: FoldConfig, atom_config: AtomEncoderConfig):
        super().__init__()
        self.char_feature_dim = config.char_vocab_size * config.max_chars
        self.sliding_window = config.sliding_window
        self.atom_linear = nn.Linear(config.atom_feature_dim, atom_config.hidden_size, bias=False)
        self.atom_norm = LayerNorm(atom_config.hidden_size)
        self.rotary_emb = RotaryEmbedding3D(atom_config)
        self.layers = [AtomLayer(config, atom_config) for _ in range(atom_config.num_hidden_layers)]
        self.atom_to_token_linear = nn.Linear(atom_config.hidden_size, atom_config.output_dim, bias=False)

    def embed_atoms(self, atom_inputs: AtomInputs) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        """Per-atom base embedding and the 3D-RoPE (cos, sin); noise-independent (once per fold)."""
        ref_pos = atom_inputs.ref_pos
        batch, atoms = ref_pos.shape[:2]
        features = mx.concatenate(
            [
                ref_pos.astype(mx.float32),
                atom_inputs.ref_charge.astype(mx.float32)[..., None],
                atom_inputs.atom_attention_mask.astype(mx.float32)[..., None],
                atom_inputs.ref_element.astype(mx.float32),
                atom_inputs.ref_atom_name_chars.astype(mx.float32).reshape(batch, atoms, self.char_feature_dim),
            ],
            axis=-1,
        )
        embeds = self.atom_norm(self.atom_linear(features.astype(self.atom_linear.weight.dtype)))
        return embeds, self.rotary_emb(ref_pos, atom_inputs.ref_space_uid, embeds.dtype)

    def build_attention_mask(self, atom_mask: mx.array, atom_embeds: mx.array) -> mx.array:
        """Additive (B, 1, A, A) mask in ``atom_embeds``' dtype: query i sees key j when j is a real atom
        and |i - j| <= sliding_window // 2 (transformers' inclusive bidirectional window). Padded query
        rows are not masked; those with no real atom in reach get 0 from the attention."""
        positions, radius = mx.arange(atom_mask.shape[1]), self.sliding_window // 2
        # Two boolean comparisons rather than |i - j|: no (A, A) integer temporary (A ~ 9,000 at 1,024 residues).
        window = (positions[None, :] >= positions[:, None] - radius) & (
            positions[None, :] <= positions[:, None] + radius
        )
        keep = window[None, None] & atom_mask.astype(mx.bool_)[:, None, None, :]
        dtype = atom_embeds.dtype
        return mx.where(keep, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))

    def __call__(
        self,
        hidden_states: mx.array,
        atom_conditioning: mx.array,
        attention_mask: mx.array,
        position_embeddings: tuple[mx.array, mx.array],
        atom_mask: mx.array,
        atom_to_token: mx.array,
        num_tokens: int,
    ) -> tuple[mx.array, mx.array]:
        """(token_hidden_states (B, num_tokens, output_dim), atom hidden_states (B, A, hidden))."""
        for layer in self.layers:
            hidden_states = layer(hidden_states, atom_conditioning, attention_mask, position_embeddings)
        token_features = nn.relu(self.atom_to_token_linear(hidden_states))
        return scatter_atom_to_token(token_features, atom_to_token, num_tokens, atom_mask), hidden_states


class AtomDecoder(nn.Module):
    """Broadcasts token states back to atoms, runs the atom layers, outputs a per-atom (x, y, z) update.
    Only the diffusion module has one, so its dims are the diffusion atom sub-config's."""

    def __init__(self, config: FoldConfig):
        super().__init__()
        diffusion_config = config.structure_head.diffusion_module
        atom_config = diffusion_config.atom_encoder
        self.token_to_atom_linear = nn.Linear(diffusion_config.hidden_size, atom_config.hidden_size, bias=False)
        self.layers = [AtomLayer(config, atom_config) for _ in range(atom_config.num_hidden_layers)]
        self.norm = LayerNorm(atom_config.hidden_size)
        self.output_linear = nn.Linear(atom_config.hidden_size, 3, bias=False)

    def __call__(
        self,
        token_hidden_states: mx.array,
        hidden_states: mx.array,
        atom_conditioning: mx.array,
        attention_mask: mx.array,
        position_embeddings: tuple[mx.array, mx.array],
        atom_to_token: mx.array,
    ) -> mx.array:
        hidden_states = hidden_states + gather_along_dim1(self.token_to_atom_linear(token_hidden_states), atom_to_token)
        for layer in self.layers:
            hidden_states = layer(hidden_states, atom_conditioning, attention_mask, position_embeddings)
        return self.output_linear(self.norm(hidden_states))
