"""Per-weight timings of the fused quantized matmul (kernels.quantized_matmul) against cuBLAS
bf16 and dequantize + matmul, on a CUDA GPU: interleaved (rotated order), 8 independent calls
per mx.eval, median of the rounds, microseconds a call.
python -m benchmarks.fused_qmm_ab OUT.json [--quick]"""

import json
import sys

import mlx.core as mx

from esmc_mlx.bench import time_interleaved
from esmc_mlx.runtime import kernels

out = sys.argv[1]
quick = "--quick" in sys.argv
CALLS = 8
SHAPES = {  # (n, k): model
    (7680, 2560): "6B",
    (2560, 2560): "6B",
    (13824, 2560): "6B",
    (2560, 6912): "6B",
    (2880, 960): "300M",
    (960, 960): "300M",
    (5120, 960): "300M",
    (960, 2560): "300M",
}
MODES = {"affine4": ("affine", 4, 64), "mxfp4": ("mxfp4", 4, 32), "affine8": ("affine", 8, 64)}
SWEEP = {(7680, 2560), (2560, 2560), (13824, 2560)}  # also the plan's alternatives
mx.random.seed(0)
res = []
for (n, k), model in SHAPES.items():
    for name, (mode, bits, gs) in MODES.items():
        if name == "affine8" and (n, k) not in SWEEP:
            continue
        wf = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        wq, sc, *rest = mx.quantize(wf, group_size=gs, bits=bits, mode=mode)
        bi = rest[0] if rest else None
        mx.eval(wf, wq, sc, *rest)
        for rows in (16, 64, 256, 1024) if model == "6B" else (16, 256, 1024):
            if quick and rows != 256:
                continue
            xs = [mx.random.normal((rows, k)).astype(mx.bfloat16) for _ in range(CALLS)]
            mx.eval(xs)

            def fused(**kw):
                return lambda: mx.eval([kernels.quantized_matmul(x, wq, sc, bi, gs, bits, mode, **kw) for x in xs])

            fns = {
                "bf16": lambda: mx.eval([x @ wf.T for x in xs]),
                "dequant": lambda: mx.eval(
                    [x @ kernels.dequantize(wq, sc, bi, gs, bits, mode, mx.bfloat16).T for x in xs]
                ),
                "fused": fused(),
            }
            if (n, k) in SWEEP and name != "affine8":
                fns["fused_slow_dequant"] = fused(fast=False)
                fns["fused_waves2"] = fused(waves=2.0)
                if rows >= 256:
                    fns["fused_bt64"] = fused(bt=64)
            t = time_interleaved(fns, warmup=2, budget_s=0.2, max_reps=12)
            flops = 2 * rows * n * k
            row = {"n": n, "k": k, "model": model, "mode": name, "rows": rows, "plan": kernels.qmm_plan(rows, n, k)}
            row.update({f"{f}_us": v["median_ms"] * 1e3 / CALLS for f, v in t.items()})
            print(
                f"{name:7s} {n}x{k} rows {rows:5d} plan {row['plan']} "
                + " ".join(f"{f} {row[f + '_us']:.1f}us({flops / row[f + '_us'] / 1e6:.0f}TF)" for f in fns)
                + f"  fused/bf16 {row['fused_us'] / row['bf16_us']:.2f} fused/dequant {row['fused_us'] / row['dequant_us']:.2f}",
                flush=True,
            )
            res.append(row)
        json.dump(res, open(out, "w"), indent=1)
