"""CUTLASS's mixed-input GEMM (runtime/cutlass_qmm) against dequantize + matmul, beside the bf16
model (issue 16): whole forwards of the shipped model (fused, compiled, random weights) with
every call the tables give to dequantize + matmul sent to CUTLASS (``ESMC_MLX_CUTLASS_QMM=1``,
whatever quantized.CUTLASS_TOKENS says) and with none (``=0``), the three interleaved in one
process, and the two quantized sides' logits compared (equal to the bit in the thirty-second
session's runs; they could differ by a bf16 matmul's rounding). Where the second side wins is
what CUTLASS_TOKENS should hold.
``--weights`` first times each of the model's four block weights alone at 256, 1024 and 4096
tokens: bf16 ``x @ w.T``, the shipped dequantize + matmul, CUTLASS (50 calls evaluated
together, the three interleaved, median of 5).

Needs the extension built on the GPU machine: ``esmc-mlx build-cutlass``.

    python -m benchmarks.cutlass_qmm_ab --model 6B --weights --json $OUT/6b.json      # GPU
    python -m benchmarks.cutlass_qmm_ab --model 300M --modes affine4 --shapes 1x1024,16x256
"""

from __future__ import annotations

import argparse
import gc
import os

import mlx.core as mx
import numpy as np

from benchmarks import batched, save_json
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments, random_bf16
from esmc_mlx.bench import forward_fns, machine, mlx_model, parse_shapes, rel_l2, time_interleaved
from esmc_mlx.runtime import cutlass_qmm, kernels
from esmc_mlx.runtime import quantized as rq

SIDES = {"dequantize": {cutlass_qmm.ENV: "0"}, "cutlass": {cutlass_qmm.ENV: "1"}}
CALLS = 50  # a weight's calls evaluated together (benchmarks.batched): GPU-bound


def time_weights(model, record: dict) -> list[dict]:
    """Each block weight's shape in ``model`` (block 0), alone: bf16, dequantize + matmul, CUTLASS."""
    rows = []
    block = model.esmc.layers[0]
    for name, m in block.named_modules():
        if not isinstance(m, rq.QuantizedLinear):
            continue
        n, k = m["weight"].shape[0], m["weight"].shape[1] * 32 // m.bits
        w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
        q, s, b = mx.quantize(w, group_size=m.group_size, bits=m.bits)
        st, bt = mx.contiguous(s.T), mx.contiguous(b.T)
        ext = cutlass_qmm._extension()
        for tokens in (256, 1024, 4096):
            x = mx.random.normal((tokens, k)).astype(mx.bfloat16)
            contenders = {
                "bf16": lambda: x @ w.T,
                "dequantize": lambda: x @ kernels.dequantize(q, s, b, m.group_size, m.bits).T,
                "cutlass": lambda: ext.quantized_matmul(x, q, st, bt, m.bits, m.group_size, cutlass_qmm.TILE_TOKENS),
            }
            t = time_interleaved({k_: batched(fn, CALLS) for k_, fn in contenders.items()}, warmup=1, reps=5)
            row = {"weight": name, "n": n, "k": k, "tokens": tokens, "bits": m.bits}
            row |= {f"{side}_us": t[side]["median_ms"] / CALLS * 1e3 for side in contenders}
            rows.append(row)
            print(
                f"{record['bits']}-bit {name} ({n}x{k}) at {tokens}: bf16 {row['bf16_us']:.1f} us, "
                f"dequantize + matmul {row['dequantize_us'] / row['bf16_us']:.2f}x, "
                f"cutlass {row['cutlass_us'] / row['bf16_us']:.2f}x",
                flush=True,
            )
    return rows


def logits(model, ids, side: str) -> np.ndarray:
    """``model``'s logits with ``side``'s setting, as forward_fns' ``env`` runs the timed side."""
    os.environ.update(SIDES[side])
    try:
        return np.array(model(ids).logits.astype(mx.float32))
    finally:
        os.environ.pop(cutlass_qmm.ENV, None)


def forward_row(bf16, quant: dict, mode: str, batch: int, length: int, budget: float) -> dict:
    """Whole forwards at one shape, the three models interleaved, and the two quantized sides'
    logits compared; printed and returned."""
    fns = forward_fns(None, {"bf16": bf16, **quant}, batch, length, env=SIDES)
    t = {k: v["median_ms"] for k, v in time_interleaved(fns, warmup=3, budget_s=budget).items()}
    ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(batch, length)))
    row = {"mode": mode, "batch": batch, "length": length, **{f"{k}_ms": v for k, v in t.items()}}
    row |= {side + "_over_bf16": t[side] / t["bf16"] for side in SIDES}
    row["logits_rel_l2"] = rel_l2(*(logits(quant[side], ids, side) for side in ("cutlass", "dequantize")))
    ratios = ", ".join(f"{side} {t[side]:.2f} ms ({row[side + '_over_bf16']:.3f})" for side in SIDES)
    print(
        f"{mode} {batch}x{length}: bf16 {t['bf16']:.2f} ms, {ratios}; logits rel. L2 {row['logits_rel_l2']:.1e}",
        flush=True,
    )
    return row


def run_mode(config, weights, bf16, mode: str, a, result: dict) -> None:
    """One quantization: the model without CUTLASS and its twin with it, each shape's row into ``result``."""
    quant = {side: mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode]) for side in SIDES}
    if a.weights:
        result["weights"] += time_weights(quant["dequantize"], RECORDS[mode])
    result["rows"] += [
        forward_row(bf16, quant, mode, batch, length, a.budget) for batch, length in parse_shapes(a.shapes)
    ]
    gc.collect()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", action="store_true", help="also time each block weight alone first")
    add_forward_arguments(p, model="6B", modes="affine4,affine8", shapes="1x256,1x1024,16x256,64x512")
    a = parse_forward_arguments(p, argv)
    if cutlass_qmm._extension() is None:
        raise SystemExit(f"Error: the extension is not built for MLX {mx.__version__}: esmc-mlx build-cutlass")
    config, weights, bf16 = random_bf16(a.model)
    result = {"machine": machine(with_torch=False), "model": a.model, "rows": [], "weights": []}
    for mode in a.modes.split(","):
        run_mode(config, weights, bf16, mode, a, result)  # its two quantized models freed on return
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
