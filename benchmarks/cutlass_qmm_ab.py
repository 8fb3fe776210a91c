"""CUTLASS's mixed-input GEMM (runtime/cutlass_qmm) against dequantize + matmul and the fused
kernel, beside the bf16 model (issue 16): whole forwards of the shipped model (fused, compiled,
random weights), all sides interleaved in one process, and each side's logits compared with
dequantize + matmul's. The sides:
``dequantize`` (every call by dequantize + matmul, ``ESMC_MLX_QUANT_MATMUL=dequantize``, CUTLASS
off), ``fused`` (the tables with CUTLASS off: inside FUSED_TOKENS' windows the fused kernel),
CUTLASS at every call (``ESMC_MLX_CUTLASS_QMM=1`` with the policy forced to dequantize + matmul)
as ``persistent`` (whole 128 x 256 tiles per SM), ``stream-k`` (every tile's K shared among the
SMs), ``persistent-192`` (whole 128 x 192 tiles), ``split-k`` (K in slabs side by side) or
``cutlass`` (cutlass_qmm.schedule's choice among them), and ``shipped`` (the tables as they
stand); TABLE_SIDES run the shipped settings with some of quantized's and cutlass_qmm's tables
replaced (``small-fill-0.1``: CUTLASS_OVER_FUSED's least fill on the small models' table;
``no-split``: split-K off, as before the forty-third session); ``ops-residual`` adds each residual
stream by MLX's ops instead of in split-K's sum (as before the forty-fourth), ``norm-after-sum``
leaves the LayerNorm after it to MLX (as before the forty-seventh). Where a CUTLASS side wins is
what quantized.CUTLASS_TOKENS, quantized.CUTLASS_OVER_FUSED and cutlass_qmm.schedule should
hold.

Per-kernel GPU times are Nsight Compute's (benchmarks.host_overhead --profile), not timed here:
calls evaluated together run concurrently in MLX's CUDA graph (its nodes wait only for their
inputs), which hides a kernel's idle SMs. Timed that way (fifty calls a weight), CUTLASS's
persistent tiles read 0.97x the bf16 matmul for a 6B block at 1024 tokens (thirty-first
session); one after another under Nsight Compute they took 1.26x (thirty-third).

Needs the extension built on the GPU machine: ``esmc-mlx build-cutlass``.

    python -m benchmarks.cutlass_qmm_ab --model 6B --shapes 1x512,1x1024 --json $OUT/6b.json      # GPU
    python -m benchmarks.cutlass_qmm_ab --model 300M --modes affine4 --sides dequantize,cutlass
    python -m benchmarks.cutlass_qmm_ab --model 300M --shapes 1x64,1x128,1x256 --sides dequantize,fused,cutlass
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from unittest import mock

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments, random_bf16
from esmc_mlx.bench import environment, forward_fns, machine, mlx_model, parse_shapes, rel_l2, time_interleaved
from esmc_mlx.runtime import cutlass_qmm, quantized
from esmc_mlx.runtime.model import FUSED_NORM_ENV

EVERY_CALL = {cutlass_qmm.ENV: "1", quantized.POLICY_ENV: "dequantize"}  # CUTLASS at every token count
SIDES = {
    "dequantize": {cutlass_qmm.ENV: "0", quantized.POLICY_ENV: "dequantize"},
    "fused": {cutlass_qmm.ENV: "0"},
    **{forced: {**EVERY_CALL, cutlass_qmm.SCHEDULE_ENV: forced} for forced in cutlass_qmm.SCHEDULES},
    "cutlass": EVERY_CALL,
    "shipped": {},
    "mlx-layout": {cutlass_qmm.REORDER_ENV: "0"},  # shipped, CUTLASS's weights in MLX's layout
    "cutlass-mlx-layout": {**EVERY_CALL, cutlass_qmm.REORDER_ENV: "0"},
    # shipped, each residual add by MLX's ops, not in split-K's sum (nor kernels.add_layer_norm,
    # which takes only inputs of MIN_VALUES or more: not the B=1 shapes)
    "ops-residual": {FUSED_NORM_ENV: "0"},
}
# Sides that run the shipped settings with some of quantized's and cutlass_qmm's tables replaced:
# a table's A/B (forty-first issue-16 session: the small models' least fill, not adopted;
# forty-third: split-K, and CUTLASS on the 6B's o_proj and down_proj from 128 tokens with it).
SIX_B_EVERY_WEIGHT = {"CUTLASS_OVER_FUSED": {**quantized.CUTLASS_OVER_FUSED, "cuda": (128, 0.0)}}
TABLE_SIDES = {
    "small-fill-0.1": {quantized: {"CUTLASS_OVER_FUSED": {**quantized.CUTLASS_OVER_FUSED, "cuda-small": (128, 0.1)}}},
    "small-fill-0.2": {quantized: {"CUTLASS_OVER_FUSED": {**quantized.CUTLASS_OVER_FUSED, "cuda-small": (128, 0.2)}}},
    "no-split": {cutlass_qmm: {"SPLIT_K_BELOW_FILL": 0.0}},  # as before split-K
    # split-K on the 6B's four weights from 128 tokens (K in slabs wherever the tiles fill less than half a wave)
    "split-every-weight": {quantized: SIX_B_EVERY_WEIGHT, cutlass_qmm: {"SPLIT_K_BELOW_FILL": 0.5, "SPLIT_K_MIN_K": 0}},
    # and on its o_proj and down_proj only (shipped on the 6B)
    "split-o-down": {quantized: SIX_B_EVERY_WEIGHT, cutlass_qmm: {"SPLIT_K_BELOW_FILL": 0.2}},
    "no-128": {cutlass_qmm: {"NARROW_TILES": (192,)}},  # no 128 x 128 tile, as before it
    # products added to the residual stream split K from 2048 as the others (the 300M's o_proj whole)
    "added-min-k-2048": {cutlass_qmm: {"SPLIT_K_MIN_K_ADDED": 2048}},
    # split-K's slabs in 256-token tiles only (as before the forty-sixth session), or a tie to the narrower
    "split-k-256": {cutlass_qmm: {"SPLIT_K_TILES": (cutlass_qmm.TILE_TOKENS,)}},
    "split-k-ties-128": {cutlass_qmm: {"SPLIT_K_TILES": (128, cutlass_qmm.TILE_TOKENS)}},
    # the LayerNorm after the residual add by MLX, not in split-K's sum (as before the forty-seventh session)
    "norm-after-sum": {cutlass_qmm: {"NORM_IN_SUM": False}},
}


class WithTables:
    """A model whose calls (its compiled trace among them) run with ``tables`` set: {module: {name: value}}."""

    def __init__(self, model, tables: dict):
        self.model, self.tables = model, tables

    def __call__(self, ids):
        with contextlib.ExitStack() as stack:
            for module, names in self.tables.items():
                stack.enter_context(mock.patch.multiple(module, **names))
            return self.model(ids)


def logits(model, ids, side: str) -> np.ndarray:
    """``model``'s logits with ``side``'s setting, as forward_fns' ``env`` runs the timed side."""
    with environment(SIDES.get(side, {})):
        return np.array(model(ids).logits.astype(mx.float32))


def forward_row(bf16, quant: dict, mode: str, batch: int, length: int, budget: float) -> dict:
    """Whole forwards at one shape, the models interleaved, and each CUTLASS side's logits
    compared with dequantize + matmul's; printed and returned."""
    fns = forward_fns(None, {"bf16": bf16, **quant}, batch, length, env=SIDES)
    t = {k: v["median_ms"] for k, v in time_interleaved(fns, warmup=3, budget_s=budget).items()}
    ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(batch, length)))
    row = {"mode": mode, "batch": batch, "length": length, **{f"{k}_ms": v for k, v in t.items()}}
    row |= {side + "_over_bf16": t[side] / t["bf16"] for side in quant}
    reference = logits(quant["dequantize"], ids, "dequantize") if "dequantize" in quant else None
    for side in quant:
        if side != "dequantize" and reference is not None:
            row[side + "_logits_rel_l2"] = rel_l2(logits(quant[side], ids, side), reference)
    ratios = ", ".join(
        f"{side} {t[side]:.2f} ms ({row[side + '_over_bf16']:.3f}"
        + (f", rel. L2 {row[side + '_logits_rel_l2']:.1e})" if side + "_logits_rel_l2" in row else ")")
        for side in quant
    )
    print(f"{mode} {batch}x{length}: bf16 {t['bf16']:.2f} ms, {ratios}", flush=True)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_forward_arguments(p, model="6B", modes="affine4,affine8", shapes="1x256,1x1024,16x256,64x512")
    p.add_argument(
        "--sides",
        default="dequantize,fused,cutlass",
        help=f"quantized sides, comma-separated: {', '.join([*SIDES, *TABLE_SIDES])}",
    )
    a = parse_forward_arguments(p, argv)
    if cutlass_qmm._extension() is None:
        raise SystemExit(f"Error: the extension is not built for MLX {mx.__version__}: esmc-mlx build-cutlass")
    sides = a.sides.split(",")
    known = [*SIDES, *TABLE_SIDES]
    if unknown := sorted(set(sides) - set(known)):
        raise SystemExit(f"Error: --sides: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    config, weights, bf16 = random_bf16(a.model)
    result = {"machine": machine(with_torch=False), "model": a.model, "rows": []}
    for mode in a.modes.split(","):
        quant = {side: mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode]) for side in sides}
        quant |= {side: WithTables(quant[side], TABLE_SIDES[side]) for side in sides if side in TABLE_SIDES}
        result["rows"] += [forward_row(bf16, quant, mode, b, n, a.budget) for b, n in parse_shapes(a.shapes)]
        del quant
        gc.collect()
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
