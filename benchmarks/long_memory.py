"""Activation memory and time of one long forward, chunked by layers vs one lazy graph.

    python -m benchmarks.long_memory --shape 6B --json OUT.json [--lengths 4096 8192] [--batch 1]
    python -m benchmarks.long_memory --shape 6B --quant mxfp4 --modes chunked   # a quantized model

Each (length, mode) runs in its own process: a random model of the shape (bf16, made with
mx.random on the default device: no torch, no disk), optimized as ``load`` does (fused, compiled
on a GPU), two warm-up forwards (the first runs eagerly, the second traces), then ``--repeat``
timed forwards. Reported: peak memory above the weights over the warm-up (eager) and the timed
(steady) forwards, from mx.get_peak_memory after mx.reset_peak_memory, and the median time.
``--quant`` (a name of ``esmc_mlx.bench.QUANT_MODES``) quantizes the block projections first,
as ``esmc-convert --q`` does: the weights are then the packed ones, and the bf16 copies that
dequantize + matmul makes of them count as activations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from benchmarks import save_json
from esmc_mlx.bench import QUANT_MODES, mlx_model
from esmc_mlx.runtime.execution import layers_per_eval
from esmc_mlx.testing import SHAPES, random_mlx_model, tiny_config

MODES = {"chunked": "auto", "layer": 1, "whole": None}  # ESMC.chunk_layers argument
GB = 1e9


def config_for(shape: str):
    return tiny_config(num_hidden_layers=6) if shape == "tiny" else SHAPES[shape]


def measure(shape: str, batch: int, length: int, mode: str, repeat: int, quant: str | None = None) -> dict:
    config = config_for(shape)
    model = random_mlx_model(config, mx.bfloat16)
    if quant:  # the bf16 block weights are freed once the quantized ones replace them
        model = mlx_model(config, dict(tree_flatten(model.parameters())), quant=QUANT_MODES[quant])
    model = model.optimize().chunk_layers(MODES[mode])
    mx.clear_cache()
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(batch, length)))
    mx.synchronize()
    mx.reset_peak_memory()
    for _ in range(2):  # eager, then traced
        mx.eval(model(ids).logits)
    warm_peak = mx.get_peak_memory() - weights
    mx.reset_peak_memory()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(model(ids).logits)
        times.append(time.perf_counter() - start)
    return {
        "shape": shape,
        "quant": quant,
        "batch": batch,
        "length": length,
        "mode": mode,
        "layers_per_eval": layers_per_eval(config, batch, length, 2) if mode == "chunked" else MODES[mode],
        "weights_gb": weights / GB,
        "peak_above_weights_gb": (mx.get_peak_memory() - weights) / GB,
        "warmup_peak_above_weights_gb": warm_peak / GB,
        "median_s": statistics.median(times),
        "times_s": times,
        "device": str(mx.default_device()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["tiny", *SHAPES], default="6B")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["chunked", "whole"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quant", choices=list(QUANT_MODES), help="quantize the block projections first")
    parser.add_argument("--device", choices=["gpu", "cpu"], default=None)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--child", nargs=2, metavar=("LENGTH", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device:
        mx.set_default_device(getattr(mx, args.device))
    if args.child:
        row = measure(args.shape, args.batch, int(args.child[0]), args.child[1], args.repeat, args.quant)
        print("ROW " + json.dumps(row))
        return
    rows = []
    for length in args.lengths:
        for mode in args.modes:
            command = [
                sys.executable,
                "-m",
                "benchmarks.long_memory",
                "--shape",
                args.shape,
                "--batch",
                str(args.batch),
            ]
            command += ["--repeat", str(args.repeat), "--child", str(length), mode]
            if args.device:
                command += ["--device", args.device]
            if args.quant:
                command += ["--quant", args.quant]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if done.returncode or not lines:  # an out-of-memory whole graph is a result too
                row = {"shape": args.shape, "batch": args.batch, "length": length, "mode": mode}
                row["error"] = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            else:
                row = json.loads(lines[-1][4:])
            rows.append(row)
            name = f"{args.shape} {args.quant}" if args.quant else args.shape
            if "error" in row:
                print(f"{name} {args.batch}x{length} {mode:8s} FAILED: {row['error'][0]}", flush=True)
            else:
                print(
                    f"{name} {args.batch}x{length} {mode:8s} above weights {row['peak_above_weights_gb']:6.2f} GB "
                    f"(warm-up {row['warmup_peak_above_weights_gb']:6.2f} GB)  {row['median_s'] * 1e3:8.1f} ms  "
                    f"every {row['layers_per_eval']} layers",
                    flush=True,
                )
    save_json(args.json, {"rows": rows}, device=args.device)


if __name__ == "__main__":
    main()
