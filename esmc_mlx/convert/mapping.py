"""The one table from checkpoint tensor names to MLX names, for all four input layouts.

MLX names are transformers' ``EsmcForMaskedLM`` names (the published layout maps to itself); an
ESMFold2 checkpoint's backbone (``esmc.*``) goes through the same table, its folding model keeps
transformers' ``EsmFold2Model`` names.
The ``esm`` package, the legacy ``.pth`` and mlx-lm's ESMC port fuse q/k/v rows into one matrix
and gate/up rows into ``fc1``; those are split here. See docs/formats.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import mlx.core as mx

from ..config import HEAD_DIM, ESMCConfig, default_intermediate_size

QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_BLOCK = r"(?:esmc\.)?transformer\.blocks\.(\d+)\."
_LAYER = "esmc.layers.{}."

# (source regex, target): a target string is one tensor; a tuple of names means the source's
# rows are split into that many equal parts, in order.
RULES: list[tuple[str, str | tuple[str, ...]]] = [
    # 1. published / transformers layout: already MLX names
    (r"(esmc\.(?:embed_tokens|norm)\.weight)", r"\1"),
    (r"(esmc\.layers\.\d+\..+)", r"\1"),
    (r"(lm_head\.(?:dense|layer_norm|decoder)\.(?:weight|bias))", r"\1"),
    # 2. esm package (Transformer Engine names), with or without the esmc. prefix
    (r"(?:esmc\.)?embed\.weight", "esmc.embed_tokens.weight"),
    (_BLOCK + r"attn\.layernorm_qkv\.layer_norm_weight", _LAYER + "input_layernorm.weight"),
    (_BLOCK + r"attn\.layernorm_qkv\.layer_norm_bias", _LAYER + "input_layernorm.bias"),
    (_BLOCK + r"attn\.layernorm_qkv\.weight", tuple(_LAYER + n for n in QKV)),
    (_BLOCK + r"attn\.q_ln\.weight", _LAYER + "self_attn.q_norm.weight"),
    (_BLOCK + r"attn\.k_ln\.weight", _LAYER + "self_attn.k_norm.weight"),
    (_BLOCK + r"attn\.out_proj\.weight", _LAYER + "self_attn.o_proj.weight"),
    (_BLOCK + r"ffn\.layer_norm_weight", _LAYER + "post_attention_layernorm.weight"),
    (_BLOCK + r"ffn\.layer_norm_bias", _LAYER + "post_attention_layernorm.bias"),
    (_BLOCK + r"ffn\.fc1_weight", tuple(_LAYER + n for n in GATE_UP)),
    (_BLOCK + r"ffn\.fc2_weight", _LAYER + "mlp.down_proj.weight"),
    (r"(?:esmc\.)?transformer\.norm\.weight", "esmc.norm.weight"),
    (r"(?:lm_head|sequence_head)\.0\.(weight|bias)", r"lm_head.dense.\1"),
    (r"(?:lm_head|sequence_head)\.2\.(weight|bias)", r"lm_head.layer_norm.\1"),
    (r"(?:lm_head|sequence_head)\.3\.(weight|bias)", r"lm_head.decoder.\1"),
    # 3. legacy 2024-12 .pth (nn.Sequential indices)
    (_BLOCK + r"attn\.layernorm_qkv\.0\.(weight|bias)", _LAYER + r"input_layernorm.\2"),
    (_BLOCK + r"attn\.layernorm_qkv\.1\.weight", tuple(_LAYER + n for n in QKV)),
    (_BLOCK + r"ffn\.0\.(weight|bias)", _LAYER + r"post_attention_layernorm.\2"),
    (_BLOCK + r"ffn\.1\.weight", tuple(_LAYER + n for n in GATE_UP)),
    (_BLOCK + r"ffn\.3\.weight", _LAYER + "mlp.down_proj.weight"),
    # 4. mlx-lm's ESMC port (ml-explore/mlx-lm PR 1484, mlx_lm/models/esmc.py): its module names,
    #    which mlx_lm.convert saves. Same numerics as transformers (residuals divided by
    #    sqrt(n_layers / 36), weights stored unscaled; fc1 = [gate; up] as in the esm package).
    #    Embedding, q_ln/k_ln, out_proj, final norm and lm_head.{0,2,3} match the rules above.
    (_BLOCK + r"attn\.ln_qkv\.(weight|bias)", _LAYER + r"input_layernorm.\2"),
    (_BLOCK + r"attn\.qkv\.weight", tuple(_LAYER + n for n in QKV)),
    (_BLOCK + r"ffn\.ln\.(weight|bias)", _LAYER + r"post_attention_layernorm.\2"),
    (_BLOCK + r"ffn\.fc1\.weight", tuple(_LAYER + n for n in GATE_UP)),
    (_BLOCK + r"ffn\.fc2\.weight", _LAYER + "mlp.down_proj.weight"),
]
_COMPILED = [(re.compile(pattern), target) for pattern, target in RULES]
# Buffers some exporters save that carry no weights.
IGNORED = re.compile(r".*(rotary_emb\.inv_freq|original_inv_freq|_extra_state)$")


def _expand(match: re.Match, template: str) -> str:
    if "{}" in template:  # block templates: the layer index is group 1
        template = template.replace("{}", match.group(1))
        # shift back-references past the layer-index group
        return re.sub(r"\\(\d)", lambda m: match.group(int(m.group(1))), template)
    return match.expand(template)


def target_names(source_name: str) -> tuple[str, ...] | None:
    """MLX names a source tensor becomes, or None if no rule knows it."""
    for pattern, target in _COMPILED:
        match = pattern.fullmatch(source_name)
        if match:
            if isinstance(target, tuple):
                return tuple(_expand(match, t) for t in target)
            return (_expand(match, target),)
    return None


def fold_target_names(source_name: str) -> tuple[str, ...] | None:
    """MLX names of an ESMFold2 checkpoint's tensor: the backbone's (``esmc.*``) through the rules
    above, the folding model's unchanged (its MLX modules use transformers' names); None for a
    name no rule knows and for the weightless buffers ``IGNORED`` names."""
    if source_name.startswith("esmc.") or IGNORED.match(source_name):
        return target_names(source_name)
    return (source_name,)


def rename(
    source_name: str, tensor: mx.array, names_of: Callable[[str], tuple[str, ...] | None] = target_names
) -> Iterator[tuple[str, mx.array]]:
    """Yield (mlx_name, tensor) for one source tensor, splitting fused rows; ``names_of``: the
    names a source tensor becomes (``target_names``, or ``fold_target_names`` for ESMFold2)."""
    names = names_of(source_name)
    if names is None:
        raise KeyError(source_name)
    if len(names) == 1:
        yield names[0], tensor
        return
    if tensor.shape[0] % len(names):
        raise ValueError(f"{source_name}: {tensor.shape[0]} rows do not split into {len(names)} equal parts")
    yield from zip(names, mx.split(tensor, len(names), axis=0))


def infer_config(shapes: dict[str, tuple[int, ...]]) -> ESMCConfig:
    """Architecture from tensor shapes alone (legacy .pth has no config): heads are 64 wide."""
    renamed: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        names = target_names(name)
        for target in names or ():
            renamed[target] = (shape[0] // len(names), *shape[1:]) if shape else shape
    if "esmc.embed_tokens.weight" not in renamed:
        raise ValueError("cannot infer the architecture: no token embedding tensor found")
    if len(renamed["esmc.embed_tokens.weight"]) != 2:
        raise ValueError(
            f"cannot infer the architecture: the token embedding has shape {renamed['esmc.embed_tokens.weight']}, "
            "not (vocabulary, hidden size)"
        )
    vocab, hidden = renamed["esmc.embed_tokens.weight"]
    layers = 1 + max((int(m.group(1)) for n in renamed if (m := re.match(r"esmc\.layers\.(\d+)\.", n))), default=-1)
    gate = renamed.get("esmc.layers.0.mlp.gate_proj.weight")
    return ESMCConfig(
        hidden_size=hidden,
        num_attention_heads=hidden // HEAD_DIM,
        num_hidden_layers=layers,
        intermediate_size=gate[0] if gate else default_intermediate_size(hidden),
        vocab_size=vocab,
    )
