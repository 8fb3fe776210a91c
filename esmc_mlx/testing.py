"""Synthetic ESMC checkpoints for tests, benchmarks and the README demo. Needs esmc-mlx[torch].

Nothing here is used by the runtime. Small checkpoints come from transformers'
``EsmcForMaskedLM`` with random weights, re-laid into the three input layouts; large ones
(300M/600M/6B shapes) are streamed tensor by tensor so that no full model is ever in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .artifact import dtype_name, expected_shapes
from .config import ESMCConfig
from .convert import tiny_fold
from .convert.mapping import GATE_UP, QKV
from .fold_artifact import keeps_float32
from .fold_config import FoldConfig
from .quantize import BLOCK_LINEAR
from .runtime.fold.model import ESMFold2
from .runtime.load import prepare
from .runtime.model import ESMC
from .runtime.quantized import quantize_modules
from .sae_artifact import SAEConfig, layer_file
from .validate.reference import hf_config
from .vocab import write_tokenizer_files

SHAPES = {  # published ESMC sizes: hidden, heads, layers
    "300M": ESMCConfig(960, 15, 30, 2560),
    "600M": ESMCConfig(1152, 18, 36, 3072),
    "6B": ESMCConfig(2560, 40, 80, 6912),
}


# The folder holding the esmc_mlx package: a checkout's root, where pyproject.toml lives.
CHECKOUT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a child Python process that must import this copy of esmc_mlx: its
    folder first on PYTHONPATH, the caller's PYTHONPATH kept behind it (a host whose MLX was
    installed with ``pip install --target`` finds it only there), then ``extra``."""
    path = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def console_command(name: str) -> list[str]:
    """The command line of the console script ``name`` (pyproject.toml's [project.scripts]) for a
    child process: the installed script, else its entry point run by this Python (a checkout
    whose package is on PYTHONPATH but not installed, as on the GPU machine)."""
    installed = shutil.which(name)
    if installed:
        return [installed]
    module, function = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["scripts"][name].split(":")
    run = f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())"
    return [sys.executable, "-c", run]  # argv[0]: click's usage and messages name the script


def tiny_config(**overrides) -> ESMCConfig:
    base = dict(
        hidden_size=128, num_attention_heads=2, num_hidden_layers=2, intermediate_size=512
    )  # 64-wide heads, as every ESMC
    base.update(overrides)
    return ESMCConfig(**base)


def random_transformers_model(config: ESMCConfig, seed: int = 0, perturb_norms: bool = True):
    """transformers' EsmcForMaskedLM with random weights. With ``perturb_norms`` every weight
    is N(0, 1/fan_in) and norms/biases are randomized too, so that a swapped or dropped
    parameter changes the output; without it, transformers' own initialization."""
    import torch
    from transformers import EsmcForMaskedLM

    torch.manual_seed(seed)
    model = EsmcForMaskedLM(hf_config(config)).eval()
    if not perturb_norms:
        return model
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_random_(name, p, generator)
    return model


def init_random_(name: str, tensor, generator=None, perturb_norms: bool = True):
    """The one random initialization of tests and benchmarks, in place on a torch tensor:
    weights N(0, 1/fan_in); norm weights 1 + N(0, 0.1) and biases N(0, 0.05) with
    ``perturb_norms`` (so that a swapped or dropped one changes the output), else 1 and 0."""
    if "norm" in name and name.endswith("weight"):
        return tensor.normal_(1.0, 0.1, generator=generator) if perturb_norms else tensor.fill_(1.0)
    if name.endswith("bias"):
        return tensor.normal_(0.0, 0.05, generator=generator) if perturb_norms else tensor.zero_()
    return tensor.normal_(0.0, tensor.shape[-1] ** -0.5, generator=generator)


def relayout(state: dict, layout: str) -> dict:
    """Published names -> the ``esm`` package's (fused, TE names), the legacy .pth's or the
    mlx-lm ESMC port's (``esmc.transformer.blocks.N.attn.{ln_qkv,qkv,...}``)."""
    import torch

    if layout == "published":
        return dict(state)
    if layout == "mlx-lm":
        return _mlx_lm_names(state)
    out, layer_ids = {}, sorted({int(k.split(".")[2]) for k in state if k.startswith("esmc.layers.")})
    te = layout == "esm"
    out["embed.weight"] = state["esmc.embed_tokens.weight"]
    for i in layer_ids:
        p, b = f"esmc.layers.{i}.", f"transformer.blocks.{i}."
        qkv = torch.cat([state[p + n] for n in QKV])
        fc1 = torch.cat([state[p + n] for n in GATE_UP])
        names = {
            "ln_w": "attn.layernorm_qkv.layer_norm_weight" if te else "attn.layernorm_qkv.0.weight",
            "ln_b": "attn.layernorm_qkv.layer_norm_bias" if te else "attn.layernorm_qkv.0.bias",
            "qkv": "attn.layernorm_qkv.weight" if te else "attn.layernorm_qkv.1.weight",
            "fln_w": "ffn.layer_norm_weight" if te else "ffn.0.weight",
            "fln_b": "ffn.layer_norm_bias" if te else "ffn.0.bias",
            "fc1": "ffn.fc1_weight" if te else "ffn.1.weight",
            "fc2": "ffn.fc2_weight" if te else "ffn.3.weight",
        }
        out[b + names["ln_w"]] = state[p + "input_layernorm.weight"]
        out[b + names["ln_b"]] = state[p + "input_layernorm.bias"]
        out[b + names["qkv"]] = qkv
        out[b + "attn.q_ln.weight"] = state[p + "self_attn.q_norm.weight"]
        out[b + "attn.k_ln.weight"] = state[p + "self_attn.k_norm.weight"]
        out[b + "attn.out_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[b + names["fln_w"]] = state[p + "post_attention_layernorm.weight"]
        out[b + names["fln_b"]] = state[p + "post_attention_layernorm.bias"]
        out[b + names["fc1"]] = fc1
        out[b + names["fc2"]] = state[p + "mlp.down_proj.weight"]
    out["transformer.norm.weight"] = state["esmc.norm.weight"]
    head = "lm_head" if te else "sequence_head"
    for idx, part in (("0", "dense"), ("2", "layer_norm"), ("3", "decoder")):
        for kind in ("weight", "bias"):
            out[f"{head}.{idx}.{kind}"] = state[f"lm_head.{part}.{kind}"]
    if te:  # the esm package keeps the encoder under an esmc. prefix when wrapped
        out = {(k if k.startswith(head) else f"esmc.{k}"): v for k, v in out.items()}
    return out


def _mlx_lm_names(state: dict) -> dict:
    """The tensor names mlx_lm.convert saves for ESMC (its modules' names after ``sanitize``)."""
    import torch

    out = {
        "esmc.embed.weight": state["esmc.embed_tokens.weight"],
        "esmc.transformer.norm.weight": state["esmc.norm.weight"],
    }
    for i in sorted({int(k.split(".")[2]) for k in state if k.startswith("esmc.layers.")}):
        p, b = f"esmc.layers.{i}.", f"esmc.transformer.blocks.{i}."
        out[b + "attn.ln_qkv.weight"] = state[p + "input_layernorm.weight"]
        out[b + "attn.ln_qkv.bias"] = state[p + "input_layernorm.bias"]
        out[b + "attn.qkv.weight"] = torch.cat([state[p + n] for n in QKV])
        out[b + "attn.q_ln.weight"] = state[p + "self_attn.q_norm.weight"]
        out[b + "attn.k_ln.weight"] = state[p + "self_attn.k_norm.weight"]
        out[b + "attn.out_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[b + "ffn.ln.weight"] = state[p + "post_attention_layernorm.weight"]
        out[b + "ffn.ln.bias"] = state[p + "post_attention_layernorm.bias"]
        out[b + "ffn.fc1.weight"] = torch.cat([state[p + n] for n in GATE_UP])
        out[b + "ffn.fc2.weight"] = state[p + "mlp.down_proj.weight"]
    for idx, part in (("0", "dense"), ("2", "layer_norm"), ("3", "decoder")):
        for kind in ("weight", "bias"):
            out[f"lm_head.{idx}.{kind}"] = state[f"lm_head.{part}.{kind}"]
    return out


def write_mlx_lm_checkpoint(model, path: Path, bits: int | None = None, group_size: int = 64) -> Path:
    """A transformers model saved as mlx-lm's ESMC port saves it (``mlx_lm.convert`` after
    ``sanitize``): config.json in its spelling (``model_type: esmc``, ``d_model``, ``n_heads``,
    ``n_layers``, ``rope_base``, ``residue_scaling_base``) and model.safetensors under its module
    names. With ``bits``, every Linear/Embedding weight whose width divides by ``group_size`` is
    affine-quantized as mlx-lm does (uint32 ``weight`` + ``scales`` + ``biases``, and a
    ``quantization`` record in config.json)."""
    import mlx.core as mx

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = _mlx_lm_names({k: v.detach().float().contiguous() for k, v in model.state_dict().items()})
    arrays = {k: mx.array(v.numpy()) for k, v in state.items()}
    c = model.config
    config = {
        "model_type": "esmc",
        "vocab_size": c.vocab_size,
        "d_model": c.hidden_size,
        "n_heads": c.num_attention_heads,
        "n_layers": c.num_hidden_layers,
        "pad_token_id": 1,
        "mask_token_id": 32,
        "expansion_ratio": 8 / 3,
        "residue_scaling_base": 36.0,
        "layer_norm_eps": 1e-5,
        "rope_base": 10000.0,
    }
    if bits:
        for name in [
            n
            for n in arrays
            if n.endswith(".weight")
            and arrays[n].ndim == 2
            and ("qkv" in n or "fc" in n or "out_proj" in n or "embed" in n or "lm_head" in n)
            and arrays[n].shape[-1] % group_size == 0
        ]:
            w, scales, biases = mx.quantize(arrays[name], group_size=group_size, bits=bits)
            module = name[: -len(".weight")]
            arrays[name], arrays[module + ".scales"], arrays[module + ".biases"] = w, scales, biases
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        config["quantization_config"] = config["quantization"]
    mx.save_safetensors(str(path / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_checkpoint(model, path: Path, layout: str = "published", dtype: str = "float32") -> Path:
    """Save a transformers model in one of the three layouts; return the file or directory.

    published: config.json + model.safetensors + tokenizer files (save_pretrained);
    esm: esm-package config spelling + model.safetensors with fused TE names;
    legacy: a bare .pth state dict (no config), as EvolutionaryScale shipped in 2024-12.
    """
    import copy

    import torch
    from safetensors.torch import save_file

    path = Path(path)
    model = copy.deepcopy(model).to(getattr(torch, dtype))  # never change the caller's model
    if layout == "published":
        from transformers import EsmcTokenizer

        model.save_pretrained(path)
        EsmcTokenizer().save_pretrained(path)
        return path
    state = relayout({k: v.detach().contiguous() for k, v in model.state_dict().items()}, layout)
    if layout == "legacy":
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    c = model.config
    (path / "config.json").write_text(
        json.dumps(
            {  # the esm package's sparser spelling
                "d_model": c.hidden_size,
                "n_heads": c.num_attention_heads,
                "n_layers": c.num_hidden_layers,
            }
        )
    )
    return path


def write_random_checkpoint(
    directory: Path,
    config: ESMCConfig,
    dtype: str = "bfloat16",
    shard_bytes: int = 5 << 30,
    seed: int = 0,
    progress: bool = False,
) -> Path:
    """A published-layout checkpoint of any size, written one tensor at a time (memory stays at
    one tensor), sharded with an index like the Hub's ESMC-6B. Weights from ``init_random_``."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(directory / name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0

    shapes = expected_shapes(config)
    for name, shape in tqdm(shapes.items(), desc="random checkpoint", disable=not progress):
        t = init_random_(name, torch.empty(shape, dtype=torch.float32), generator).to(getattr(torch, dtype))
        if size + t.numel() * t.element_size() > shard_bytes:
            flush()
        current[name] = t
        size += t.numel() * t.element_size()
    flush()
    total = len(shards)
    for i, (name, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        (directory / name).rename(directory / final)
        weight_map.update({n: final for n in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(dict(config.to_dict(), dtype=dtype), indent=2))
    return directory


def init_random_mlx_(model: nn.Module, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> nn.Module:
    """``init_random_``'s distributions drawn by MLX, in place, on the default device, in
    ``dtype``: matrices N(0, 1/fan_in), LayerNorm weights 1 + N(0, 0.1), biases N(0, 0.05).
    One layer's draws at a time: a 6B in bf16 (12 GB) never holds its fp32 draws whole."""
    mx.random.seed(seed)
    for _, leaf in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        norm = isinstance(leaf, nn.LayerNorm)
        drawn = {
            k: (1 + 0.1 * mx.random.normal(v.shape) if norm else mx.random.normal(v.shape) * v.shape[-1] ** -0.5)
            if k == "weight"
            else 0.05 * mx.random.normal(v.shape)
            for k, v in leaf.parameters().items()
        }
        leaf.update({k: v.astype(dtype) for k, v in drawn.items()})
        mx.eval(leaf.parameters())
    return model


def random_mlx_model(config: ESMCConfig, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> ESMC:
    """An ESMC with ``init_random_mlx_``'s weights, made on the default device in ``dtype``: no
    torch, no disk (a 6B in bf16 holds 12 GB and takes seconds on a GPU)."""
    return init_random_mlx_(ESMC(config), dtype, seed)


def random_mlx_fold_model(
    config: FoldConfig,
    dtype: mx.Dtype = mx.bfloat16,
    quantization: dict | None = None,
    seed: int = 0,
    model_class: type[ESMFold2] = ESMFold2,
) -> ESMFold2:
    """An ESMFold2 with random weights made on the default device, as ``load_fold`` would hold an
    artifact of that config: no torch, no disk. The backbone gets ``init_random_mlx_``'s weights a
    block at a time, its block projections quantized with ``quantization`` (a record as
    config.json's: mode, bits, group_size) by the loader's own swap, as ``esmc-convert --q`` quantizes
    them, then ``prepare`` as loaded; the folding model ``init_random_fold_``'s. A 6B backbone in
    4 bits never holds its bf16 weights whole."""
    esmc = ESMC(config.esmc_config, lm_head=False)
    for i, layer in enumerate(esmc.esmc.layers):
        init_random_mlx_(layer, dtype, seed=seed + i)
        if quantization:
            quantize_modules(layer, quantization, lambda path, i=i: BLOCK_LINEAR.fullmatch(f"esmc.layers.{i}.{path}"))
        mx.eval(layer.parameters())
    for part in (esmc.esmc.embed_tokens, esmc.esmc.norm):
        init_random_mlx_(part, dtype, seed=seed + len(esmc.esmc.layers))
    prepare(esmc)
    model = model_class(config, esmc)
    init_random_fold_(model, dtype, seed=seed)
    model.eval()
    return model


def init_random_fold_(model: ESMFold2, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> ESMFold2:
    """``init_random_``'s distributions over a folding model's own tensors (not its backbone), drawn
    by MLX in place: matrices N(0, 1/fan_in), norm weights 1 + N(0, 0.1), biases N(0, 0.05), the
    Fourier embedding's buffers N(0, 1), as ``random_transformers_fold_model`` draws them; the
    confidence head's distance bins keep their values. What transformers keeps in float32
    (``fold_artifact.keeps_float32``) is float32, the rest ``dtype``."""
    mx.random.seed(seed)
    drawn = []
    for name, v in tree_flatten(model.parameters()):
        if name.endswith("boundaries"):
            value = v
        elif name.endswith(("frequencies", "phases")):
            value = mx.random.normal(v.shape)
        elif "norm" in name and name.endswith("weight"):
            value = 1 + 0.1 * mx.random.normal(v.shape)
        elif name.endswith("bias"):
            value = 0.05 * mx.random.normal(v.shape)
        else:
            value = mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        drawn.append((name, value.astype(mx.float32 if keeps_float32(name) else dtype)))
        mx.eval(drawn[-1][1])
    model.load_weights(drawn, strict=True)
    return model


def write_random_artifact(directory: Path, config: ESMCConfig, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> Path:
    """An esmc-mlx artifact (config.json, model.safetensors, tokenizer files) with the weights
    of ``random_mlx_model``: what ``load`` reads, without a checkpoint or a conversion."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(random_mlx_model(config, dtype, seed).parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(dict(config.to_dict(), dtype=dtype_name(dtype)), indent=2))
    write_tokenizer_files(directory)
    return directory


def write_random_sae(
    directory: Path,
    d_model: int,
    codebook_dim: int,
    k: int,
    layers,
    residual: bool = False,
    seed: int = 0,
    idf_max: bool = True,
) -> Path:
    """An SAE folder in the published layout (config.json, layer_{i}.safetensors in float32)
    with random weights: W_enc and W_dec N(0, 1/fan_in), b_dec N(0, 0.1); with ``idf_max``,
    idf in [0.5, 3) and max in [1, 5) (else ones, as esm's default). Drawn with numpy, one layer
    at a time."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    layers = sorted(set(layers))
    config = SAEConfig(d_model, codebook_dim, k, tuple(layers), residual)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    for i in layers:
        normal = rng.standard_normal
        tensors = {
            "W_enc": (normal((d_model, codebook_dim), np.float32) * d_model**-0.5).astype(np.float32),
            "W_dec": (normal((codebook_dim, d_model), np.float32) * codebook_dim**-0.5).astype(np.float32),
            "b_dec": (0.1 * normal(d_model, np.float32)).astype(np.float32),
            "idf": rng.uniform(0.5, 3.0, codebook_dim).astype(np.float32)
            if idf_max
            else np.ones(codebook_dim, np.float32),
            "max": rng.uniform(1.0, 5.0, codebook_dim).astype(np.float32)
            if idf_max
            else np.ones(codebook_dim, np.float32),
        }
        save_file(tensors, str(directory / layer_file(i)))
    return directory


def random_sequences(
    n: int, min_len: int = 5, max_len: int = 60, seed: int = 0, alphabet: str = "ACDEFGHIKLMNPQRSTVWY"
) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(alphabet), size=rng.integers(min_len, max_len + 1))) for _ in range(n)]


def tiny_fold_config(**overrides) -> dict:
    """A small ESMFold2 config in transformers' spelling (``EsmFold2Config.from_dict`` reads it):
    tiny-fold's (every part of the published architecture, a few blocks each) on a 2-block ESMC of
    width 128, with chunks of 8 rows (so that short test proteins run the chunked paths) and 2
    samples of 6 steps. Keyword arguments replace top-level fields (nested ones are dicts)."""
    base = tiny_fold.tiny_fold_config(hf_config(tiny_config()).to_dict())
    for key in ("architectures", "dtype"):
        del base[key]
    base["chunk_size"] = 8
    base["structure_head"] = {**base["structure_head"], "num_diffusion_samples": 2, "inference_num_steps": 6}
    base.update(overrides)
    return base


def random_transformers_fold_model(config: dict | None = None, seed: int = 0):
    """transformers' EsmFold2Model with every weight random (``init_random_``), the zero-initialised
    gates and heads included, so that a dropped or swapped tensor changes the fold; the
    confidence head's distance ``boundaries`` keep their values (a buffer, not a weight)."""
    import torch
    from transformers import EsmFold2Config, EsmFold2Model

    torch.manual_seed(seed)
    model = EsmFold2Model(EsmFold2Config.from_dict(config or tiny_fold_config())).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_random_(name, p, generator)
        for name, b in model.named_buffers():
            if name.endswith(("frequencies", "phases")):
                b.normal_(0.0, 1.0, generator=generator)
    return model


def write_fold_checkpoint(path: Path, config: dict | None = None, seed: int = 0, dtype: str = "float32") -> Path:
    """An ESMFold2 checkpoint as transformers saves one (``save_pretrained``: config.json,
    model.safetensors) with ESMC's tokenizer files beside it, from
    ``random_transformers_fold_model(config, seed)``. A half ``dtype`` is what transformers makes
    of it: loaded with ``from_pretrained(dtype=...)`` (its float32-pinned tensors stay float32)
    and saved again."""
    import torch
    from transformers import EsmcTokenizer, EsmFold2Model

    path = Path(path)
    model = random_transformers_fold_model(config, seed)
    if dtype != "float32":
        with tempfile.TemporaryDirectory() as full:  # read back from elsewhere: it may be memory-mapped
            model.save_pretrained(full)
            model = EsmFold2Model.from_pretrained(full, dtype=getattr(torch, dtype))
            model.save_pretrained(path)
    else:
        model.save_pretrained(path)
    EsmcTokenizer().save_pretrained(path)
    return path
