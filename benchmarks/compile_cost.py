"""What a fresh process pays before its forwards run at full speed (issue 16), with and
without our kernels in MLX's disk cache (runtime/kernel_cache.py).

Every process pays, per input shape, one eager forward (a shape is compiled the second time it
is seen) and one ``mx.compile`` trace; and, once, its first forward: CUDA set-up, MLX's
kernels loaded from its disk cache, and our custom kernels (runtime/kernels.py), which
``mx.fast.cuda_kernel`` compiles with NVRTC in every process. Two ranks of ``mlx.launch`` pay
it each: the part of an embed that does not shrink with more GPUs.

Each variant runs in fresh processes, alternating, each with an MLX kernel cache of its own
that one untimed process of that variant filled first:

  cached   the shipped default: our kernels put in MLX's cache (runtime/kernel_cache.py)
  mlx-jit  ESMC_MLX_KERNEL_CACHE=0: MLX compiles our kernels in every process

For each shape (default: embed's batch shapes, B = 4096 // width, one padded row so the masked
path runs): wall time of the first three calls and of steady state (median of --reps).

    python -m benchmarks.compile_cost --model 300M --json $OUT/compile_cost.json
    python -m benchmarks.compile_cost --model 6B --quant mxfp4 --shapes 1x256,16x256
    python -m benchmarks.compile_cost --model tiny --device cpu --shapes 2x64 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from esmc_mlx.bench import QUANT_MODES
from esmc_mlx.quantize import BLOCK_LINEAR
from esmc_mlx.runtime.kernel_cache import ENV_VAR as KERNEL_CACHE_ENV
from esmc_mlx.runtime.quantized import quantize_modules
from esmc_mlx.testing import SHAPES, random_mlx_model, tiny_config

EMBED_SHAPES = ",".join(f"{4096 // w}x{w}" for w in range(64, 513, 32))
VARIANTS = {"cached": {KERNEL_CACHE_ENV: "1"}, "mlx-jit": {KERNEL_CACHE_ENV: "0"}}


def run_once(model_name: str, quant: str | None, shapes, reps: int) -> dict:
    t_start = time.perf_counter()
    config = tiny_config() if model_name == "tiny" else SHAPES[model_name]
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    model = random_mlx_model(config, dtype=dtype)
    if quant:  # the block projections, as esmc-convert --q quantizes them
        quantize_modules(model, QUANT_MODES[quant], lambda path: bool(BLOCK_LINEAR.fullmatch(path)))
    model.optimize()
    mx.eval(model.parameters())
    ready = time.perf_counter() - t_start
    rng = np.random.default_rng(0)
    rows = []
    for B, L in shapes:
        ids = mx.array(rng.integers(4, 24, (B, L)).astype(np.int32))
        attn = np.ones((B, L), np.int32)
        attn[-1, L - 3 :] = 0  # one padded row: the masked path embed's batches take

        def call():
            t0 = time.perf_counter()
            mx.eval(model(ids, attention_mask=mx.array(attn)).logits)
            return time.perf_counter() - t0

        calls = [call() for _ in range(3)]
        steady = statistics.median(call() for _ in range(reps))
        rows.append({"shape": [B, L], "wall_s": calls, "steady_s": steady})
    return {
        "model_ready_s": ready,
        "rows": rows,
        "first_shape_extra_s": sum(rows[0]["wall_s"][:2]) - 2 * rows[0]["steady_s"],
        "other_shapes_extra_s": sum(sum(r["wall_s"][:2]) - 2 * r["steady_s"] for r in rows[1:]),
        "steady_s": sum(r["steady_s"] for r in rows),
    }


def child(a, variant: str, work: str) -> dict:
    args = [sys.executable, "-m", "benchmarks.compile_cost", "--one", "--model", a.model, "--device", a.device]
    args += ["--shapes", a.shapes, "--reps", str(a.reps)] + (["--quant", a.quant] if a.quant else [])
    env = {**os.environ, **VARIANTS[variant], "MLX_PTX_CACHE_DIR": os.path.join(work, variant)}
    t0 = time.perf_counter()
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r["process_wall_s"] = time.perf_counter() - t0
    return r


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="300M", choices=["tiny", *SHAPES])
    p.add_argument("--quant", choices=list(QUANT_MODES), help="quantize the blocks' linears (random weights)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--shapes", default=EMBED_SHAPES, help="BxL,... (default: embed's batch shapes)")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per variant, alternating")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run, JSON out
    a = p.parse_args(argv)
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.one:
        print(json.dumps(run_once(a.model, a.quant, shapes, a.reps)))
        return {}
    result = {"model": a.model, "quant": a.quant, "device": a.device, "mlx": mx.__version__, "runs": []}
    work = tempfile.mkdtemp(prefix="compile_cost-")
    for variant in VARIANTS:
        child(a, variant, work)  # untimed: fills this variant's kernel cache
    for _ in range(a.rounds):
        for variant in VARIANTS:
            r = child(a, variant, work)
            r["variant"] = variant
            result["runs"].append(r)
            print(
                f"{a.model}{' ' + a.quant if a.quant else ''} {variant:8s} process {r['process_wall_s']:6.2f} s"
                f" (model ready {r['model_ready_s']:5.2f} s); first shape's first two calls "
                f"{r['first_shape_extra_s']:5.2f} s above steady, the other {len(shapes) - 1} shapes' "
                f"{r['other_shapes_extra_s']:5.2f} s; steady forwards {r['steady_s'] * 1e3:7.1f} ms",
                flush=True,
            )
    return save_json(a.json, result)


if __name__ == "__main__":
    main()
