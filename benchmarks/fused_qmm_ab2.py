"""Per-weight A/B of the fused quantized matmul's warp tiles (kernels.quantized_matmul) against
cuBLAS bf16 and dequantize + matmul on a CUDA GPU: the 6B's four block shapes, affine4 and
mxfp4, 16-1024 tokens; interleaved (rotated order), 8 independent calls per mx.eval, median of
the rounds, microseconds a call. fused_2d: the two-dimensional warp tile (block 256 weight rows
x 64 tokens, warps 8 x 1 of 32 rows x 64 tokens); fused_1d: the first version (a warp 16
weight rows x all tokens); 2d128 / 2d32 the other two-dimensional tiles (7680x2560 only).
--tiles wg,2d128 adds those tiles on every shape (wg: Hopper's warpgroup MMA); --rows picks the
token counts.
python -m benchmarks.fused_qmm_ab2 OUT.json [--tiles T,T] [--rows 16,64,256,1024]"""

import argparse
import json

import mlx.core as mx

from esmc_mlx.bench import time_interleaved
from esmc_mlx.runtime import kernels

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--tiles", default="", help="more tiles timed on every shape, e.g. wg,2d128")
p.add_argument("--rows", default="16,64,256,1024")
a = p.parse_args()
out, tiles, ROWS = a.out, [t for t in a.tiles.split(",") if t], [int(r) for r in a.rows.split(",")]
CALLS = 8
SHAPES = [(7680, 2560), (13824, 2560), (2560, 6912), (2560, 2560)]
MODES = {"affine4": ("affine", 4, 64), "mxfp4": ("mxfp4", 4, 32)}
mx.random.seed(0)
res = []
for n, k in SHAPES:
    for name, (mode, bits, gs) in MODES.items():
        wf = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        wq, sc, *rest = mx.quantize(wf, group_size=gs, bits=bits, mode=mode)
        bi = rest[0] if rest else None
        mx.eval(wf, wq, sc, *rest)
        for rows in ROWS:
            xs = [mx.random.normal((rows, k)).astype(mx.bfloat16) for _ in range(CALLS)]
            mx.eval(xs)

            def fused(tile):
                return lambda: mx.eval([kernels.quantized_matmul(x, wq, sc, bi, gs, bits, mode, tile=tile) for x in xs])

            fns = {
                "bf16": lambda: mx.eval([x @ wf.T for x in xs]),
                "dequant": lambda: mx.eval(
                    [x @ kernels.dequantize(wq, sc, bi, gs, bits, mode, mx.bfloat16).T for x in xs]
                ),
                "fused_2d": fused("2d"),
                "fused_1d": fused("1d"),
            }
            for tile in tiles:
                fns[f"fused_{tile}"] = fused(tile)
            if (n, k) == (7680, 2560) and not tiles:
                fns["fused_2d128"] = fused("2d128")
                fns["fused_2d32"] = fused("2d32")
            t = time_interleaved(fns, warmup=2, budget_s=0.15, max_reps=10)
            flops = 2 * rows * n * k
            row = {"n": n, "k": k, "mode": name, "rows": rows, "plan_2d": kernels.qmm2_plan(rows, n, k, "2d")}
            row.update({f"{f}_us": v["median_ms"] * 1e3 / CALLS for f, v in t.items()})
            print(
                f"{name:7s} {n}x{k} rows {rows:5d} "
                + " ".join(f"{f} {row[f + '_us']:.1f}us({flops / row[f + '_us'] / 1e6:.0f}TF)" for f in fns)
                + f"  2d/dequant {row['fused_2d_us'] / row['dequant_us']:.2f} 2d/1d {row['fused_2d_us'] / row['fused_1d_us']:.2f}",
                flush=True,
            )
            res.append(row)
        json.dump(res, open(out, "w"), indent=1)
