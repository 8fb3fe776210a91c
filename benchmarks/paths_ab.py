"""Whole forwards of the shipped model under other plans: the evidence for runtime/dispatch.py's
tables. The bf16 model and a quantized twin per side (random weights, fused, compiled) are timed
interleaved in one process, each side's time over bf16's printed, and each side's logits compared
with the first side's. Mode ``float`` plans the bf16 model itself on each side (the plans of its
fused steps: ``add_norm_from``, the q/k/v heads). A side is a plan variant:

  shipped          the plans as they stand
  mlx-ops          no custom kernel (ESMC_MLX_KERNELS=0)
  no-cutlass       the tables without CUTLASS (what a Hopper GPU runs before build-cutlass)
  path=P           every call forced to P (quantized, dequantize, fused, cutlass) where it runs
  arch=sm_XY       the plans of another architecture on this GPU (sm_80: MLX's ops and the
                   portable kernels, what an A100 runs)
  FIELD=VALUE      the shipped plans with one field of this GPU's Tuning replaced (a Python
                   literal: cutlass_tokens={'large':1024,'small':4096}, add_norm_from=0 ...)

    python -m benchmarks.paths_ab --model 6B --sides shipped,no-cutlass,mlx-ops --json $OUT/6b.json   # GPU
    python -m benchmarks.paths_ab --model 300M --modes affine4 --shapes 1x128,1x256 --sides shipped,path=fused
    python -m benchmarks.paths_ab --model tiny --device cpu --modes affine4 --shapes 1x64 --sides shipped,path=quantized
    python -m benchmarks.paths_ab --model 6B --modes float --shapes 1x1024,16x256 --sides shipped,add_norm_from=2097152
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gc

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from benchmarks import save_json
from esmc_mlx import settings
from esmc_mlx.bench import (
    QUANT_MODES,
    config_for,
    forward_fns,
    machine,
    mlx_model,
    parse_shapes,
    rel_l2,
    time_interleaved,
)
from esmc_mlx.runtime import dispatch
from esmc_mlx.testing import random_mlx_model

RECORDS = {"float": None, **QUANT_MODES, "affine2": {"mode": "affine", "bits": 2, "group_size": 64}}
RECORDS |= {f"affine{b}": {"mode": "affine", "bits": b, "group_size": 64} for b in (3, 5, 6)}
RECORDS |= {
    "mxfp8": {"mode": "mxfp8", "bits": 8, "group_size": 32},
    "nvfp4": {"mode": "nvfp4", "bits": 4, "group_size": 16},
}


def side_target(side: str, shipped: dispatch.Target) -> dispatch.Target:
    """The target a side plans for, from the shipped one."""
    replace = dataclasses.replace
    if side == "shipped":
        return shipped
    if side == "mlx-ops":
        return replace(shipped, kernels=False, cutlass=False)
    if side == "no-cutlass":
        return replace(shipped, cutlass=False)
    name, sep, value = side.partition("=")
    if not sep:
        raise ValueError(f"side {side!r}: shipped, mlx-ops, no-cutlass, path=P, arch=sm_XY or FIELD=VALUE")
    if name == "path":
        if value not in settings.PATHS:
            raise ValueError(f"side {side!r}: a path is one of {', '.join(settings.PATHS)}")
        return replace(shipped, force=value)
    if name == "arch":
        device = replace(dispatch.Device.parse(f"cuda:{value}"), sms=shipped.device.sms)
        return replace(shipped, device=device, tuning=dispatch.tuning_for(device), cutlass=False)
    fields = {f.name for f in dataclasses.fields(dispatch.Tuning)}
    if name not in fields or shipped.tuning is None:
        raise ValueError(f"side {side!r}: {name} is not a field of this device's Tuning ({', '.join(sorted(fields))})")
    return replace(shipped, tuning=replace(shipped.tuning, **{name: ast.literal_eval(value)}))


class Planned:
    """A model whose calls (its compiled traces among them) are planned for ``target``."""

    def __init__(self, model, target: dispatch.Target):
        self.model, self.target = model, target

    def __call__(self, ids):
        with dispatch.use(self.target):
            return self.model(ids)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="6B", help="6B, 600M, 300M or tiny (random weights)")
    p.add_argument("--modes", default="affine4,affine8,mxfp4", help=f"quantizations of: {', '.join(RECORDS)}")
    p.add_argument("--shapes", default="1x256,1x1024,16x256,64x512", help="BxL shapes, comma-separated")
    p.add_argument("--sides", default="shipped,no-cutlass,mlx-ops", help="plan variants, comma-separated (above)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed forwards per side and shape")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    shipped = dispatch.current()
    try:
        targets = {side: side_target(side, shipped) for side in a.sides.split(",")}
    except ValueError as e:
        p.error(str(e))
    config = config_for(a.model)
    dtype = mx.bfloat16 if a.device == "gpu" else mx.float32
    weights = dict(tree_flatten(random_mlx_model(config, dtype).parameters()))
    bf16 = mlx_model(config, weights, fuse=a.device == "gpu", compile=a.device == "gpu")
    result = {"machine": machine(with_torch=False), "model": a.model, "target": repr(shipped), "rows": []}
    for mode in a.modes.split(","):
        quant = RECORDS[mode]
        model = (
            bf16
            if quant is None
            else mlx_model(config, weights, fuse=a.device == "gpu", compile=a.device == "gpu", quant=quant)
        )
        sides = {side: Planned(model, target) for side, target in targets.items()}
        for batch, length in parse_shapes(a.shapes):
            fns = forward_fns(None, {"bf16": bf16, **sides}, batch, length)
            t = {k: v["median_ms"] for k, v in time_interleaved(fns, warmup=3, budget_s=a.budget).items()}
            ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(batch, length)))
            outputs = {side: np.array(fn(ids).logits.astype(mx.float32)) for side, fn in sides.items()}
            first = next(iter(outputs.values()))
            row = {"mode": mode, "batch": batch, "length": length, **{f"{k}_ms": v for k, v in t.items()}}
            row |= {f"{side}_over_bf16": t[side] / t["bf16"] for side in sides}
            row |= {f"{side}_logits_rel_l2": rel_l2(out, first) for side, out in outputs.items()}
            result["rows"].append(row)
            ratios = ", ".join(f"{side} {row[side + '_over_bf16']:.3f}" for side in sides)
            print(f"{a.model} {mode} {batch}x{length}: bf16 {t['bf16']:.2f} ms; over bf16: {ratios}", flush=True)
        del model, sides
        gc.collect()
        save_json(a.json, result)  # after every mode: a run cut short keeps what it measured
    return result


if __name__ == "__main__":
    main()
