"""Another runtime/kernels.py against this one in whole forwards (issue 16): the shipped quantized
model (random bf16 weights, fused, compiled) once with this checkout's kernels and once with
``--against FILE``'s (for example ``git show REV:esmc_mlx/runtime/kernels.py > old.py``), beside
the bf16 model, interleaved in one process. The "against" side's traces are made with that
module in place of this one wherever runtime/quantized.py calls it (dequantize, the fused
matmul and their gates); a change that keeps the kernels' outputs bit for bit must give the
same logits on both sides (checked, printed as ``same logits``).

    git show HEAD~1:esmc_mlx/runtime/kernels.py > /tmp/old_kernels.py
    python -m benchmarks.kernels_ab --against /tmp/old_kernels.py --json $OUT/ab.json     # GPU
    python -m benchmarks.kernels_ab --against /tmp/old_kernels.py --model tiny --device cpu --shapes 1x16
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import mlx.core as mx
import numpy as np

from benchmarks import save_json, with_attribute
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments, random_bf16
from esmc_mlx.bench import forward_fns, machine, mlx_model, parse_shapes, time_interleaved
from esmc_mlx.runtime import quantized


def load_kernels(path: str):
    """A kernels.py imported as a sibling of runtime/kernels.py (its relative imports resolve)."""
    name = "esmc_mlx.runtime.kernels_against"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def using(module, fn):
    """``fn`` run with runtime/quantized.py calling ``module`` for its kernels."""
    return with_attribute(quantized, "kernels", module, fn)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="the other kernels.py")
    add_forward_arguments(p, modes="mxfp4,affine4", shapes="1x256,1x1024,16x256")
    a = parse_forward_arguments(p, argv)
    against = load_kernels(a.against)
    config, weights, bf16 = random_bf16(a.model)
    result = {"machine": machine(with_torch=False), "model": a.model, "against": a.against, "rows": []}
    for mode in a.modes.split(","):
        sides = {
            s: mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode]) for s in ("this", "against")
        }
        for batch, length in parse_shapes(a.shapes):
            fns = forward_fns(None, {"bf16": bf16, **sides}, batch, length)
            fns["against"] = using(against, fns["against"])
            t = time_interleaved(fns, warmup=3, budget_s=a.budget)
            ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(batch, length)))
            theirs = using(against, lambda model=sides["against"], ids=ids: model(ids).logits)()
            same = bool(mx.array_equal(theirs, sides["this"](ids).logits))
            row = {"mode": mode, "batch": batch, "length": length, **{f"{k}_ms": v["median_ms"] for k, v in t.items()}}
            row |= {
                "this_over_bf16": row["this_ms"] / row["bf16_ms"],
                "against_over_bf16": row["against_ms"] / row["bf16_ms"],
                "this_over_against": row["this_ms"] / row["against_ms"],
                "same_logits": same,
            }
            result["rows"].append(row)
            print(
                f"{a.model} {mode:8s} {batch}x{length}: bf16 {row['bf16_ms']:.2f} ms, this {row['this_ms']:.2f} "
                f"({row['this_over_bf16']:.3f}), against {row['against_ms']:.2f} ({row['against_over_bf16']:.3f}); "
                f"this/against {row['this_over_against']:.3f}, {'same logits' if same else 'LOGITS DIFFER'}",
                flush=True,
            )
            save_json(a.json, result)
        del sides
    return result


if __name__ == "__main__":
    main()
