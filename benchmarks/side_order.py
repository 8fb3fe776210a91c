"""Whether a side's place in ``bench.time_interleaved`` changes its time: two identical
quantized models (qa, qb) beside the bf16 one, timed starting in the order bf16, qa, qb and
again starting qb, qa, bf16, then in blocks (six forwards of one model, then six of the other,
four times). Identical models should read the same. With a fixed order they did not: the
ninth issue-16 session found the one timed right after bf16 3-4% slower for the 6B in mxfp4,
which is why time_interleaved rotates the order every round. Rotating left most rounds with
the same fn right after bf16 (3-4% apart still, thirty-fourth session), so each timed call now
follows a call of its own fn (docs/benchmarks.md). The blocks give the time of one model run
over and over, as a user runs it.

    python -m benchmarks.side_order --model 6B --modes mxfp4,affine4 --json $OUT/6b.json     # GPU
    python -m benchmarks.side_order --model tiny --shapes 1x64 --modes affine4 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from benchmarks import save_json
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments, random_bf16
from esmc_mlx.bench import forward_fns, machine, mlx_model, parse_shapes, time_interleaved


def blocked(fns: dict, rounds: int = 4, per_block: int = 6) -> dict[str, float]:
    """Median ms of each fn, timed in blocks of ``per_block`` calls (one untimed call first)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(per_block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_forward_arguments(p, model="6B", modes="mxfp4,affine4", shapes="1x256,1x1024,16x256")
    a = parse_forward_arguments(p, argv)
    config, weights, bf16 = random_bf16(a.model)
    result = {"machine": machine(with_torch=False), "model": a.model, "rows": []}
    for mode in a.modes.split(","):
        qa, qb = (mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode]) for _ in range(2))
        for batch, length in parse_shapes(a.shapes):
            fns = forward_fns(None, {"bf16": bf16, "qa": qa, "qb": qb}, batch, length)
            row = {"mode": mode, "batch": batch, "length": length}
            line = f"{a.model} {mode} {batch}x{length}:"
            for order in (("bf16", "qa", "qb"), ("qb", "qa", "bf16")):
                t = time_interleaved({k: fns[k] for k in order}, warmup=3, budget_s=a.budget)
                key = ",".join(order)
                row[key] = {k: v["median_ms"] for k, v in t.items()}
                ratios = {k: row[key][k] / row[key]["bf16"] for k in ("qa", "qb")}
                line += f" | order {key}: qa {ratios['qa']:.3f} qb {ratios['qb']:.3f} of bf16"
            row["blocked"] = blocked({"bf16": fns["bf16"], "qa": fns["qa"]})
            line += f" | blocks: qa {row['blocked']['qa'] / row['blocked']['bf16']:.3f} of bf16"
            result["rows"].append(row)
            print(line, flush=True)
        del qa, qb
        gc.collect()
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
