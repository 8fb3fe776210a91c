"""Each of CUTLASS's schedules (runtime/cutlass_qmm) and the fused kernel (kernels.quantized_matmul)
on one layer's four weights, one call at a time, for Nsight Compute to time; and cuBLAS on the
same weights in bf16. Quicker than a model under the profiler (``benchmarks.host_overhead
--profile``) when the question is which path or schedule a weight should take: one process,
every path, the calls in a known order.

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --log-file k.csv \\
        python -m benchmarks.cutlass_schedules --model 6B --tokens 128,256 --labels labels.json
    python -m benchmarks.cutlass_schedules --table k.csv labels.json     # medians, us

Each label is called ``--reps`` times, each call evaluated on its own and followed by a marker
kernel (a sine of four values) that delimits its kernels: the fused kernel and cuBLAS may launch
more than one, which the table sums. Weights are random, quantized once per mode.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics

import mlx.core as mx
import mlx.nn as nn

from benchmarks.host_overhead import UNITS, cuda_profiler
from esmc_mlx.bench import environment
from esmc_mlx.runtime import cutlass_qmm, kernels, quantized

# (rows, K) of a layer's q/k/v, o_proj, gate/up and down weights.
WEIGHTS = {
    "6B": {"qkv": (7680, 2560), "o": (2560, 2560), "gate_up": (13824, 2560), "down": (2560, 6912)},
    "300M": {"qkv": (2880, 960), "o": (960, 960), "gate_up": (5120, 960), "down": (960, 2560)},
}
QUANT = {"affine4": ("affine", 4, 64), "affine8": ("affine", 8, 64), "mxfp4": ("mxfp4", 4, 32)}


def call(m: nn.Module, x: mx.array, path: str) -> mx.array:
    """One call of ``path`` through layer ``m``: "fused" (kernels.quantized_matmul, as the layer
    calls it), "dequantize" (quantized.dequantized_weight, then cuBLAS), or a CUTLASS schedule
    (cutlass_qmm.SCHEDULES, forced through its environment switch into cutlass_qmm.matmul; "split-k:N"
    split-K in N slabs) or "cutlass" (cutlass_qmm.matmul, the schedule its own); a CUTLASS path with
    "-mlx-layout" after it takes the weight in MLX's layout, not reordered (cutlass_qmm.reorder)."""
    if path == "fused":
        return kernels.quantized_matmul(x, m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits, m.mode)
    if path == "dequantize":
        return x @ quantized.dequantized_weight(m, mx.bfloat16).T
    if path.endswith("-mlx-layout"):  # the weight as MLX packs it, not reordered
        with environment({cutlass_qmm.REORDER_ENV: "0"}):
            return call(m, x, path.removesuffix("-mlx-layout"))
    schedule, _, parts = path.partition(":")
    forced = {} if path == "cutlass" else {cutlass_qmm.SCHEDULE_ENV: schedule}
    with environment(forced | ({cutlass_qmm.SPLITS_ENV: parts} if parts else {})):
        return cutlass_qmm.matmul(m, x, x.shape[0])


def takes(m: nn.Module, x: mx.array, path: str) -> bool:
    """Whether ``path`` runs as named on ``m``: split-K takes a forced slab count only where it
    cuts K into whole units (cutlass_qmm.splits; elsewhere it would time whole tiles)."""
    parts = path.partition(":")[2]
    if not parts:
        return True
    with environment({cutlass_qmm.SPLITS_ENV: parts}):
        rows, (tokens, k) = m["weight"].shape[0], x.shape
        return cutlass_qmm.splits(rows, tokens, k, cutlass_qmm.split_unit(m)) == int(parts)


def profile(a) -> None:
    labels, calls = [], []
    for tokens in map(int, a.tokens.split(",")):
        for name in a.weights.split(","):
            rows, k = WEIGHTS[a.model][name]
            linear = nn.Linear(k, rows, bias=False)
            linear.weight = (mx.random.normal((rows, k), key=mx.random.key(rows + k)) * 0.02).astype(mx.bfloat16)
            x = mx.random.normal((tokens, k), key=mx.random.key(tokens)).astype(mx.bfloat16)
            mx.eval(linear.weight, x)
            for quant in a.modes.split(","):
                mode, bits, group = QUANT[quant]
                m = quantized.QuantizedLinear.from_linear(linear, group, bits, mode)
                mx.eval(m.parameters(), cutlass_qmm.kernel_scales(m))
                for path in filter(lambda path: takes(m, x, path), a.paths.split(",")):
                    labels.append(f"{tokens} {name} {quant} {path}")
                    calls.append(lambda m=m, x=x, path=path: call(m, x, path))
            labels.append(f"{tokens} {name} bf16 cublas")
            calls.append(lambda x=x, w=linear.weight: x @ w.T)
    marker = mx.arange(4, dtype=mx.float32)
    for fn in calls:  # warm: kernels compiled, graphs captured, workspaces allocated
        mx.eval(fn(), mx.sin(marker))
    mx.synchronize()
    cuda_profiler("cuProfilerStart")
    for fn in calls:
        for _ in range(a.reps):
            mx.eval(fn())
            mx.eval(mx.sin(marker))
    mx.synchronize()
    cuda_profiler("cuProfilerStop")
    with open(a.labels, "w") as f:
        json.dump({"labels": labels, "reps": a.reps}, f)


def table(path: str, labels_path: str) -> dict:
    """Nsight Compute's CSV (gpu__time_duration.sum, in the calls' order) by label, us: a call's
    kernels are those before its marker (the last kernel's name)."""
    spec = json.load(open(labels_path))
    kernels_by_id = {}
    for r in csv.DictReader(line for line in open(path) if line.startswith('"')):
        if r["Metric Name"] == "gpu__time_duration.sum":
            value = float(r["Metric Value"].replace(",", "")) * UNITS[r["Metric Unit"]] * 1e3  # us
            kernels_by_id[int(r["ID"])] = (r["Kernel Name"], value)
    seq = [kernels_by_id[i] for i in sorted(kernels_by_id)]
    marker = seq[-1][0]
    calls, current = [], 0.0
    for name, t in seq:
        if name == marker:
            calls.append(current)
            current = 0.0
        else:
            current += t
    reps = spec["reps"]
    if len(calls) != len(spec["labels"]) * reps:
        raise SystemExit(f"Error: {path}: {len(calls)} calls for {len(spec['labels'])} labels x {reps}")
    out = {}
    for i, label in enumerate(spec["labels"]):
        out[label] = statistics.median(calls[i * reps : (i + 1) * reps])
        print(f"{label:40s} {out[label]:8.1f} us")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="6B", choices=sorted(WEIGHTS))
    p.add_argument("--tokens", default="256", help="token counts, comma-separated")
    p.add_argument("--modes", default="affine4,mxfp4,affine8", help=f"of {', '.join(QUANT)}")
    p.add_argument(
        "--paths",
        default="fused,persistent,persistent-192,persistent-128,stream-k,split-k",
        help="fused, dequantize, cutlass (its schedule's choice) or CUTLASS schedules (split-k:N: N slabs)",
    )
    p.add_argument("--weights", default="qkv,o,gate_up,down", help="a layer's weights, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--labels", default="labels.json", help="where the calls' labels go, in order")
    p.add_argument("--table", nargs=2, metavar=("CSV", "LABELS"), help="print the medians of a profile and exit")
    a = p.parse_args()
    if a.table:
        table(*a.table)
    else:
        profile(a)


if __name__ == "__main__":
    main()
