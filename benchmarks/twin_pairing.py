"""How far the bf16 side of a B=1 pair moves with the model it is paired with (issue 16).

``esmc-mlx bench`` divides each quantized twin's time by the bf16 model timed interleaved with
it. In the sixteenth issue-16 session, one process, one bf16 model and one shape (6B, 1x64)
gave 19.2-19.5 ms timed alone, 19.9-26.0 ms beside mxfp4 and 14.2 ms beside affine8, on two
machines: a B=1 ratio moved by up to 1.5x with its denominator alone. This times the same bf16
model alone and beside each partner (another bf16 copy, quantized twins), in rounds whose
partner order is reversed each time, so that a drift over the process's life and an effect of
the partner can be told apart. Each row: the bf16 median, the partner's median, the round.

    python -m benchmarks.twin_pairing --model 6B --shapes 1x64,1x256 --json $OUT/pairing.json   # GPU
    python -m benchmarks.twin_pairing --model tiny --device cpu --shapes 1x16 --partners none,affine4
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx.utils import tree_flatten

from benchmarks import save_json
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments
from esmc_mlx.bench import config_for, forward_fns, machine, mlx_model, parse_shapes, time_interleaved
from esmc_mlx.testing import random_mlx_model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_forward_arguments(p, shapes="1x64,1x256")
    p.add_argument("--partners", default="none,bf16,affine8,mxfp4,affine4", help="none (alone), bf16 (a copy) or modes")
    p.add_argument("--rounds", type=int, default=2, help="passes over the partners, each in the reverse order")
    a = parse_forward_arguments(p, argv)
    config = config_for(a.model)
    dtype = mx.bfloat16 if a.device == "gpu" else mx.float32
    weights = dict(tree_flatten(random_mlx_model(config, dtype).parameters()))
    bf16 = mlx_model(config, weights, fuse=True, compile=True)
    partners = a.partners.split(",")
    twins = {
        name: mlx_model(config, weights, fuse=True, compile=True, quant=None if name == "bf16" else RECORDS[name])
        for name in partners
        if name != "none"
    }
    result = {"machine": machine(with_torch=False), "model": a.model, "rows": []}
    for r in range(a.rounds):
        for name in partners if r % 2 == 0 else partners[::-1]:
            for batch, length in parse_shapes(a.shapes):
                models = {"bf16": bf16} if name == "none" else {"bf16": bf16, "partner": twins[name]}
                timed = time_interleaved(forward_fns(None, models, batch, length), warmup=3, budget_s=a.budget)
                row = {"round": r, "partner": name, "batch": batch, "length": length}
                row["bf16_ms"] = timed["bf16"]["median_ms"]
                row["partner_ms"] = timed["partner"]["median_ms"] if "partner" in timed else None
                result["rows"].append(row)
                print(
                    f"{a.model} {batch}x{length} round {r} beside {name:8s}: bf16 {row['bf16_ms']:7.2f} ms"
                    + (f", partner {row['partner_ms']:7.2f} ms" if row["partner_ms"] else ""),
                    flush=True,
                )
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
