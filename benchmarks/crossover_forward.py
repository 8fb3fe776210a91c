"""Where quantized_matmul stops paying, measured in whole forwards (issue 16): the shipped model
(random bf16 weights, fused, compiled) quantized one way, timed at B=1 and several token counts
with every block weight through ``quantized_matmul`` (ESMC_MLX_QUANT_MATMUL=quantized) and
through dequantize + matmul (=dequantize), interleaved in one process; then per quantization
the smallest token count from which dequantize + matmul took at most TIE times the time of
quantized_matmul at every larger count: what ``runtime.quantized.CROSSOVER_TOKENS`` holds.

Why whole forwards: timing one weight in bursts of calls (``benchmarks.dequant_kernels``, one
``mx.eval`` of 8 calls) disagreed with the forwards built from those weights. The bursts had
quantized_matmul ahead up to 128-1024 tokens (affine8 on the 6B's gate/up at 256 tokens: 0.22
against 0.26 ms); in whole forwards dequantize + matmul was ahead from 32-128 tokens in every
mode measured (the 6B at 1x256 in affine8: 24.7 ms against 34.3 ms with quantized_matmul), and
the shipped 6B forward at 1x256 in affine8 took 33.7 ms with the burst table, 20.2 ms with
this one. Not isolated: a burst evaluates its 8 dequantizes before its 8 matmuls, so each
dequantized weight has left the 50 MB L2 cache when its GEMM reads it, where in a forward
the GEMM follows its own dequantize; and the forward's graph hides launch costs that a burst
of two kernels per call pays in full. Either way the forward is what users run.

Each model's block weights take one table, by their smaller dimension (the model's hidden size
against quantized.SMALL_WIDTH): the 6B's the "cuda" table, the 300M's "cuda-small". Which
dequantize a weight runs is kernels.DEQUANTIZE_MIN_WIDTH's choice: ours for the 6B's and the
600M's weights, mx.dequantize for the 300M's (until the twenty-second issue-16 session, also for
the 600M's and the 6B's o_proj).

    python -m benchmarks.crossover_forward --model 6B --json $OUT/6b.json       # GPU
    python -m benchmarks.crossover_forward --model 300M --modes nvfp4 --json $OUT/300m.json

On the H200 a mode took about 65 s on the 6B and 25-50 s on the 300M at 8 token counts
(MLX compiles its quantized kernels per shape, and each side traces each shape): budget
10 minutes for all nine modes of the 6B, or split them with --modes.
    python -m benchmarks.crossover_forward --model tiny --device cpu --tokens 16,64 --modes affine4
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx
from mlx.utils import tree_flatten

from benchmarks import save_json
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments
from esmc_mlx.bench import config_for, forward_fns, machine, mlx_model, time_interleaved
from esmc_mlx.quantize import AFFINE_BITS, DEFAULT_GROUP_SIZE, FIXED_MODES
from esmc_mlx.runtime.kernels import QMM_TILE_ENV, QMM_TILES, QMM_WAVES_ENV, QMM_WG_TILE
from esmc_mlx.runtime.quantized import POLICY_ENV, mode_name
from esmc_mlx.testing import random_mlx_model

RECORDS = {
    **{mode_name("affine", b): {"mode": "affine", "bits": b, "group_size": DEFAULT_GROUP_SIZE} for b in AFFINE_BITS},
    **{m: {"mode": m, "bits": bits, "group_size": gs} for m, (gs, bits) in FIXED_MODES.items()},
}
# What each side sets; "bf16" (the unquantized model, for reference) sets nothing.
SIDES = {
    "quantized": {POLICY_ENV: "quantized"},
    "dequantize": {POLICY_ENV: "dequantize"},
    "fused": {POLICY_ENV: "fused"},  # kernels.quantized_matmul where it runs, else the table
    # the same with one warp tile forced (kernels.QMM_TILES, QMM_WG_TILE)
    **{f"fused_{t}": {POLICY_ENV: "fused", QMM_TILE_ENV: t} for t in ("1d", *QMM_TILES, QMM_WG_TILE)},
    "fused_nosplit": {POLICY_ENV: "fused", QMM_WAVES_ENV: "0"},  # K never split: one launch a call
    "shipped": {POLICY_ENV: "auto"},  # what users get: the tables' choice per weight and token count
    "bf16": {},
}


TIE = 1.03  # neighbouring rows of one run move by this much: within it, a tie


def crossover(rows: list[dict]) -> int | None:
    """Smallest token count from which dequantize + matmul took at most TIE times the time of
    quantized_matmul at every larger count (None: quantized_matmul at the largest count). Ties
    go to dequantize + matmul: its time grows slowly with the tokens, quantized_matmul's fast."""
    cross = None
    for r in sorted(rows, key=lambda r: r["tokens"], reverse=True):
        if r["dequantize_ms"] > TIE * r["quantized_ms"]:
            break
        cross = r["tokens"]
    return cross


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,128,256,512,1024,2048", help="token counts (batch 1)")
    p.add_argument(
        "--sides",
        default="quantized,dequantize",
        help="of quantized, dequantize (both needed for the crossover), fused, shipped (the tables' choice) "
        "and bf16 (the unquantized model, for reference)",
    )
    add_forward_arguments(p, modes=",".join(RECORDS))
    a = parse_forward_arguments(p, argv)
    config = config_for(a.model)
    dtype = mx.bfloat16 if a.device == "gpu" else mx.float32
    weights = dict(tree_flatten(random_mlx_model(config, dtype).parameters()))
    tokens = [int(t) for t in a.tokens.split(",")]
    result = {"machine": machine(with_torch=False), "model": a.model, "rows": [], "crossover_tokens": {}}
    sides = a.sides.split(",")
    if not set(sides) <= set(SIDES):
        p.error(f"--sides: {', '.join(sorted(set(sides) - set(SIDES)))} is not one of {', '.join(SIDES)}")
    bf16 = mlx_model(config, weights, fuse=True, compile=True) if "bf16" in sides else None
    for name in a.modes.split(","):
        model = mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[name])
        models = {s: bf16 if s == "bf16" else model for s in sides}
        mine = []
        for t in tokens:
            fns = forward_fns(None, models, 1, t, env=SIDES)
            timed = time_interleaved(fns, warmup=3, budget_s=a.budget)
            row = {"mode": name, "tokens": t, **{f"{s}_ms": timed[s]["median_ms"] for s in sides}}
            if "quantized" in sides and "dequantize" in sides:
                row["dequantize_over_quantized"] = row["dequantize_ms"] / row["quantized_ms"]
            mine.append(row)
            print(
                f"{a.model} {name:8s} 1x{t:<5d} " + ", ".join(f"{s} {row[s + '_ms']:8.2f} ms" for s in sides),
                flush=True,
            )
        result["rows"] += mine
        if "dequantize_over_quantized" in mine[0]:
            result["crossover_tokens"][name] = crossover(mine)
            print(f"{a.model} {name}: dequantize + matmul wins from {result['crossover_tokens'][name]} tokens")
        del model
        gc.collect()
        save_json(a.json, result)  # after every mode: a run cut short keeps what it measured
    return result


if __name__ == "__main__":
    main()
