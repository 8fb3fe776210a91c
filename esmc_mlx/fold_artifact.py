"""An ESMFold2 artifact (the ``fold`` kind): its tensors, their precision, the files it is made of,
and what ``esmc-mlx info`` says of it.

Layout: a model directory (docs/formats.md) whose config.json is transformers' ``EsmFold2Config``
(``model_type: esmfold2``, ``FoldConfig.to_dict``) plus esmc-mlx's bookkeeping (``dtype``,
mlx-lm's ``quantization`` record, ``esmc_mlx`` provenance). Tensor names are transformers':
the folding model's as ``EsmFold2Model`` names them, the ESMC backbone's under ``esmc.``
(``EsmcModel``'s: embedding, blocks, final norm; no LM head). The backbone is stored as an ESMC
artifact stores its encoder (one float dtype, or quantized block projections); the folding
model in one float dtype but for the tensors transformers keeps in float32 (``keeps_float32``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from .artifact import (
    ArtifactKind,
    check_against_tensors,
    expected_shapes,
    human_size,
    model_files,
    quantization_record,
    read_config,
    register_artifact_kind,
    safetensors_header,
    storage_text,
    tensor_files,
    weight_files,
)
from .errors import ConfigError, ConvertError
from .fold_config import MODEL_TYPE, AtomEncoderConfig, FoldConfig
from .readers import read_json

BACKBONE = "esmc."  # the ESMC backbone's tensors, beside the folding model's
# transformers' EsmFold2PreTrainedModel._keep_in_fp32_modules_strict, matched as transformers
# matches them (PreTrainedModel._get_dtype_plan -> core_model_loading.build_glob_alternation):
# one alternation, "*" read as ".*", searched anywhere in a name, "." matching any character
# (so "norm.weight" also matches "pair_norm.weight", "plddt_layernorm.weight" and "q_norm.weight").
FLOAT32_MODULES = (
    "fourier",
    "norm.weight",
    "norm.bias",
    "norm_mix",
    "norm_start",
    "norm_single",
    "boundaries",
    "distogram_head",
)
_FLOAT32 = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in FLOAT32_MODULES))
# Made float32 in EsmFold2Parcae.__init__, which from_pretrained keeps when no pattern names it.
FLOAT32_PARAMETERS = ("parcae.log_delta",)
# Fixed tensors, not learned (torch buffers): counted apart from the parameters.
BUFFERS = (
    "confidence_head.boundaries",
    "structure_head.conditioning.fourier.frequencies",
    "structure_head.conditioning.fourier.phases",
)


def float32_in_transformers(name: str) -> bool:
    """Whether transformers' half-precision ``EsmFold2Model`` (``from_pretrained(dtype=bfloat16)``)
    holds the tensor ``name`` in float32: the backbone's norms included."""
    return name in FLOAT32_PARAMETERS or _FLOAT32.search(name) is not None


def keeps_float32(name: str) -> bool:
    """Whether the artifact stores ``name`` in float32 whatever its dtype: the folding model's
    tensors that transformers keeps in float32. The backbone's (``esmc.*``) follow the ESMC
    artifact's rule, one float dtype: the runtime's ESMC would turn a bfloat16 stream into float32
    at a float32 norm weight (MLX promotes), doubling the 6B's activations."""
    return not name.startswith(BACKBONE) and float32_in_transformers(name)


# --- tensor names and shapes ------------------------------------------------------------------------
def _linear(prefix: str, out: int, inp: int, bias: bool = False) -> dict:
    shapes = {f"{prefix}.weight": (out, inp)}
    return {**shapes, f"{prefix}.bias": (out,)} if bias else shapes


def _norm(prefix: str, width: int, bias: bool = True) -> dict:
    return {f"{prefix}.weight": (width,), **({f"{prefix}.bias": (width,)} if bias else {})}


def _swiglu(prefix: str, width: int, inner: int) -> dict:
    return {f"{prefix}.gate_up_proj.weight": (2 * inner, width), f"{prefix}.down_proj.weight": (width, inner)}


def _transition(prefix: str, width: int, inner: int) -> dict:
    return {**_norm(f"{prefix}.norm", width), **_swiglu(f"{prefix}.mlp", width, inner)}


def _stack(prefix: str, count: int, block) -> dict:
    return {k: v for i in range(count) for k, v in block(f"{prefix}.{i}").items()}


def _atom_layer(prefix: str, atom: AtomEncoderConfig) -> dict:
    h = atom.hidden_size
    shapes = _linear(f"{prefix}.adaln_linear", 6 * h, h)  # its q/k/input/post norms are weightless RMSNorms
    for name in ("q", "k", "v", "o", "gate"):
        shapes.update(_linear(f"{prefix}.self_attn.{name}_proj", h, h))
    return {**shapes, **_swiglu(f"{prefix}.mlp", h, atom.intermediate_size)}


def _atom_encoder(prefix: str, config: FoldConfig, atom: AtomEncoderConfig) -> dict:
    h = atom.hidden_size
    return {
        **_linear(f"{prefix}.atom_linear", h, config.atom_feature_dim),
        **_norm(f"{prefix}.atom_norm", h),
        **_stack(f"{prefix}.layers", atom.num_hidden_layers, lambda p: _atom_layer(p, atom)),
        **_linear(f"{prefix}.atom_to_token_linear", atom.output_dim, h),
    }


def _tri_mul(prefix: str, p: int) -> dict:
    return {
        **_norm(f"{prefix}.norm_start", p),
        **_norm(f"{prefix}.norm_mix", p),
        **_linear(f"{prefix}.proj_bundle", 4 * p, p),
        **_linear(f"{prefix}.proj_emit", p, p),
        **_linear(f"{prefix}.proj_gate", p, p),
    }


def _pair_layer(prefix: str, config: FoldConfig) -> dict:
    p = config.pairwise_hidden_size
    return {
        **_tri_mul(f"{prefix}.tri_mul_out", p),
        **_tri_mul(f"{prefix}.tri_mul_in", p),
        **_transition(f"{prefix}.pair_transition", p, config.pair_transition_intermediate_size),
    }


def _pair_stack(prefix: str, config: FoldConfig, count: int) -> dict:
    return _stack(f"{prefix}.layers", count, lambda q: _pair_layer(q, config))


def _adaptive_norm(prefix: str, d: int) -> dict:
    return {
        **_norm(f"{prefix}.cond_norm", d, bias=False),
        **_linear(f"{prefix}.gate_proj", d, d, bias=True),
        **_linear(f"{prefix}.shift_proj", d, d),
    }


def _diffusion_layer(prefix: str, config: FoldConfig) -> dict:
    diffusion = config.structure_head.diffusion_module
    d, p = diffusion.hidden_size, config.pairwise_hidden_size
    return {
        **_adaptive_norm(f"{prefix}.input_layernorm", d),
        **_linear(f"{prefix}.self_attn.q_proj", d, d, bias=True),
        **{k: v for n in ("k", "v", "gate", "o") for k, v in _linear(f"{prefix}.self_attn.{n}_proj", d, d).items()},
        **_linear(f"{prefix}.attn_gate", d, d, bias=True),
        **_adaptive_norm(f"{prefix}.post_attention_layernorm", d),
        **_swiglu(f"{prefix}.mlp", d, diffusion.intermediate_size),
        **_linear(f"{prefix}.mlp_gate", d, d, bias=True),
        **_norm(f"{prefix}.pair_norm", p),
        **_linear(f"{prefix}.pair_bias_proj", diffusion.num_attention_heads, p),
    }


def _structure_head(prefix: str, config: FoldConfig) -> dict:
    diffusion = config.structure_head.diffusion_module
    d, p, s, atom = (
        diffusion.hidden_size,
        config.pairwise_hidden_size,
        config.single_inputs_size,
        diffusion.atom_encoder,
    )
    c = f"{prefix}.conditioning"
    return {
        **_norm(f"{c}.pair_input_norm", 2 * p),
        **_linear(f"{c}.pair_proj", p, 2 * p),
        **_transition(f"{c}.pair_transition_0", p, diffusion.pair_intermediate_size),
        **_transition(f"{c}.pair_transition_1", p, diffusion.pair_intermediate_size),
        **_norm(f"{c}.single_input_norm", s),
        **_linear(f"{c}.single_proj", d, s),
        f"{c}.fourier.frequencies": (diffusion.fourier_dim,),
        f"{c}.fourier.phases": (diffusion.fourier_dim,),
        **_norm(f"{c}.noise_norm", diffusion.fourier_dim),
        **_linear(f"{c}.noise_proj", d, diffusion.fourier_dim),
        **_transition(f"{c}.single_transition_0", d, diffusion.intermediate_size),
        **_transition(f"{c}.single_transition_1", d, diffusion.intermediate_size),
        **_linear(f"{prefix}.coords_linear", atom.hidden_size, 6),
        **_atom_encoder(f"{prefix}.atom_encoder", config, atom),
        **_linear(f"{prefix}.atom_decoder.token_to_atom_linear", atom.hidden_size, d),
        **_stack(f"{prefix}.atom_decoder.layers", atom.num_hidden_layers, lambda q: _atom_layer(q, atom)),
        **_norm(f"{prefix}.atom_decoder.norm", atom.hidden_size),
        **_linear(f"{prefix}.atom_decoder.output_linear", 3, atom.hidden_size),
        **_linear(f"{prefix}.single_to_token", d, d),
        **_stack(
            f"{prefix}.token_transformer.layers", diffusion.num_hidden_layers, lambda q: _diffusion_layer(q, config)
        ),
        **_norm(f"{prefix}.single_step_norm", d),
        **_norm(f"{prefix}.token_norm", d),
    }


def _confidence_head(prefix: str, config: FoldConfig) -> dict:
    head, p, h, s = config.confidence_head, config.pairwise_hidden_size, config.hidden_size, config.single_inputs_size
    e = f"{prefix}.input_embedder"
    return {
        f"{prefix}.plddt_weight": (config.max_atoms_per_token, h, head.num_plddt_bins),
        f"{prefix}.resolved_weight": (config.max_atoms_per_token, h, 2),
        f"{prefix}.boundaries": (head.distogram_bins - 1,),
        f"{prefix}.dist_bin_pairwise_embed.weight": (head.distogram_bins, p),
        **_norm(f"{e}.single_inputs_norm", s),
        **_norm(f"{e}.pair_norm", p),
        **{
            k: v
            for n in ("", "_transpose", "_prod_in1", "_prod_in2")
            for k, v in _linear(f"{e}.single_to_pair{n}", p, s).items()
        },
        **_linear(f"{e}.single_to_pair_prod_out", p, p),
        **_linear(f"{prefix}.row_attention_pooling.attn_proj", 1, p),
        **_linear(f"{prefix}.row_attention_pooling.out_proj", h, p),
        **_pair_stack(f"{prefix}.folding_trunk", config, head.num_hidden_layers),
        **_norm(f"{prefix}.plddt_layernorm", h),
        **_norm(f"{prefix}.pae_layernorm", p),
        **_linear(f"{prefix}.pae_head", head.num_pae_bins, p),
        **_norm(f"{prefix}.pde_layernorm", p),
        **_linear(f"{prefix}.pde_head", head.num_pde_bins, p),
        **_norm(f"{prefix}.resolved_layernorm", h),
    }


def _msa_layer(prefix: str, config: FoldConfig, updates_msa: bool) -> dict:
    msa, p = config.msa_encoder, config.pairwise_hidden_size
    inner = msa.num_attention_heads * msa.head_dim
    shapes = {
        **_pair_layer(prefix, config),
        **_norm(f"{prefix}.outer_product_mean.norm", msa.hidden_size),
        **_linear(f"{prefix}.outer_product_mean.input_proj", 2 * msa.outer_hidden_size, msa.hidden_size),
        **_linear(f"{prefix}.outer_product_mean.output_proj", p, msa.outer_hidden_size**2, bias=True),
    }
    if updates_msa:  # the last layer updates only the pair: it has no MSA-stream weights
        w = f"{prefix}.msa_pair_weighted_averaging"
        shapes.update(
            {
                **_norm(f"{w}.norm_single", msa.hidden_size),
                **_norm(f"{w}.bias_norm", p),
                **_linear(f"{w}.bias_proj", msa.num_attention_heads, p),
                **_linear(f"{w}.v_proj", inner, msa.hidden_size),
                **_linear(f"{w}.gate_proj", inner, msa.hidden_size),
                **_linear(f"{w}.o_proj", msa.hidden_size, inner),
                **_transition(f"{prefix}.msa_transition", msa.hidden_size, msa.intermediate_size),
            }
        )
    return shapes


def backbone_shapes(config: FoldConfig) -> dict[str, tuple[int, ...]]:
    """The ESMC backbone's tensors (``EsmcModel``: embedding, blocks, final norm; no LM head)."""
    return {k: v for k, v in expected_shapes(config.esmc_config).items() if k.startswith(BACKBONE)}


def expected_fold_shapes(config: FoldConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an ESMFold2 of ``config`` holds (transformers' ``EsmFold2Model.state_dict()``:
    parameters and the saved buffers ``BUFFERS``), in MLX (= transformers) names, with its shape;
    the MSA encoder's when ``msa_encoder.enabled``. Written out so that the converter checks a
    checkpoint from its headers without building a model (tests compare it with the state dict)."""
    p, s, lm = config.pairwise_hidden_size, config.single_inputs_size, config.esmc_config
    residue_features = 2 * config.num_relative_residx_bins + 2
    shapes = {
        **_atom_encoder("input_embedder.atom_encoder", config, config.atom_encoder),
        **_linear("input_embedder.pair_init_1", p, s),
        **_linear("input_embedder.pair_init_2", p, s),
        **_linear("input_embedder.rel_pos.embed", p, 2 * residue_features + 2 * config.num_relative_chain_bins + 3),
        **_linear("input_embedder.token_bonds", p, 1),
        "language_model.layer_weights": (lm.num_hidden_layers + 1,),
        **_linear("language_model.single_to_pair.downproject", p, p, bias=True),
        **_linear("language_model.single_to_pair.output_fc1", p, 2 * p, bias=True),
        **_linear("language_model.single_to_pair.output_fc2", p, p, bias=True),
        **_norm("language_model.pair_output_norm", p),
        **_norm("language_model.pair_input_norm", lm.hidden_size),
        **_linear("language_model.pair_proj", p, lm.hidden_size),
        **backbone_shapes(config),
        **_pair_stack("folding_trunk", config, config.folding_trunk_num_hidden_layers),
        **_pair_stack("lm_encoder", config, config.lm_encoder.num_hidden_layers),
        "parcae.log_state_decay": (p,),
        "parcae.log_delta": (p,),
        "parcae.input_matrix_continuous": (p, p),
        **_norm("parcae.input_norm", p),
        **_linear("parcae.out_proj", p, p),
        **_pair_stack("parcae.output_stack", config, config.parcae_num_coda_layers),
        **_structure_head("structure_head", config),
        **_linear("distogram_head", config.structure_head.num_distogram_bins, p, bias=True),
        **_confidence_head("confidence_head", config),
    }
    msa = config.msa_encoder
    if msa.enabled:
        shapes.update(_linear("msa_encoder.embed", msa.hidden_size, config.num_res_types + 2))
        shapes.update(_linear("msa_encoder.project_inputs", msa.hidden_size, s))
        for i in range(msa.num_hidden_layers):
            shapes.update(_msa_layer(f"msa_encoder.layers.{i}", config, updates_msa=i != msa.num_hidden_layers - 1))
    return shapes


# config field -> the numbered blocks it counts (names prefix.N....)
STACKS = {
    "folding_trunk_num_hidden_layers": "folding_trunk.layers",
    "lm_encoder.num_hidden_layers": "lm_encoder.layers",
    "parcae_num_coda_layers": "parcae.output_stack.layers",
    "confidence_head.num_hidden_layers": "confidence_head.folding_trunk.layers",
    "atom_encoder.num_hidden_layers": "input_embedder.atom_encoder.layers",
    "structure_head.diffusion_module.num_hidden_layers": "structure_head.token_transformer.layers",
    "structure_head.diffusion_module.atom_encoder.num_hidden_layers": "structure_head.atom_encoder.layers",
    "msa_encoder.num_hidden_layers": "msa_encoder.layers",
}


def _field(config: FoldConfig, path: str) -> int:
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def check_fold_against_tensors(config: FoldConfig, names, where: str) -> None:
    """ConvertError naming ``where`` (config.json) and the field when a block count of ``config``
    is not the number of blocks the tensor ``names`` (MLX names) hold, before anything is built for
    it (a folding_trunk_num_hidden_layers of 1e9 would otherwise build a billion blocks' names)."""
    names = list(names)
    for field, prefix in STACKS.items():
        if field.startswith("msa_encoder.") and not config.msa_encoder.enabled:
            continue
        pattern = re.compile(re.escape(prefix) + r"\.(\d{1,9})\.")
        numbers = {int(m.group(1)) for n in names if (m := pattern.match(n))}
        if numbers != set(range(len(numbers))):
            shown = ", ".join(map(str, sorted(numbers)[:6]))
            raise ConvertError(
                f"{where}: the weights hold blocks of {prefix} numbered {shown}...; blocks run 0, 1, 2 ..."
            )
        if _field(config, field) != len(numbers):
            raise ConvertError(
                f"{where}: {field} is {_field(config, field):,}, but the weights hold {len(numbers)} blocks of {prefix}"
            )


# --- the artifact kind ----------------------------------------------------------------------------
def is_fold_config(raw) -> bool:
    """Whether a config.json (as a dict) describes ESMFold2 (transformers' ``model_type``)."""
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


def is_fold_directory(directory: Path) -> bool:
    """Whether ``directory`` holds an ESMFold2 artifact or checkpoint (its config.json says so)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return False
    try:
        return is_fold_config(read_json(path, ConvertError, max_bytes=1 << 20))
    except ConvertError:
        return False


def read_fold_config(directory: Path) -> tuple[dict, FoldConfig]:
    """(config.json as a dict, the ESMFold2 it describes) of an artifact, checked against its
    weights' headers (block counts, the backbone's sizes) before anything is built for it;
    ConvertError naming the file and the field."""
    raw = read_config(directory)
    path = Path(directory) / "config.json"
    if not is_fold_config(raw):
        raise ConvertError(
            f"{path}: model_type is {raw.get('model_type')!r}, not {MODEL_TYPE!r}: not an ESMFold2 model"
        )
    try:
        config = FoldConfig.from_dict(raw)
    except ConfigError as e:
        raise ConvertError(f"{path}: {e}") from None
    names = {}
    for f in weight_files(directory):
        names.update({n: tuple(t["shape"]) for n, t in safetensors_header(f).items() if n != "__metadata__"})
    backbone = {n: s for n, s in names.items() if n.startswith(BACKBONE)}
    check_against_tensors(config.esmc_config, backbone, f"{path} (esmc_config)")
    check_fold_against_tensors(config, names, str(path))
    return raw, config


def fold_files(directory: Path) -> list[str]:
    """What a fold artifact is made of: a model directory's files (``artifact.model_files``:
    config.json, the index and the weights it names, the tokenizer files); ConvertError when its
    config is not an ESMFold2's or a file is missing."""
    if not is_fold_directory(directory):
        raise ConvertError(f"{directory}: its config.json does not describe an ESMFold2 model")
    return model_files(directory)


def fold_facts(directory: Path) -> dict:
    """What ``esmc-mlx info --json`` prints of a fold artifact, numbers as numbers: the folding
    model (architecture, parameters, dtype), the backbone (architecture, parameters, storage,
    bits per weight), size on disk, shards, source."""
    directory = Path(directory)
    raw, config = read_fold_config(directory)
    files = weight_files(directory)
    tensor_files(files)  # a tensor in two shards would be counted twice
    stored: dict[str, int] = {}
    for f in files:
        for name, t in safetensors_header(f).items():
            if name != "__metadata__":
                stored[name] = t["data_offsets"][1] - t["data_offsets"][0]
    expected = expected_fold_shapes(config)
    backbone = backbone_shapes(config)
    folding = {n: s for n, s in expected.items() if n not in backbone and n not in BUFFERS}
    backbone_bytes = sum(b for n, b in stored.items() if n.startswith(BACKBONE))
    backbone_params = sum(map(math.prod, backbone.values()))
    lm, diffusion = config.esmc_config, config.structure_head.diffusion_module
    source = raw.get("esmc_mlx", {}).get("source") if isinstance(raw.get("esmc_mlx"), dict) else None
    source = source if isinstance(source, dict) else {}
    dtype = raw.get("dtype", "float32")
    return {
        "directory": str(directory),
        "kind": "fold",
        "architecture": {
            "model": "ESMFold2",
            "folding_blocks": config.folding_trunk_num_hidden_layers,
            "hidden_size": config.hidden_size,
            "pairwise_hidden_size": config.pairwise_hidden_size,
            "recycling_loops": config.num_loops,
            "diffusion_layers": diffusion.num_hidden_layers,
            "diffusion_hidden_size": diffusion.hidden_size,
            "msa_encoder": config.msa_encoder.enabled,
        },
        "folding": {
            "parameters": sum(map(math.prod, folding.values())),
            "dtype": dtype,
            "float32_tensors": sum(map(keeps_float32, expected)) if dtype != "float32" else 0,
        },
        "backbone": {
            "architecture": {
                "model": "ESMC",
                "layers": lm.num_hidden_layers,
                "hidden_size": lm.hidden_size,
                "attention_heads": lm.num_attention_heads,
                "intermediate_size": lm.intermediate_size,
            },
            "parameters": backbone_params,
            "storage": storage_text(raw, {n for n in stored if n.startswith(BACKBONE)}),
            "bits_per_weight": round(backbone_bytes * 8 / backbone_params, 3),
        },
        "parameters": sum(map(math.prod, folding.values())) + backbone_params,
        "dtype": dtype,
        "quantization": quantization_record(raw) or None,
        "size_bytes": sum(f.stat().st_size for f in files),
        "shards": len(files),
        "source": str(source.get("id", "unknown")) + (f"@{source['revision']}" if source.get("revision") else ""),
    }


def describe_fold(directory: Path) -> dict:
    """``fold_facts`` in words, what ``esmc-mlx info`` prints and the model card shows."""
    facts = fold_facts(directory)
    arch, folding, backbone = facts["architecture"], facts["folding"], facts["backbone"]
    lm = backbone["architecture"]
    kept = " (norms, Fourier features, distance bins, distogram head, parcae.log_delta in float32)"
    return {
        "directory": facts["directory"],
        "architecture": (
            f"ESMFold2, {arch['folding_blocks']} folding blocks, single {arch['hidden_size']}, "
            f"pair {arch['pairwise_hidden_size']}, {arch['recycling_loops']} recycling loops; diffusion "
            f"transformer {arch['diffusion_layers']} x {arch['diffusion_hidden_size']}"
            + (
                "; MSA encoder (its weights are kept; single-sequence folds do not read them)"
                if arch["msa_encoder"]
                else ""
            )
        ),
        "folding parameters": f"{folding['parameters']:,}",
        "folding storage": folding["dtype"] + (kept if folding["float32_tensors"] else ""),
        "backbone": (
            f"ESMC, {lm['layers']} layers, hidden {lm['hidden_size']}, {lm['attention_heads']} heads, "
            f"MLP {lm['intermediate_size']}"
        ),
        "backbone parameters": f"{backbone['parameters']:,}",
        "backbone storage": backbone["storage"],
        "backbone bits per weight": backbone["bits_per_weight"],
        "size on disk": human_size(facts["size_bytes"]),
        "shards": facts["shards"],
        "source": facts["source"],
    }


FOLD = register_artifact_kind(
    ArtifactKind("fold", "config.json", fold_files, is_fold_directory, facts=fold_facts, describe=describe_fold)
)
