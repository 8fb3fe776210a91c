"""Where a forward's time goes on the GPU: the host (MLX encoding the graph into CUDA graphs and
launching them) or the kernels, and which kernels (issue 16).

Three measurements of the same random-weight model (6B-shaped by default, ``--layers`` of them:
every layer does the same work, so a few stand for all 80):
  * wall: a whole forward, logits evaluated (``mx.eval``), interleaved across the modes;
  * host: until ``mx.async_eval`` returns, which is when MLX has encoded every kernel of the
    forward and launched its CUDA graphs (it blocks only once more than a handful of graphs
    are in flight, so on a GPU-bound forward host < wall, on a host-bound one host ~ wall).
    Only for a forward that runs as one graph (``chunk`` None in the rows): a chunked one
    (``ESMC.chunk_layers``; the whole 6B from 1x256, 16 of its layers from 1x1024) waits for
    its previous chunk inside the model call, so its "graph built" time holds most of the wall;
  * kernels (``--profile``, under Nsight Compute): each kernel's GPU time in one forward
    between cuProfilerStart and cuProfilerStop; ``--kernels CSV`` groups them (GEMM, fused
    quantized matmul, dequantize, attention, our row kernels, the rest) and sums them: what
    the GPU is busy for, against the wall time above.

    python -m benchmarks.host_overhead --layers 16 --json $OUT/host.json
    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --log-file $OUT/k_affine4_1x256.csv \\
        python -m benchmarks.host_overhead --layers 4 --modes affine4 --shapes 1x256 --profile
    python -m benchmarks.host_overhead --kernels $OUT/k_affine4_1x256.csv
    python -m benchmarks.host_overhead --model tiny --device cpu --modes bf16,affine4 --shapes 1x16
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from benchmarks.forward_args import add_forward_arguments, models_per_mode, parse_forward_arguments
from esmc_mlx.bench import forward_fns, machine, parse_shapes, time_interleaved

# Kernel name -> group, first match wins (names as Nsight Compute prints them).
GROUPS = (
    # runtime/cutlass_qmm's kernels: CUTLASS's GEMM (cuBLAS's names differ) and the extension's
    # own (namespace esmc_qmm: split-K's sum, the strided copy)
    ("cutlass qmm", r"GemmUniversal|esmc_qmm::"),
    ("fused qmm", r"esmc_qmm"),
    ("dequantize", r"esmc_dequant|dequantize|affine_dequant|fp_dequant"),
    ("quantized_matmul", r"qmm|qmv|quantized|gather_qmm"),
    # the embedding's lookup, the forward's first kernel: under Nsight Compute it reads 0.15-0.23
    # ms for 256 rows (forty-fourth issue-16 session), so the tables leave it out
    (EMBEDDING := "embedding gather", r"mlx::gather<"),
    ("gemm", r"gemm|gemv|sm90_xmma|nvjet|cutlass|cublas|splitKreduce"),
    ("attention", r"sdpa|fmha|flash|cudnn|attention|softmax"),
    ("row kernels", r"esmc_"),
)
UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}


def group(name: str) -> str:
    for label, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def kernel_table(path: Path) -> dict:
    """Nsight Compute's CSV of gpu__time_duration.sum -> ms per group, kernel count, total."""
    groups: dict[str, dict] = {}
    names: dict[str, float] = {}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not CSV
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ms = float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]]
        g = groups.setdefault(group(row["Kernel Name"]), {"ms": 0.0, "kernels": 0})
        g["ms"] += ms
        g["kernels"] += 1
        short = row["Kernel Name"].split("(")[0][:80]
        names[short] = names.get(short, 0.0) + ms
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    total = sum(g["ms"] for g in groups.values())
    return {
        "total_ms": total,
        "without_gather_ms": total - groups.get(EMBEDDING, {"ms": 0.0})["ms"],
        "kernels": sum(g["kernels"] for g in groups.values()),
        "groups": groups,
        "top": [{"name": n, "ms": ms} for n, ms in top],
    }


def host_ms(model, ids: mx.array, reps: int) -> dict:
    """Median ms until the graph is built (the model call) and until async_eval returns."""
    build, launch = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = model(ids).logits
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        build.append(t1 - t0)
        launch.append(t2 - t0)
    return {"build_ms": statistics.median(build) * 1e3, "host_ms": statistics.median(launch) * 1e3}


def cuda_profiler(call: str) -> None:
    """cuProfilerStart / cuProfilerStop from the driver: Nsight Compute's window."""
    err = getattr(ctypes.CDLL("libcuda.so.1"), call)()
    if err:
        raise RuntimeError(f"{call} returned CUDA error {err}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_forward_arguments(p, modes="bf16,affine4,mxfp4,affine8", shapes="1x256,1x1024,16x256")
    p.add_argument("--layers", type=int, help="layers of the model (default: the model's own)")
    p.add_argument("--reps", type=int, default=10, help="forwards timed for the host measurement")
    p.add_argument("--profile", action="store_true", help="one forward per mode and shape in the profiler window")
    p.add_argument("--kernels", nargs="+", type=Path, help="group Nsight Compute CSVs and exit")
    if "--kernels" in (argv if argv is not None else sys.argv[1:]):
        a = p.parse_args(argv)
        out = {str(path): kernel_table(path) for path in a.kernels}
        for path, t in out.items():
            groups = ", ".join(f"{k} {v['ms']:.2f} ms ({v['kernels']})" for k, v in sorted(t["groups"].items()))
            print(
                f"{path}: {t['total_ms']:.4f} ms in {t['kernels']} kernels ({t['without_gather_ms']:.4f} without "
                f"the {EMBEDDING}): {groups}"
            )
            for k in t["top"]:
                print(f"    {k['ms']:8.3f} ms  {k['name']}")
        save_json(a.json, out)
        return out
    a = parse_forward_arguments(p, argv)
    modes = a.modes.split(",")
    config, models = models_per_mode(a, modes)
    result = {"machine": machine(with_torch=False), "model": a.model, "layers": config.num_hidden_layers, "rows": []}
    for batch, length in parse_shapes(a.shapes):
        ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(batch, length)))
        fns = forward_fns(None, models, batch, length)
        if a.profile:
            for fn in fns.values():
                fn(), fn(), fn()  # traced, compiled, warm
            for fn in fns.values():
                mx.synchronize()
                cuda_profiler("cuProfilerStart")
                fn()
                mx.synchronize()
                cuda_profiler("cuProfilerStop")
            continue
        wall = time_interleaved(fns, warmup=3, budget_s=a.budget)
        for m in modes:
            row = {"mode": m, "batch": batch, "length": length, "chunk": models[m]._chunk_for(ids)}
            row["wall_ms"] = wall[m]["median_ms"]
            row.update(host_ms(models[m], ids, a.reps))
            row["host_over_wall"] = row["host_ms"] / row["wall_ms"]
            result["rows"].append(row)
            print(
                f"{a.model}/{config.num_hidden_layers} layers {m:8s} {batch}x{length}: wall {row['wall_ms']:.2f} ms, "
                f"host {row['host_ms']:.2f} ms (graph built in {row['build_ms']:.2f}), host/wall {row['host_over_wall']:.2f}"
                + (f" (chunked every {row['chunk']} blocks)" if row["chunk"] else ""),
                flush=True,
            )
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
