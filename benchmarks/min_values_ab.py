"""``kernels.MIN_VALUES`` in whole forwards (issue 16): the shipped gate (weights under 8M values
through ``mx.dequantize``, larger ones through this project's kernel) against the kernel for
every weight (``MIN_VALUES = 0``), beside the bf16 model; the shipped model (fused, compiled,
random weights) in one quantization, interleaved in one process. The kernel is bit-exact, so
the logits of the two quantized sides must be identical (checked).

    python -m benchmarks.min_values_ab --model 300M --json $OUT/300m.json     # GPU
    python -m benchmarks.min_values_ab --model tiny --shapes 1x64 --modes affine4 --device cpu
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx
import numpy as np

from benchmarks import save_json, with_attribute
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments, random_bf16
from esmc_mlx.bench import forward_fns, machine, mlx_model, parse_shapes, time_interleaved
from esmc_mlx.runtime import kernels

SHIPPED = kernels.MIN_VALUES


def every_weight(fn):
    """``fn`` run with the kernel taking every weight (a trace made so keeps that choice)."""
    return with_attribute(kernels, "MIN_VALUES", 0, fn)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_forward_arguments(p, model="300M", modes="affine4,affine8,mxfp4", shapes="1x256,1x1024,16x256,64x512")
    a = parse_forward_arguments(p, argv)
    config, weights, bf16 = random_bf16(a.model)
    result = {"machine": machine(with_torch=False), "model": a.model, "shipped_min_values": SHIPPED, "rows": []}
    for mode in a.modes.split(","):
        quant = {
            side: mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode]) for side in ("gated", "all")
        }
        for batch, length in parse_shapes(a.shapes):
            fns = forward_fns(None, {"bf16": bf16, **quant}, batch, length)
            fns["all"] = every_weight(fns["all"])
            t = time_interleaved(fns, warmup=3, budget_s=a.budget)
            ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(batch, length)))
            all_logits = every_weight(lambda model=quant["all"], ids=ids: model(ids).logits)()
            same = mx.array_equal(all_logits, quant["gated"](ids).logits)
            row = {"mode": mode, "batch": batch, "length": length, **{f"{k}_ms": v["median_ms"] for k, v in t.items()}}
            row |= {
                "gated_over_bf16": row["gated_ms"] / row["bf16_ms"],
                "all_over_bf16": row["all_ms"] / row["bf16_ms"],
            }
            row["logits_identical"] = bool(same.item())
            result["rows"].append(row)
            print(
                f"{a.model} {mode} {batch}x{length}: bf16 {row['bf16_ms']:.2f} ms, shipped gate {row['gated_ms']:.2f} "
                f"({row['gated_over_bf16']:.3f}), kernel for every weight {row['all_ms']:.2f} ({row['all_over_bf16']:.3f}), "
                f"logits identical: {row['logits_identical']}",
                flush=True,
            )
        del quant
        gc.collect()
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
