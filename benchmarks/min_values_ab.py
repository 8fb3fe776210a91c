"""A size gate of the quantized path in whole forwards (issue 16), the shipped value against
another (``--value``, default 0: the gate off), beside the bf16 model; the shipped model
(fused, compiled, random weights) in one quantization, interleaved in one process.
``--gate min-values`` (the default): ``kernels.MIN_VALUES``, under which add_layer_norm's
inputs take MLX's ops. ``--gate dequantize``: ``kernels.DEQUANTIZE_MIN_WIDTH``, under which a
weight's smaller dimension sends it to ``mx.dequantize`` instead of this project's kernel (0:
every weight through the kernel; 4096: none). Those kernels are bit-exact, so the logits of
the two quantized sides must be identical (checked). ``--gate small-width``:
``quantized.SMALL_WIDTH``, under which a weight's smaller dimension takes the "cuda-small"
tables (the 300M's); at 0 every weight takes the "cuda" ones (the 6B's). The paths differ then,
so the logits may too. ``--gate together``: ``kernels.TOGETHER_MIN_WEIGHTS``, the fewest of a
block's dequantizes that go in one launch (``--value 5``: never, each weight on its own; the
logits must be identical). Each row also gives the two quantized sides' logits' relative L2
distance (0 where identical; the small-width gate's paths differ by a bf16 matmul's rounding).
``--gate max-blocks``: ``kernels.MAX_BLOCKS``, the grid of this project's dequantize (a
grid-stride loop; fewer blocks would leave SMs to GEMMs it could run beside; logits identical).

    python -m benchmarks.min_values_ab --model 300M --json $OUT/300m.json     # GPU
    python -m benchmarks.min_values_ab --model 600M --gate dequantize --value 4096 --shapes 16x256
    python -m benchmarks.min_values_ab --model 300M --gate small-width --shapes 1x256,1x1024,16x256
    python -m benchmarks.min_values_ab --model 300M --gate together --value 5 --shapes 16x256,1x2048
    python -m benchmarks.min_values_ab --model 6B --gate max-blocks --value 132 --shapes 1x1024
    python -m benchmarks.min_values_ab --model tiny --shapes 1x64 --modes affine4 --device cpu
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx
import numpy as np

from benchmarks import save_json, with_attribute
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments, random_bf16
from esmc_mlx.bench import forward_fns, machine, mlx_model, parse_shapes, rel_l2, time_interleaved
from esmc_mlx.runtime import kernels, quantized

GATES = {  # --gate
    "min-values": (kernels, "MIN_VALUES"),
    "dequantize": (kernels, "DEQUANTIZE_MIN_WIDTH"),
    "small-width": (quantized, "SMALL_WIDTH"),
    "together": (kernels, "TOGETHER_MIN_WEIGHTS"),
    "max-blocks": (kernels, "MAX_BLOCKS"),
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gate", choices=list(GATES), default="min-values", help="which gate (see above)")
    p.add_argument("--value", type=int, default=0, help="the other side's value (default 0: the gate off)")
    add_forward_arguments(p, model="300M", modes="affine4,affine8,mxfp4", shapes="1x256,1x1024,16x256,64x512")
    a = parse_forward_arguments(p, argv)
    owner, name = GATES[a.gate]
    shipped, value = getattr(owner, name), a.value

    def other(fn):
        """``fn`` run with the gate at ``value`` (a trace made so keeps that choice)."""
        return with_attribute(owner, name, value, fn)

    config, weights, bf16 = random_bf16(a.model)
    result = {"machine": machine(with_torch=False), "model": a.model, "gate": name, "shipped": shipped}
    result |= {"other": value, "rows": []}
    for mode in a.modes.split(","):
        quant = {
            side: mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode])
            for side in ("shipped", "other")
        }
        for batch, length in parse_shapes(a.shapes):
            fns = forward_fns(None, {"bf16": bf16, **quant}, batch, length)
            fns["other"] = other(fns["other"])
            t = time_interleaved(fns, warmup=3, budget_s=a.budget)
            ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(batch, length)))
            other_logits = other(lambda model=quant["other"], ids=ids: model(ids).logits)()
            shipped_logits = quant["shipped"](ids).logits
            same = mx.array_equal(other_logits, shipped_logits)
            f32 = [np.array(y.astype(mx.float32)) for y in (other_logits, shipped_logits)]
            row = {"mode": mode, "batch": batch, "length": length, **{f"{k}_ms": v["median_ms"] for k, v in t.items()}}
            row |= {
                "shipped_over_bf16": row["shipped_ms"] / row["bf16_ms"],
                "other_over_bf16": row["other_ms"] / row["bf16_ms"],
                "shipped_over_other": row["shipped_ms"] / row["other_ms"],
            }
            row["logits_identical"] = bool(same.item())
            row["logits_rel_l2"] = rel_l2(*f32)
            result["rows"].append(row)
            print(
                f"{a.model} {mode} {batch}x{length}: bf16 {row['bf16_ms']:.2f} ms, {name} = {shipped} "
                f"{row['shipped_ms']:.2f} ({row['shipped_over_bf16']:.3f}), = {value} {row['other_ms']:.2f} "
                f"({row['other_over_bf16']:.3f}); {row['shipped_over_other']:.3f}, "
                f"logits identical: {row['logits_identical']} (rel. L2 {row['logits_rel_l2']:.1e})",
                flush=True,
            )
        del quant
        gc.collect()
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
