"""The fourth source layout: checkpoints saved by mlx-lm's ESMC port (ml-explore/mlx-lm PR 1484)
convert, validate and match transformers' logits; mlx-lm-quantized ones are dequantized."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from esmc_mlx.cli import main
from esmc_mlx.config import ESMCConfig
from esmc_mlx.convert import convert
from esmc_mlx.convert.sources import detect_layout, open_checkpoint
from esmc_mlx.errors import ConfigError
from esmc_mlx.resolve import resolve
from esmc_mlx.testing import write_mlx_lm_checkpoint
from tests.test_convert import logits, reference_logits


@pytest.fixture(scope="module")
def mlx_lm_dir(reference_model, tmp_path_factory):
    return write_mlx_lm_checkpoint(reference_model, tmp_path_factory.mktemp("mlxlm") / "esmc-mlx-lm")


def test_layouts_are_told_apart(checkpoints, mlx_lm_dir):
    from safetensors import safe_open

    def names(d):
        with safe_open(str(d / "model.safetensors"), "np") as f:
            return list(f.keys())

    assert detect_layout(names(mlx_lm_dir)) == "mlx-lm"
    assert detect_layout(names(checkpoints["esm"])) == "esm"
    assert detect_layout(names(checkpoints["published"])) == "published"


def test_mlx_lm_layout_converts_to_transformers_logits(mlx_lm_dir, reference_model, tmp_path):
    out = convert(str(mlx_lm_dir), tmp_path / "out", progress=False)
    expected = reference_logits(reference_model)
    got = logits(out)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (128, 2, 2)


def test_mlx_lm_quantized_is_dequantized(reference_model, tmp_path):
    src = write_mlx_lm_checkpoint(reference_model, tmp_path / "q8", bits=8)
    raw = mx.load(str(src / "model.safetensors"))
    assert raw["esmc.transformer.blocks.0.attn.qkv.weight"].dtype == mx.uint32
    ckpt = open_checkpoint(resolve(str(src)))
    assert not [n for n in ckpt.shapes if n.endswith((".scales", ".biases"))]
    assert ckpt.shapes["esmc.transformer.blocks.0.attn.qkv.weight"] == (384, 128)
    want = mx.dequantize(
        raw["esmc.transformer.blocks.0.attn.qkv.weight"],
        raw["esmc.transformer.blocks.0.attn.qkv.scales"],
        raw["esmc.transformer.blocks.0.attn.qkv.biases"],
        group_size=64,
        bits=8,
    )
    assert mx.array_equal(ckpt.read("esmc.transformer.blocks.0.attn.qkv.weight"), want)
    out = convert(str(src), tmp_path / "out", progress=False)
    # transformers with the dequantized weights gives the converted model's logits
    import copy

    from safetensors.torch import load_file

    dequantized = copy.deepcopy(reference_model)
    state = {}
    for f in out.glob("*.safetensors"):
        state.update(load_file(str(f)))
    dequantized.load_state_dict(state, strict=True)
    expected, got = reference_logits(dequantized), logits(out)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 1e-5
    float_logits = reference_logits(reference_model)
    assert 1e-4 < np.linalg.norm(got - float_logits) / np.linalg.norm(float_logits) < 0.1  # 8-bit, not float


def test_validate_accepts_the_mlx_lm_layout_as_reference(mlx_lm_dir, converted, tmp_path):
    r = CliRunner().invoke(
        main,
        ["validate", str(converted), "--reference", str(mlx_lm_dir), "--quick", "--report", str(tmp_path / "report")],
    )
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["passed"]


def test_mlx_lm_config_spelling():
    c = ESMCConfig.from_dict(
        {
            "model_type": "esmc",
            "d_model": 960,
            "n_heads": 15,
            "n_layers": 30,
            "rope_base": 5000.0,
            "residue_scaling_base": 36.0,
        }
    )
    assert (c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.rope_theta) == (960, 15, 30, 5000.0)
    assert c.intermediate_size == 2560
    with pytest.raises(ConfigError, match="residue_scaling_base"):
        ESMCConfig.from_dict({"d_model": 960, "n_heads": 15, "n_layers": 30, "residue_scaling_base": 48})
