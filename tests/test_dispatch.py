"""What runs where (runtime/dispatch.py): every NVIDIA architecture MLX supports gets plans it can
run, tables apply only where they were measured, and the plans are what the tables say."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from esmc_mlx import settings
from esmc_mlx.bench import config_for
from esmc_mlx.cli import main
from esmc_mlx.runtime import dispatch
from esmc_mlx.runtime.dispatch import HOPPER, Device, Target, Weight

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100")
MODES = [("affine", b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
MODES += [("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)]
TOKENS = (
    1,
    7,
    8,
    16,
    32,
    64,
    65,
    96,
    128,
    129,
    200,
    256,
    257,
    383,
    384,
    512,
    1023,
    1024,
    2048,
    2049,
    4096,
    4097,
    32768,
)
ROOT = Path(__file__).resolve().parent.parent


def block_weights(model: str, mode: str, bits: int, group: int, scales: str = "bfloat16") -> list[Weight]:
    """A block's four weights of ``model`` as the GPU layout has them (q/k/v and gate/up fused)."""
    c = config_for(model)
    d, f = c.hidden_size, c.intermediate_size
    scales = scales if mode == "affine" else "uint8"
    return [Weight(mode, bits, group, rows, k, scales) for rows, k in ((3 * d, d), (d, d), (2 * f, d), (d, f))]


def targets(arch: str):
    """The targets a device of ``arch`` can be in: CUTLASS built or not, custom kernels on or
    off, each forced path."""
    device = Device.parse(f"cuda:{arch}")
    for cutlass, kernels, force in itertools.product((True, False), (True, False), (None, *settings.PATHS)):
        yield Target.of(device, cutlass=cutlass and device.runs("sm_90a"), kernels=kernels, force=force)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_plan_needs_a_newer_architecture_than_its_device(arch):
    """Forced to each architecture MLX's CUDA backend runs on, every plan for every ESMC shape,
    quantization, dtype, token count and setting launches only kernels that device runs; and
    on a device without a measured table, only MLX's ops and the portable kernels."""
    seen = set()
    for target in targets(arch):
        device = target.device
        for model, (mode, bits, group), dtype in itertools.product(("300M", "6B"), MODES, dispatch.FLOATS):
            for w in block_weights(model, mode, bits, group):
                for tokens in TOKENS:
                    for added in (False, True):
                        plan = dispatch.linear(w, tokens, dtype, target, added)
                        for launch in plan.kernels:
                            seen.add((launch.name.partition(":")[0], launch.requires))
                            assert device.runs(launch.requires), (arch, w, tokens, dtype, target, plan)
        for dtype, tokens in itertools.product(dispatch.FLOATS, TOKENS):
            for plan in (
                dispatch.attention_heads(64, True, dtype, target),
                dispatch.residual_norm(tokens * 2560, dtype, target),
            ):
                assert all(device.runs(k.requires) for k in plan.kernels)
                seen.update((k.name, k.requires) for k in plan.kernels)
    custom = {name for name, requires in seen if requires is not None}
    if arch == "sm_90a":  # the measured table: the whole stack
        assert {"esmc_qmm_wg", "esmc_qmm_2d", "esmc_qmm_1d", "cutlass_qmm", "esmc_add_layer_norm"} <= custom
    else:  # no table: MLX's ops and the portable kernels
        assert custom == {f"esmc_{name}" for name in dispatch.PORTABLE}


def test_the_warpgroup_tile_is_chosen_on_hopper_only():
    """The fused kernel's wgmma tile (sm_90a PTX) from 129 tokens on Hopper; a device of another
    architecture that were given Hopper's table would still get the 2d tile (mma.sync, sm_80)."""
    w = block_weights("6B", "affine", 4, 64)[0]
    hopper = Target.of(Device.parse("cuda:sm_90a"), force="fused")
    assert dispatch.linear(w, 256, "bfloat16", hopper).tile == "wg"
    assert dispatch.linear(w, 128, "bfloat16", hopper).tile == "2d"
    assert dispatch.linear(w, 64, "bfloat16", hopper).tile == "1d-64"
    for arch in ("sm_80", "sm_89", "sm_100"):
        lent = Target(Device.parse(f"cuda:{arch}"), HOPPER, force="fused")  # a table not measured there
        plan = dispatch.linear(w, 256, "bfloat16", lent)
        assert plan.tile == "2d" and plan.kernels[0].requires == "sm_80", plan


def test_devices_run_kernels_by_architecture():
    assert Device.parse("cuda:sm_90a").runs("sm_90a") and not Device.parse("cuda:sm_100").runs("sm_90a")
    assert all(Device.parse(f"cuda:{a}").runs("sm_80") for a in ARCHS)
    assert not Device.parse("cuda:sm_75").runs("sm_80")
    for name in ("cpu", "metal"):
        assert Device.parse(name).runs(None) and not Device.parse(name).runs("sm_80")
    for bad in ("cuda", "cuda:80", "gpu:sm_80", "cpu:x", "cuda:sm_8x"):
        with pytest.raises(ValueError):
            Device.parse(bad)


def test_hopper_tables_split_the_small_models_from_the_6b():
    """The 300M's and 600M's weights take the "small" entries, every 6B weight (o_proj included)
    the "large" ones, by the smaller dimension against small_width."""

    def tables(model):
        return {id(dispatch._table(HOPPER, w, HOPPER.crossover)) for w in block_weights(model, "affine", 8, 64)}

    assert tables("300M") == tables("600M") == {id(HOPPER.crossover["small"])}
    assert tables("6B") == {id(HOPPER.crossover["large"])}
    mlx_only = Target.of(Device.parse("cuda:sm_90a"), kernels=False)  # the tables' MLX-op crossover alone
    o_6b, o_300m = block_weights("6B", "affine", 8, 64)[1], block_weights("300M", "affine", 8, 64)[1]
    assert [dispatch.linear(o_6b, t, "bfloat16", mlx_only).path for t in (31, 32)] == ["quantized", "dequantize"]
    assert [dispatch.linear(o_300m, t, "bfloat16", mlx_only).path for t in (127, 128)] == ["quantized", "dequantize"]


def test_hopper_paths_by_token_count():
    """On the H200's table, the 6B in affine4 with CUTLASS built: MLX's quantized_matmul below the
    fused kernel's window, the fused kernel in it until CUTLASS takes over, CUTLASS up to its
    token count, then dequantize + matmul; without CUTLASS the fused window runs to its end."""
    built = Target.of(Device.parse("cuda:sm_90a"), cutlass=True)
    unbuilt = dataclasses.replace(built, cutlass=False)
    qkv, o, gate_up, down = block_weights("6B", "affine", 4, 64)
    path = {t: dispatch.linear(qkv, t, "bfloat16", built).path for t in (1, 7, 8, 64, 127, 128, 256, 2048, 2049)}
    assert path == {
        1: "quantized",
        7: "quantized",
        8: "fused",
        64: "fused",
        127: "fused",
        128: "cutlass",
        256: "cutlass",
        2048: "cutlass",
        2049: "dequantize",
    }
    assert [dispatch.linear(qkv, t, "bfloat16", unbuilt).path for t in (128, 256, 257)] == [
        "fused",
        "fused",
        "dequantize",
    ]
    o_plan = dispatch.linear(o, 256, "bfloat16", built)  # few tiles: split-K fills the SMs
    assert o_plan.path == "cutlass" and o_plan.tile == "split-k" and o_plan.splits == 5
    assert dispatch.linear(down, 256, "bfloat16", built).splits == 6
    assert dispatch.linear(gate_up, 1024, "bfloat16", built).tile == "stream-k"
    # fp32 inputs: neither the fused kernel (tensor cores take bf16/fp16) nor CUTLASS (bf16)
    assert dispatch.linear(qkv, 64, "float32", built).path == "dequantize"


def test_no_table_means_mlx_own_quantized_matmul():
    """An A100, a Metal GPU: MLX's quantized_matmul at every token count (as mlx-lm), except where
    MLX's CUDA kernel fails (K no wider than a group): there mx.dequantize + matmul."""
    for name in ("cuda:sm_80", "metal"):
        target = Target.of(Device.parse(name), cutlass=True)
        for tokens in TOKENS:
            plan = dispatch.linear(block_weights("6B", "affine", 4, 64)[0], tokens, "bfloat16", target)
            assert plan.path == "quantized" and "no measured table" in plan.reason
    narrow = Weight("affine", 4, 64, 128, 64)
    plan = dispatch.linear(narrow, 1, "bfloat16", Target.of(Device.parse("cuda:sm_80")))
    assert plan.path == "dequantize" and [k.name for k in plan.kernels] == ["mx.dequantize", "mx.matmul"]
    forced = Target.of(Device.parse("cuda:sm_80"), force="quantized")
    assert dispatch.linear(narrow, 1, "bfloat16", forced).path == "dequantize"  # not even forced


def test_cpu_table_and_forced_paths():
    cpu = Target.of(Device("cpu", "x86_64"))
    w = Weight("affine", 4, 64, 1024, 1024, "float32")
    assert dispatch.linear(w, 7, "float32", cpu).path == "quantized"
    assert dispatch.linear(w, 8, "float32", cpu).path == "dequantize"
    assert dispatch.linear(Weight("mxfp4", 4, 32, 1024, 1024, "uint8"), 31, "float32", cpu).path == "quantized"
    assert dispatch.linear(w, 10**6, "float32", dataclasses.replace(cpu, force="quantized")).path == "quantized"
    plan = dispatch.linear(w, 1, "float32", dataclasses.replace(cpu, force="fused"))  # no fused kernel here
    assert plan.path == "quantized" and "ESMC_MLX_PATH=fused cannot run" in plan.reason
    other_cpu = Target.of(Device("cpu", "arm64"))  # not measured: MLX's own
    assert dispatch.linear(w, 10**6, "float32", other_cpu).path == "quantized"


def test_plans_are_decided_once_per_weight_and_shape():
    target = Target.of(Device.parse("cuda:sm_90a"), cutlass=True)
    w = block_weights("6B", "mxfp4", 4, 32)[0]
    first = dispatch.linear(w, 256, "bfloat16", target)
    hits = dispatch.linear.cache_info().hits
    assert dispatch.linear(w, 256, "bfloat16", target) is first
    assert dispatch.linear.cache_info().hits == hits + 1
    other = dataclasses.replace(target, tuning=dataclasses.replace(HOPPER, cutlass_tokens={"large": 0, "small": 0}))
    assert dispatch.linear(w, 256, "bfloat16", other).path != "cutlass"  # another table: another plan


def test_info_plan_json_names_each_kernel_and_the_architecture_it_needs(converted):
    out = CliRunner().invoke(
        main, ["info", str(converted), "--plan", "--tokens", "1,300", "--device", "cuda:sm_80", "--json"]
    )
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["device"] == {"backend": "cuda", "arch": "sm_80", "sms": 108}
    rows = result["plan"]
    assert {r["tokens"] for r in rows} == {1, 300}
    for r in rows:
        assert set(r) >= {"layer", "tokens", "path", "kernels", "reason"} and r["reason"]
        for k in r["kernels"]:
            assert set(k) == {"name", "requires"} and k["requires"] in (None, "sm_80")
    layers = {r["layer"] for r in rows}
    assert {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"} <= layers
    text = CliRunner().invoke(main, ["info", str(converted), "--plan", "--device", "cpu"])
    assert text.exit_code == 0 and "self_attn.q_proj" in text.output and "device: cpu" in text.output


@pytest.mark.parametrize("args", [["--device", "cuda:sm_8"], ["--tokens", "0"], ["--tokens", "a"]])
def test_info_plan_refuses_what_it_cannot_plan(converted, args):
    out = CliRunner().invoke(main, ["info", str(converted), "--plan", *args])
    assert out.exit_code == 2 and out.output.count("Error:") == 1, out.output
    out = CliRunner().invoke(main, ["info", str(converted), *args])  # without --plan
    assert out.exit_code == 2 and "--plan" in out.output


def test_settings_are_read_once_and_refuse_what_they_do_not_take(monkeypatch):
    assert settings.Settings.from_env({"ESMC_MLX_PATH": "fused", "ESMC_MLX_KERNELS": "0"}).path == "fused"
    assert settings.Settings.from_env({"ESMC_MLX_KERNELS": "0"}).kernels is False
    assert settings.Settings.from_env({"ESMC_MLX_CACHE": "off"}).cache is None
    for env in ({"ESMC_MLX_PATH": "fast"}, {"ESMC_MLX_KERNELS": "maybe"}):
        with pytest.raises(settings.SettingsError, match=next(iter(env))):
            settings.Settings.from_env(env)
    before = settings.current()
    monkeypatch.setenv("ESMC_MLX_KERNELS", "0")
    assert settings.current() is before  # read once
    with settings.override(kernels=False) as changed:
        assert settings.current() is changed and dispatch.current().kernels is False
    assert settings.current() is before


def test_every_environment_variable_is_a_setting():
    """The package reads ESMC_MLX_* variables through settings.py alone, at most six of them, and
    the README's table lists exactly those."""
    assert len(settings.VARIABLES) <= 6
    used = set()
    for path in (ROOT / "esmc_mlx").rglob("*.py"):
        used |= set(re.findall(r"ESMC_MLX_[A-Z_]+", path.read_text()))
    assert used <= set(settings.VARIABLES), used - set(settings.VARIABLES)
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"`(ESMC_MLX_[A-Z_]+)", readme)) == set(settings.VARIABLES)
