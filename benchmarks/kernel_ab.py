"""One of our CUDA kernels on and off, in whole forwards: the shipped model (fused, compiled,
random bf16 weights) timed with an ``ESMC_MLX_*`` switch at 1 and at 0, interleaved.

Both sides run in one process on purpose: they are the same MLX model with one traced graph
each (compiled traces are keyed by the switch), so the only difference between them is the
kernel; there is no second library whose threads or BLAS could disturb the other side. The
logits of the two sides are compared too (the kernels are meant to be bit-identical).

    python -m benchmarks.kernel_ab --env ESMC_MLX_FUSED_NORM --model 6B --json $OUT/ab.json  # GPU
    python -m benchmarks.kernel_ab --model tiny --shapes 1x64 --device cpu                   # smoke
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments
from esmc_mlx.bench import config_for, forward_fns, machine, parse_shapes, time_interleaved
from esmc_mlx.runtime.model import FUSED_NORM_ENV
from esmc_mlx.testing import random_mlx_model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default=FUSED_NORM_ENV, help="the switch (1: kernel on, 0: MLX's ops)")
    add_forward_arguments(p, budget=3.0, shapes="1x256,1x1024,16x256,64x512")
    a = parse_forward_arguments(p, argv)
    model = random_mlx_model(config_for(a.model), mx.bfloat16 if a.device == "gpu" else mx.float32).optimize()
    sides = {"on": {a.env: "1"}, "off": {a.env: "0"}}
    rows = []
    for batch, length in parse_shapes(a.shapes):
        fns = forward_fns(None, dict.fromkeys(sides, model), batch, length, env=sides)
        t = time_interleaved(fns, warmup=3, budget_s=a.budget)
        ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(batch, length)))
        logits = {}
        for side in sides:
            os.environ[a.env] = sides[side][a.env]
            logits[side] = model(ids).logits
        os.environ.pop(a.env)
        row = {
            "batch": batch,
            "length": length,
            "on_ms": t["on"]["median_ms"],
            "off_ms": t["off"]["median_ms"],
            "off_over_on": t["off"]["median_ms"] / t["on"]["median_ms"],
            "reps": t["on"]["reps"],
            "logits_identical": bool(mx.array_equal(logits["on"], logits["off"]).item()),
        }
        rows.append(row)
        print(
            f"{a.model} {batch}x{length}: {a.env}=1 {row['on_ms']:.2f} ms, =0 {row['off_ms']:.2f} ms, "
            f"off/on {row['off_over_on']:.3f}, logits identical: {row['logits_identical']}",
            flush=True,
        )
    return save_json(a.json, {"machine": machine(with_torch=False), "env": a.env, "model": a.model, "rows": rows})


if __name__ == "__main__":
    main()
