"""On a CUDA GPU: every architecture's plans run, their kernels compile for that architecture,
and the plans of an architecture without a measured table compute what Hopper's do.

The lent GPU is a Hopper, which cannot load code built for sm_80; so each architecture's plans
run on it with their kernels compiled for it, and NVRTC (the compiler MLX uses) then compiles
every instantiation those plans launched for the architecture itself (compile only).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from esmc_mlx import bench, testing
from esmc_mlx.runtime import dispatch

pytestmark = pytest.mark.gpu

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100")
MODES = ("bf16", "affine4", "affine8", "mxfp4")
SHAPES = ((1, 16), (1, 100), (1, 200), (2, 300), (1, 1100))  # each path of Hopper's table


def models(config):
    weights = dict(tree_flatten(testing.random_mlx_model(config, mx.bfloat16).parameters()))
    return {m: bench.mlx_model(config, weights, fuse=True, quant=bench.QUANT_MODES.get(m)) for m in MODES}


def configs():
    """A block of the 300M's width (its table: "small") and one of the 6B's ("large")."""
    return (
        testing.tiny_config(hidden_size=960, num_attention_heads=15, num_hidden_layers=2, intermediate_size=2560),
        testing.tiny_config(hidden_size=2560, num_attention_heads=40, num_hidden_layers=1, intermediate_size=6912),
    )


def planned_for(arch: str) -> dispatch.Target:
    """The plans of a device of ``arch`` with this GPU's SMs (CUTLASS where it runs and is built)."""
    here = dispatch.current()
    device = dataclasses.replace(dispatch.Device.parse(f"cuda:{arch}"), sms=here.device.sms)
    return dispatch.Target.of(device, cutlass=here.cutlass and device.runs("sm_90a"))


# Runs one architecture's plans over every mode and shape, then compiles each kernel
# instantiation they launched for that architecture with NVRTC; prints a JSON line.
CHILD = """
import dataclasses, json, sys
import mlx.core as mx, numpy as np
from esmc_mlx.runtime import dispatch
from esmc_mlx.runtime.cuda import kernel_cache
sys.path.insert(0, "tests")
import test_gpu_plans as t
arch = sys.argv[1]
planned = t.planned_for(arch)
targets = [planned, dataclasses.replace(planned, cutlass=False)]  # with CUTLASS built, and before
for target in targets:
    with dispatch.use(target):
        for config in t.configs():
            for model in t.models(config).values():
                for batch, length in t.SHAPES:
                    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(batch, length)))
                    mx.eval(model(ids).logits)
results = {}
for module, (name, source) in sorted(kernel_cache.INSTANTIATED.items()):
    try:
        kernel_cache.compile_cubin(source, f"mlx::core::cu::{name}", arch)
        results[module] = "compiled"
    except kernel_cache.CompileError as e:
        results[module] = str(e)[-300:]
wg = [(n, s) for n, s in kernel_cache.INSTANTIATED.values() if "qmmwg" in n]
refused = None
if wg and arch == "sm_90a":  # the warpgroup tile, not for an older architecture
    try:
        kernel_cache.compile_cubin(wg[0][1], f"mlx::core::cu::{wg[0][0]}", "sm_80")
        refused = False
    except kernel_cache.CompileError as e:
        refused = "wgmma" in str(e)
print("RESULT " + json.dumps({"kernels": results, "wg_refused_for_sm_80": refused}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_every_planned_kernel_compiles_for_its_architecture(arch):
    run = subprocess.run([sys.executable, "-c", CHILD, arch], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    kernels = result["kernels"]
    failed = {module: why for module, why in kernels.items() if why != "compiled"}
    assert not failed, failed
    names = sorted({module.rsplit("_", 1)[0] for module in kernels})
    print(f"{arch}: {len(kernels)} kernel instantiations compiled ({', '.join(names)})")
    if arch == "sm_90a":  # Hopper's table: the whole stack, and its wgmma tile refused elsewhere
        assert any("qmmwg" in m for m in kernels) and any("esmc_qmm_" in m for m in kernels)
        assert result["wg_refused_for_sm_80"] is True
    else:  # no table: the portable kernel alone
        assert kernels and all("esmc_qkv_heads" in m for m in kernels), names


@pytest.mark.parametrize("config", configs(), ids=("300M-wide", "6B-wide"))
def test_an_unmeasured_architecture_computes_what_hopper_does(config):
    """The plans an A100 gets (MLX's ops and the portable kernel) give Hopper's logits within
    bf16 rounding, for every mode and each path of Hopper's table."""
    hopper, a100 = dispatch.current(), planned_for("sm_80")
    assert hopper.tuning is not None and a100.tuning is None
    for mode, model in models(config).items():
        for batch, length in SHAPES:
            ids = mx.array(np.random.default_rng(length).integers(4, 24, size=(batch, length)))
            outs = {}
            for name, target in (("hopper", hopper), ("a100", a100)):
                with dispatch.use(target):
                    outs[name] = np.array(model(ids).logits.astype(mx.float32))
            err = np.linalg.norm(outs["a100"] - outs["hopper"]) / np.linalg.norm(outs["hopper"])
            assert err < 2e-2, (mode, batch, length, err)
