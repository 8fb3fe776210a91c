"""Quantization: every mode round-trips, runs like its dequantized twin, has the size its bits
say, mixed recipes give the documented bits, and bad input fails clearly."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import requires_torch
from mlx.utils import tree_flatten

from esmc_mlx import load, settings, testing
from esmc_mlx.artifact import describe, safetensors_header
from esmc_mlx.cli import convert_main, main
from esmc_mlx.convert import convert
from esmc_mlx.convert import quantize_directory as quantize
from esmc_mlx.errors import QuantizeError
from esmc_mlx.quantize import SPECS, QuantPlan, quantize_tensor
from esmc_mlx.runtime import dispatch
from esmc_mlx.runtime import quantized as rq
from esmc_mlx.runtime.cuda import dequantize as cuda_dequantize
from esmc_mlx.runtime.cuda import fusions

SEQS = ["MKTAYIAKQRQISFVKSHF", "GSHMSLFDKLG", "ACDEFGHIKLMNPQRSTVWY"]  # 3 x 22 = 66 tokens
MODES = [s for s in SPECS if not s.startswith("mixed")] + ["mixed_3_6"]


@pytest.fixture(scope="module")
def quantized(converted, tmp_path_factory):
    """Every spec (and two --quantize-head variants), quantized from the fp32 MLX directory."""
    root = tmp_path_factory.mktemp("quantized")
    out = {spec: quantize(converted, root / spec, spec, progress=False) for spec in SPECS}
    for spec in ("4", "mixed_4_6"):
        out[f"{spec}+head"] = quantize(converted, root / f"{spec}-head", spec, quantize_head=True, progress=False)
    return out


def logits(model):
    batch = model_tokenizer(SEQS)
    return np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits)


def model_tokenizer(seqs):
    from esmc_mlx import ESMCTokenizer

    return ESMCTokenizer()(seqs)


def tensors(directory):
    out = {}
    for f in sorted(directory.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("spec", MODES + ["4+head"])
def test_round_trip_same_tensors_and_outputs(spec, quantized, converted):
    """Saved tensors are exactly mx.quantize of the float weights, and the loaded model gives
    exactly the outputs of the same quantization done in memory. Both models unfused: the
    artifact's layout (on a GPU, load fuses q/k/v and gate/up by default)."""
    record = json.loads((quantized[spec] / "config.json").read_text())["quantization"]
    model, _ = load(converted, fuse=False)
    plan = QuantPlan.parse(spec.split("+")[0], None, model.config, quantize_head=spec.endswith("+head"))
    weights, layers = {}, {}
    for name, w in tree_flatten(model.parameters()):
        params = plan.params_for(name, w.shape)
        if params:
            weights.update(quantize_tensor(name, w, params))
            layers[name[: -len(".weight")]] = params
        else:
            weights[name] = w
    assert plan.record(layers) == record
    saved = tensors(quantized[spec])
    assert saved.keys() == weights.keys()
    for name, t in saved.items():
        assert mx.array_equal(t, weights[name]), name
    rq.quantize_modules(model, record, lambda p: f"{p}.scales" in weights)
    model.load_weights(list(weights.items()))
    loaded, _ = load(quantized[spec], fuse=False)
    assert np.array_equal(logits(loaded), logits(model))


@pytest.mark.parametrize("path", ["quantized", "dequantize"])
@pytest.mark.parametrize("spec", MODES + ["mixed_4_6+head"])
def test_runtime_equals_dequantized_weights(spec, path, quantized, monkeypatch):
    """Both execution paths compute the model whose weights are the dequantized ones."""
    model, _ = load(quantized[spec])
    kinds = {type(m) for _, m in model.named_modules()}
    assert rq.QuantizedLinear in kinds and (nn.Linear in kinds) == ("head" not in spec)  # head: float unless asked
    with settings.override(path=path):
        got = logits(model)
    twin = rq.dequantize_model(load(quantized[spec])[0])
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in twin.named_modules())
    assert rel(got, logits(twin)) < 1e-5


def test_policy_picks_path_by_token_count(quantized, monkeypatch, on_cpu):
    """On the CPU (its table and unfused layout): below the crossover quantized_matmul, from it
    dequantize + matmul, with the same outputs."""
    target = dispatch.current()
    target = dataclasses.replace(target, tuning=dataclasses.replace(target.tuning, crossover={"all": {"affine": 8}}))
    calls = []
    original = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or original(*a, **k))
    model, _ = load(quantized["4"])
    layer = model.esmc.layers[0].mlp.up_proj
    assert isinstance(layer, rq.QuantizedLinear)
    small, large = mx.ones((1, 7, 128)), mx.ones((2, 4, 128))  # 7 tokens, 8 tokens
    with dispatch.use(target):
        y_small = layer(small)
        assert not calls and layer.plan(7, mx.float32).path == "quantized"
        y_large = layer(large)
        assert calls and layer.plan(8, mx.float32).path == "dequantize"
    assert np.allclose(np.array(y_small[0, 0]), np.array(y_large[0, 0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", MODES)
def test_size_matches_bits_per_weight(spec, quantized, converted):
    """Quantized layers hold exactly bits + scale/bias bits per group; the file shrinks as that says."""
    record = json.loads((quantized[spec] / "config.json").read_text())["quantization"]
    header = {}
    for f in quantized[spec].glob("model*.safetensors"):
        header.update({k: v for k, v in safetensors_header(f).items() if k != "__metadata__"})
    nbytes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}
    layers = sorted({k[: -len(".scales")] for k in header if k.endswith(".scales")})
    assert len(layers) == 7 * 2  # 7 projections x 2 blocks; embedding and head stay float
    expected_total, fp32_total = 0, sum(nbytes.values())
    for layer in layers:
        p = record.get(layer, record)
        out_dims, packed = header[f"{layer}.weight"]["shape"]
        n = out_dims * packed * 32 // p["bits"]
        per_group = {"affine": 2 * 32, "mxfp4": 8, "mxfp8": 8, "nvfp4": 8}[p["mode"]]  # fp32 scale+bias / e8m0 / e4m3
        expected_bits = n * p["bits"] + n // p["group_size"] * per_group
        got = sum(nbytes.get(f"{layer}.{part}", 0) for part in ("weight", "scales", "biases"))
        assert got * 8 == expected_bits, layer
        expected_total += expected_bits // 8
        fp32_total += n * 4 - got
    float_rest = sum(v for k, v in nbytes.items() if k.rsplit(".", 1)[0] not in layers)
    files = list(quantized[spec].glob("model*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    assert size - headers == expected_total + float_rest  # nothing but the tensors' own bytes
    float_size = sum(f.stat().st_size for f in converted.glob("model*.safetensors"))
    # headers are ~1% of a tiny model's files (negligible at 300M+)
    assert size / float_size == pytest.approx((expected_total + float_rest) / fp32_total, rel=0.03)
    facts = describe(quantized[spec])
    assert facts["bits per weight"] == pytest.approx(
        sum(nbytes.values()) * 8 / testing.tiny_config().num_parameters, abs=1e-3
    )


def test_bfloat16_affine_4_is_4_5_bits(checkpoints, tmp_path):
    out = convert(str(checkpoints["published"]), tmp_path / "bf16-4", dtype="bfloat16", q="4", progress=False)
    header = safetensors_header(out / "model.safetensors")
    name = "esmc.layers.0.mlp.down_proj"
    bits = (
        sum(
            header[f"{name}.{p}"]["data_offsets"][1] - header[f"{name}.{p}"]["data_offsets"][0]
            for p in ("weight", "scales", "biases")
        )
        * 8
    )
    assert bits / (128 * 512) == 4.5


def test_mixed_recipe_assigns_documented_bits(quantized):
    # 16 blocks: first and last eighth (0, 1, 14, 15) and every third between (4, 7, 10, 13)
    config = testing.tiny_config(num_hidden_layers=16)
    plan = QuantPlan.parse("mixed_4_6", None, config)
    for layer in range(16):
        for module in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            high = layer in (0, 1, 4, 7, 10, 13, 14, 15) and module in ("self_attn.v_proj", "mlp.down_proj")
            params = plan.params_for(f"esmc.layers.{layer}.{module}.weight", (128, 512))
            assert (params.bits, params.mode, params.group_size) == ((6 if high else 4), "affine", 64)
    assert plan.params_for("lm_head.decoder.weight", (64, 128)) is None  # head stays float by default
    head_plan = QuantPlan.parse("mixed_3_6", 32, config, quantize_head=True)
    assert head_plan.params_for("lm_head.decoder.weight", (64, 128)).bits == 6
    assert head_plan.params_for("esmc.embed_tokens.weight", (64, 128)).bits == 6
    # ESMC-300M's 30 blocks
    plan30 = QuantPlan.parse("mixed_3_6", None, testing.SHAPES["300M"])
    high30 = [i for i in range(30) if plan30.params_for(f"esmc.layers.{i}.mlp.down_proj.weight", (960, 2560)).bits == 6]
    assert high30 == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    # the artifact: 2 blocks -> block 1 is the last eighth; the runtime rebuilds those bits
    model, _ = load(quantized["mixed_3_6"])
    bits = {p: m.bits for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert bits["esmc.layers.1.self_attn.v_proj"] == bits["esmc.layers.1.mlp.down_proj"] == 6
    assert {b for p, b in bits.items() if not p.endswith(("1.self_attn.v_proj", "1.mlp.down_proj"))} == {3}


def test_quantize_head_option(quantized):
    model, _ = load(quantized["4+head"])
    assert isinstance(model.esmc.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.lm_head.decoder, rq.QuantizedLinear) and isinstance(model.lm_head.dense, rq.QuantizedLinear)
    assert isinstance(model.lm_head.layer_norm, nn.LayerNorm)
    plain, _ = load(quantized["4"])
    assert isinstance(plain.esmc.embed_tokens, nn.Embedding) and isinstance(plain.lm_head.decoder, nn.Linear)
    assert "norms float32" in describe(quantized["4+head"])["storage"]


def test_quantize_command_equals_convert_q(checkpoints, converted, tmp_path):
    result = CliRunner().invoke(main, ["quantize", str(converted), "-o", str(tmp_path / "cli"), "--q", "nvfp4"])
    assert result.exit_code == 0, result.output
    direct = convert(str(checkpoints["published"]), tmp_path / "direct", q="nvfp4", progress=False)
    a, b = tensors(tmp_path / "cli"), tensors(direct)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    assert config["esmc_mlx"]["quantization"] == {"spec": "nvfp4", "quantize_head": False}
    assert config["esmc_mlx"]["source"]["derived_from"]["id"] == checkpoints["published"].name  # no local path
    info = CliRunner().invoke(main, ["info", str(tmp_path / "cli")])
    assert "nvfp4 4-bit, group size 16" in info.output and "bits per weight" in info.output
    assert "size on disk" in info.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--q", "7"], "not a quantization spec"),
        (["--q", "int4"], "not a quantization spec"),
        (["--q", "4", "--group-size", "48"], "--group-size 48 is not one of 32, 64, 128"),
        (["--q", "mxfp4", "--group-size", "64"], "fixed group size of 32"),
        (["--q", "nvfp4", "--group-size", "32"], "fixed group size of 16"),
        (["--group-size", "32"], "need --q"),
        (["--quantize-head"], "need --q"),
    ],
)
def test_bad_spec_or_group_size(args, message, checkpoints, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(convert_main, [str(checkpoints["published"]), "-o", str(out), *args])
    assert result.exit_code == 1 and "Error: " in result.output and message in result.output, result.output
    assert not out.exists() and "Traceback" not in result.output


def test_group_size_that_does_not_divide_the_width(tmp_path):
    requires_torch()  # write_random_checkpoint saves with safetensors.torch
    source = testing.write_random_checkpoint(
        tmp_path / "w192", testing.tiny_config(hidden_size=192, num_attention_heads=3), dtype="float32"
    )
    with pytest.raises(QuantizeError, match=r"esmc.layers.0.self_attn.q_proj: input width 192 .* group size 128"):
        convert(str(source), tmp_path / "out", q="4", group_size=128, progress=False)
    assert not (tmp_path / "out").exists()
    convert(str(source), tmp_path / "ok", q="4", group_size=64, progress=False)  # 192 = 3 x 64


def test_api_group_size_not_an_int_is_named(converted, tmp_path):
    # a group size that is not an int is named as such (not "64 is not one of 32, 64, 128"), and
    # 64.0 is not taken as 64
    for q, bad in (("4", "64"), ("mixed_3_6", "64"), ("4", 64.0), ("4", True), ("mxfp4", "32")):
        with pytest.raises(QuantizeError, match=r"group_size=.*: give an int, one of 32, 64, 128"):
            quantize(converted, tmp_path / "q", q, group_size=bad, progress=False)
        with pytest.raises(QuantizeError, match=r"group_size=.*: give an int, one of 32, 64, 128"):
            convert(str(converted), tmp_path / "c", q=q, group_size=bad, progress=False)
    assert not list(tmp_path.iterdir())


def test_already_quantized_is_refused(quantized, tmp_path):
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize(quantized["mxfp4"], tmp_path / "again", "4", progress=False)
    with pytest.raises(QuantizeError, match="already quantized"):
        convert(str(quantized["4"]), tmp_path / "again", progress=False)
    result = CliRunner().invoke(main, ["quantize", str(quantized["8"]), "-o", str(tmp_path / "x"), "--q", "4"])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and "already quantized" in result.output
    assert not (tmp_path / "again").exists() and not (tmp_path / "x").exists()


def test_quantize_refuses_several_specs(converted, tmp_path):
    """esmc-mlx quantize --q 4 --q 8 wrote only the 8-bit model without a word (click keeps the
    last value of a single option), where esmc-convert --q 4 --q 8 writes both."""
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", str(converted), "-o", str(out), "--q", "4", "--q", "8"])
    assert result.exit_code == 2 and "give one spec here, got 2 (4, 8)" in result.output, result.output
    assert not out.exists()
    result = CliRunner().invoke(main, ["quantize", str(converted), "-o", str(out), "--q", "4"])
    assert result.exit_code == 0 and json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4


def test_a_fused_plan_falls_back_where_the_kernel_cannot_take_the_call(quantized, on_cpu):
    """A fused plan whose call the kernel cannot take (here fp32 inputs on the CPU) runs
    dequantize + matmul by MLX's ops, with the plan's output."""
    model, _ = load(quantized["4"])
    layer = model.esmc.layers[0].mlp.up_proj
    x = mx.ones((1, 70, 128))
    expected = layer(x)
    fused = dispatch.Plan("fused", (dispatch.Launch("esmc_qmm_2d", "sm_80"),), "forced", "2d", 1)
    np.testing.assert_allclose(np.array(layer.run(x, fused)), np.array(expected), rtol=1e-5, atol=1e-5)


HOPPER_AS_PLANNED = dispatch.Target.of(dispatch.Device("cuda", "sm_90a", 132), force="dequantize")


@pytest.mark.parametrize("spec", ["4", "mixed_4_6"])
def test_a_blocks_dequantizes_go_in_one_call(spec, quantized, monkeypatch, on_cpu):
    """Where a block's quantized linears take dequantize + matmul on a CUDA GPU, their weights
    come from one dequantize_together call per block and setting (the kernel runs on CUDA only:
    here a stand-in returns mx.dequantize's weights, planned for an H200), and the layers
    multiply by exactly those; with MLX's plain ops, or another path, nothing is asked."""
    model, _ = load(quantized[spec])
    expected = logits(model)
    calls = []

    def stand_in(parts, group_size, bits, mode, dtype, max_blocks, scale=1.0):
        calls.append((bits, len(parts)))
        ws = [mx.dequantize(w, s, b, group_size=group_size, bits=bits, mode=mode, dtype=dtype) for w, s, b in parts]
        return mx.concatenate([w.reshape(-1) for w in ws]) * scale

    monkeypatch.setattr(cuda_dequantize, "dequantize_together", stand_in)
    with dispatch.use(HOPPER_AS_PLANNED):
        logits(model)
        assert not calls  # the CPU's plain ops: nothing asked
        model.use_ops(fusions.CUDA)
        np.testing.assert_array_equal(logits(model), expected)
    expected_calls = Counter()  # per block: one call per bit width, with that width's linears
    for layer in model.esmc.layers:
        widths = Counter(m.bits for _, m in layer.named_modules() if isinstance(m, rq.QuantizedLinear))
        expected_calls.update(widths.items())
    assert Counter(calls) == expected_calls and len({b for b, _ in calls}) == (1 if spec == "4" else 2)
    linears = [m for _, m in model.named_modules() if isinstance(m, rq.QuantizedLinear)]
    assert all(m.given_transposed is None for m in linears)  # only while the block runs
    monkeypatch.setattr(cuda_dequantize, "dequantize_together", lambda *a: stand_in(*a, scale=0.0))
    with dispatch.use(HOPPER_AS_PLANNED):
        assert not np.array_equal(logits(model), expected)  # the given weights are what they multiply
    calls.clear()
    with dispatch.use(dataclasses.replace(HOPPER_AS_PLANNED, force="quantized")):
        logits(model)
    assert not calls


@pytest.mark.parametrize("in_dims,out_dims", [(64, 192), (256, 64)])
def test_plans_key_the_tables_by_the_weights_smaller_dimension(in_dims, out_dims, on_cpu):
    layer = rq.QuantizedLinear(in_dims, out_dims, bias=False, group_size=64, bits=4)
    spec = layer.weight_spec(dispatch.current())
    assert (spec.rows, spec.k, spec.width) == (out_dims, in_dims, min(in_dims, out_dims))


@pytest.mark.parametrize(
    "in_dims,group_size,narrow", [(64, 64, True), (128, 128, True), (128, 64, False), (256, 128, False)]
)
def test_weights_one_group_wide_never_take_mlx_quantized_matmul_on_cuda(in_dims, group_size, narrow, on_cpu):
    """On CUDA a weight no wider than one group goes by dequantize + matmul at every token
    count, even with quantized_matmul forced: MLX's quantized_matmul gave changing outputs there
    on the H200, or never returned. Wider weights, and every weight on the CPU, keep quantized
    (forced). The plan for CUDA runs here on the CPU against dequantize + matmul; test_kernels'
    test_narrow_quantized_linears_match_dequantize_on_cuda runs it on the GPU."""
    layer = rq.QuantizedLinear(in_dims, 192, bias=False, group_size=group_size, bits=4)
    cpu = dataclasses.replace(dispatch.current(), force="quantized")
    cuda = dataclasses.replace(HOPPER_AS_PLANNED, force="quantized")
    for target, expected in ((cpu, "quantized"), (cuda, "dequantize" if narrow else "quantized")):
        with dispatch.use(target):
            assert {layer.plan(rows, mx.float32).path for rows in (1, 3, 16, 4096)} == {expected}
    x = mx.random.normal((1, 3, in_dims), key=mx.random.key(0))
    ref = x @ mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=group_size, bits=4).T
    with dispatch.use(cuda):
        np.testing.assert_allclose(np.array(layer(x)), np.array(ref), rtol=1e-5, atol=1e-5)
