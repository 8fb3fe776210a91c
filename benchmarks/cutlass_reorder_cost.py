"""What CUTLASS's reordered weights (runtime/cutlass_qmm.reorder) cost: GPU memory and the first
forward, with the reorder and without (ESMC_MLX_CUTLASS_REORDER=0), each side in its own process,
each twice (one order, then the other).

    python -m benchmarks.cutlass_reorder_cost --model 6B --modes affine4,mxfp4 --json OUT.json

Each side: a random model of the shape (bf16 on the GPU), quantized as ``esmc-convert --q`` does,
fused and compiled as ``load`` does. Reported: active memory after loading it, then after three
forwards at each of ``--shapes`` (the cache cleared first: what the model holds, not what MLX's
allocator keeps), and the times of the first three forwards at the first shape (the first one
makes every copy that shape's calls need). Needs the extension built (``esmc-mlx build-cutlass``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import mlx.core as mx

from benchmarks import save_json
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import random_bf16
from esmc_mlx.bench import mlx_model, parse_shapes
from esmc_mlx.runtime import cutlass_qmm


def side(model_name: str, mode: str, shapes: str) -> dict:
    """One side's figures, in this process (its environment says whether it reorders)."""
    config, weights, bf16 = random_bf16(model_name)
    model = mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode])
    mx.eval(model.parameters())
    del weights, bf16
    gc.collect()
    mx.clear_cache()
    out = {"loaded_gb": mx.get_active_memory() / 1e9}
    for i, (batch, length) in enumerate(parse_shapes(shapes)):
        ids = mx.zeros((batch, length), dtype=mx.int32) + 5
        for rep in range(3):
            start = time.perf_counter()
            mx.eval(model(ids).logits)
            if i == 0:
                out[f"forward_{rep}_ms"] = (time.perf_counter() - start) * 1e3
        mx.clear_cache()
        out[f"after_{batch}x{length}_gb"] = mx.get_active_memory() / 1e9
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="6B", choices=["300M", "600M", "6B"])
    p.add_argument("--modes", default="affine4,mxfp4", help=f"comma-separated, of {', '.join(RECORDS)}")
    p.add_argument("--shapes", default="1x1024,1x256,1x2048", help="BATCHxLENGTH list; the first is timed")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--side", choices=["1", "0"], help=argparse.SUPPRESS)  # one side, in a child process
    a = p.parse_args(argv)
    if a.side is not None:
        print(json.dumps(side(a.model, a.modes, a.shapes)))
        return {}
    if cutlass_qmm._extension() is None:
        raise SystemExit(f"Error: the extension is not built for MLX {mx.__version__}: esmc-mlx build-cutlass")
    result = {"model": a.model, "shapes": a.shapes, "rows": []}
    for mode in a.modes.split(","):
        print(f"{a.model} {mode}: GB loaded / after forwards at {a.shapes} / first forward ms")
        # Each side twice, first and second: a machine's first process also fills MLX's and
        # esmc-mlx's kernel caches, and that is not the reorder's.
        for order in (("1", "0"), ("0", "1")):
            for reorder in order:
                command = [sys.executable, "-m", "benchmarks.cutlass_reorder_cost", "--model", a.model]
                command += ["--modes", mode, "--shapes", a.shapes, "--side", reorder]
                env = {**os.environ, cutlass_qmm.REORDER_ENV: reorder}
                done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
                figures = json.loads(done.stdout.splitlines()[-1])
                name = "reordered" if reorder == "1" else "MLX's layout"
                result["rows"].append({"mode": mode, "side": name, **figures})
                after = " ".join(f"{v:.2f}" for k, v in figures.items() if k.startswith("after_"))
                print(f"  {name:13s} {figures['loaded_gb']:.2f} / {after} / {figures['forward_0_ms']:.0f}", flush=True)
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
