"""What a weight's dequantize costs the GPU and the host (issue 16): ``mx.dequantize`` against
this project's kernel (``kernels.dequantize``, taken at every width here), on a model's block
weights (fused q/k/v, o, fused gate/up, down) into bf16.

GPU time, under Nsight Compute: each weight and mode in the profiler window, ``--reps`` rounds
of mx.dequantize, the kernel, and MLX filling the same bf16 array with a constant (what writing
it costs at the least); then ``--kernels`` reads the CSV back (same --model, --modes, --reps)
into microseconds per call and TB/s written:

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --log-file $OUT/dq.csv \\
        python -m benchmarks.dequant_cost --model 300M --profile
    python -m benchmarks.dequant_cost --model 300M --kernels $OUT/dq.csv

Host time (no profiler): every block weight of ``--layers`` layers dequantized in one graph,
one call a weight (``mx.dequantize``, this project's kernel) or, on CUDA, one a block
(``kernels.dequantize_together``), eager and as one compiled function, each side timed until the graph is built, until
``mx.async_eval`` returns (every kernel encoded and launched: the host's share) and until done;
the sides interleave, medians of ``--reps`` rounds. ``--call-arrays`` (CUDA) times custom
kernel calls that do no work by how many arrays they take and give, to split that host time:

    python -m benchmarks.dequant_cost --model 300M --json $OUT/host.json
    python -m benchmarks.dequant_cost --model 300M --call-arrays --reps 30
    python -m benchmarks.dequant_cost --model tiny --device cpu --reps 3      # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import save_json, with_attribute
from benchmarks.host_overhead import UNITS
from esmc_mlx.bench import config_for, machine
from esmc_mlx.runtime import kernels
from esmc_mlx.runtime import quantized as quantized_path

MODES = {"affine4": ("affine", 4, 64), "mxfp4": ("mxfp4", 4, 32), "affine8": ("affine", 8, 64)}
GPU_SIDES = ("mlx", "ours", "fill")


def block_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of a block's quantized weights: fused q/k/v, o, fused gate/up, down."""
    c = config_for(model)
    d, f = c.hidden_size, c.intermediate_size
    return [(3 * d, d), (d, d), (2 * f, d), (d, f)]


def quantized(shape: tuple[int, int], mode: str, seed: int = 0) -> tuple:
    name, bits, group = MODES[mode]
    x = (mx.random.normal(shape, key=mx.random.key(seed)) * 0.02).astype(mx.bfloat16)
    w, scales, *biases = mx.quantize(x, group_size=group, bits=bits, mode=name)
    return w, scales, biases[0] if biases else None


def dequantizers(mode: str) -> dict:
    """mode's two dequantizes of (w, scales, biases) into bf16: MLX's and this project's."""
    name, bits, group = MODES[mode]

    def mlx(w, s, b):
        return mx.dequantize(w, s, b, group_size=group, bits=bits, mode=name, dtype=mx.bfloat16)

    def ours(w, s, b):
        return with_attribute(
            kernels, "DEQUANTIZE_MIN_WIDTH", 0, lambda: kernels.dequantize(w, s, b, group, bits, name, mx.bfloat16)
        )()

    return {"mlx": mlx, "ours": ours}


def labels(model: str, modes: list[str]) -> list[str]:
    return [f"{n}x{k} {mode}" for n, k in block_shapes(model) for mode in modes]


def profile(model: str, modes: list[str], reps: int) -> None:
    """The profiler window's calls, in ``labels`` order (the two dequantizes checked equal first)."""
    driver = ctypes.CDLL("libcuda.so.1")
    for (n, k), mode in ((shape, mode) for shape in block_shapes(model) for mode in modes):
        w, s, b = quantized((n, k), mode)
        sides = {side: (lambda f=f: f(w, s, b)) for side, f in dequantizers(mode).items()}
        sides["fill"] = lambda: mx.full((n, k), 1.5, mx.bfloat16)
        want, got = sides["mlx"](), sides["ours"]()
        if not mx.array_equal(want.view(mx.uint16), got.view(mx.uint16)).item():
            raise SystemExit(f"{n}x{k} {mode}: the kernel's output differs from mx.dequantize's")
        for f in sides.values():
            mx.eval(f())
        mx.synchronize()
        driver.cuProfilerStart()
        for _ in range(reps):
            for f in sides.values():
                mx.eval(f())
        mx.synchronize()
        driver.cuProfilerStop()


def side_of(kernel: str) -> str:
    if "esmc_dequantize" in kernel:
        return "ours"
    return "mlx" if "dequant" in kernel.lower() else "fill"


def kernel_table(path: Path, model: str, modes: list[str], reps: int) -> list[dict]:
    """Nsight Compute's CSV of ``profile``'s window -> per weight and mode, the median us of each side."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not CSV
    times: dict[str, list[float]] = {side: [] for side in GPU_SIDES}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            us = float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]] * 1e3
            times[side_of(row["Kernel Name"])].append(us)
    rows = []
    for i, label in enumerate(labels(model, modes)):
        n, k = map(int, label.split()[0].split("x"))
        row = {
            "weight": label,
            **{f"{s}_us": statistics.median(v[i * reps : (i + 1) * reps]) for s, v in times.items()},
        }
        row["ours_tb_s"] = n * k * 2 / row["ours_us"] / 1e6  # bf16 written
        row["mlx_over_ours"] = row["mlx_us"] / row["ours_us"]
        row["ours_over_fill"] = row["ours_us"] / row["fill_us"]
        rows.append(row)
        print(
            f"{label:20s} mx.dequantize {row['mlx_us']:7.2f} us, ours {row['ours_us']:7.2f} us "
            f"({row['ours_tb_s']:.2f} TB/s), fill {row['fill_us']:7.2f} us | mlx / ours {row['mlx_over_ours']:.2f}, "
            f"ours / fill {row['ours_over_fill']:.2f}"
        )
    return rows


def host_times(fns: dict, reps: int) -> dict[str, tuple[float, float, float]]:
    """Each side of ``fns`` (() -> arrays) interleaved: median ms until its graph is built,
    until ``mx.async_eval`` returns (every kernel encoded and launched) and until done."""
    samples: dict[str, list[tuple]] = {name: [] for name in fns}
    for r in range(reps + 2):  # two rounds of warm-up (traces, compiled kernels)
        for name, fn in fns.items():
            mx.synchronize()
            t0 = time.perf_counter()
            outs = fn()
            t1 = time.perf_counter()
            mx.async_eval(outs)
            t2 = time.perf_counter()
            mx.eval(outs)
            t3 = time.perf_counter()
            if r >= 2:
                samples[name].append((t1 - t0, t2 - t0, t3 - t0))
    return {name: tuple(statistics.median(s[i] for s in v) * 1e3 for i in range(3)) for name, v in samples.items()}


def regroup(arrays: list, biased: bool) -> list[tuple]:
    """Flat (w, scales[, biases], w, ...) back into (w, scales, biases) triples (biases None
    where the mode has none): what a compiled function receives as its flat inputs."""
    step = 3 if biased else 2
    return [(*arrays[i : i + 2], arrays[i + 2] if biased else None) for i in range(0, len(arrays), step)]


def together(triples: list[tuple], mode: str) -> list[mx.array]:
    """Every four consecutive weights (a block's) dequantized into bf16 by one launch
    (kernels.dequantize_together: one output a block)."""
    name, bits, group = MODES[mode]
    blocks = (triples[i : i + 4] for i in range(0, len(triples), 4))
    return [kernels.dequantize_together(b, group, bits, name, mx.bfloat16) for b in blocks]


def host(model: str, modes: list[str], layers: int, reps: int) -> list[dict]:
    """Every block weight of ``layers`` layers dequantized in one graph, per side (eager and
    compiled): median ms until built, launched (async_eval returned) and done."""
    rows = []
    for mode in modes:
        weights = [quantized(shape, mode, seed) for seed, shape in enumerate(block_shapes(model) * layers)]
        mx.eval(weights)
        flat = [a for triple in weights for a in triple if a is not None]
        biased = weights[0][2] is not None
        fns = {}
        for side, f in dequantizers(mode).items():
            fns[f"{side} eager"] = lambda f=f: [f(*t) for t in weights]
            compiled = mx.compile(lambda *arrays, f=f: [f(*t) for t in regroup(arrays, biased)])
            fns[f"{side} compiled"] = lambda c=compiled: c(*flat)
        if kernels.on_cuda():  # a block's four weights in one launch (kernels.dequantize_together)
            fns["together eager"] = lambda mode=mode: together(weights, mode)
            compiled = mx.compile(lambda *arrays, mode=mode: together(regroup(arrays, biased), mode))
            fns["together compiled"] = lambda c=compiled: c(*flat)
        for name, (built, launched, done) in host_times(fns, reps).items():
            row = {"mode": mode, "side": name, "calls": len(weights), "built_ms": built, "launched_ms": launched}
            row |= {"done_ms": done, "host_us_per_call": launched / len(weights) * 1e3}
            rows.append(row)
            print(
                f"{mode:8s} {name:14s} {len(weights)} dequantizes: built {built:6.2f} ms, launched {launched:6.2f} ms, "
                f"done {done:6.2f} ms ({row['host_us_per_call']:.1f} us of host a call)",
                flush=True,
            )
    return rows


# A custom kernel that does no work (one thread copies one element): what MLX's host side costs
# per call, per input and per output, apart from what the kernel does.
_NO_WORK = "if (blockIdx.x == 0 && threadIdx.x == 0) { out0[0] = in0[0]; }"


def call_arrays(model: str, layers: int, reps: int) -> list[dict]:
    """Host cost of ``mx.fast.cuda_kernel`` calls by how many arrays they take and give: one
    compiled graph of ``layers`` calls (one a block, as dequantize_together), each with the
    block's affine 8-bit weights as inputs (4 x w, scales, biases: 12; or the first weight's
    3) and their bf16 copies' shapes as outputs (4, or 1), against the real one-a-block
    dequantize (one output), alone and with the block's four matmuls by views of it. A
    least-squares fit splits the no-work calls' host time into a part per call, per input and
    per output."""
    blocks = [
        [quantized(shape, "affine8", seed) for seed, shape in enumerate(block_shapes(model))] for _ in range(layers)
    ]
    mx.eval(blocks)
    flat = [a for block in blocks for triple in block for a in triple]
    variants = [(12, 4), (6, 4), (3, 4), (3, 2), (12, 1), (3, 1), (1, 1)]  # (inputs, outputs)
    fns = {}
    for n_in, n_out in variants:
        kernel = mx.fast.cuda_kernel(
            name=f"esmc_no_work_{n_in}_{n_out}",
            input_names=[f"in{i}" for i in range(n_in)],
            output_names=[f"out{j}" for j in range(n_out)],
            source=_NO_WORK,
        )

        def calls(*flat, kernel=kernel, n_in=n_in, n_out=n_out):
            outs = []
            for b in range(layers):
                arrays = flat[b * 12 : b * 12 + n_in]
                shapes = [(w.shape[0], w.shape[1] * 4) for w, _, _ in blocks[b][:n_out]]
                outs += kernel(
                    inputs=list(arrays),
                    grid=(32, 1, 1),
                    threadgroup=(32, 1, 1),
                    output_shapes=shapes,
                    output_dtypes=[mx.bfloat16] * n_out,
                )
            return outs

        compiled = mx.compile(calls)
        fns[f"{n_in} in, {n_out} out"] = lambda c=compiled: c(*flat)
    compiled = mx.compile(lambda *arrays: together(regroup(arrays, biased=True), "affine8"))
    fns["dequantize_together (12 in, 1 out)"] = lambda: compiled(*flat)
    c = config_for(model)
    xs = [mx.zeros((16, n), mx.bfloat16) for n in (c.hidden_size,) * 3 + (c.intermediate_size,)]

    def block_matmuls(*arrays):
        """Each block's dequantize, then its four matmuls by w.T views, as Layer.step has them."""
        triples, ys = regroup(arrays, biased=True), []
        for b in range(0, len(triples), 4):
            values = kernels.dequantize_together(triples[b : b + 4], 64, 8, "affine", mx.bfloat16)
            shapes = [kernels.dequantized_shape(w, 8) for w, _, _ in triples[b : b + 4]]
            ys += [x @ wt for x, wt in zip(xs, quantized_path.transposed_views(values, shapes), strict=True)]
        return ys

    compiled_block = mx.compile(block_matmuls)
    fns["dequantize_together, 4 w.T views, 4 matmuls"] = lambda: compiled_block(*flat)
    rows = []
    for name, (_, launched, _) in host_times(fns, reps).items():
        row = {"side": name, "calls": layers, "launched_ms": launched, "host_us_per_call": launched / layers * 1e3}
        rows.append(row)
        print(
            f"{name:36s} {layers} calls: launched {launched:6.2f} ms ({row['host_us_per_call']:.1f} us a call)",
            flush=True,
        )
    fit = [
        (n_in, n_out, r["host_us_per_call"]) for (n_in, n_out), r in zip(variants, rows[: len(variants)], strict=True)
    ]
    a = np.array([[1.0, i, o] for i, o, _ in fit])
    per_call, per_input, per_output = np.linalg.lstsq(a, np.array([t for _, _, t in fit]), rcond=None)[0]
    print(f"fit: {per_call:.1f} us a call + {per_input:.2f} us an input + {per_output:.2f} us an output")
    rows.append({"fit_us": {"call": per_call, "input": per_input, "output": per_output}})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="300M", help="6B, 600M, 300M or tiny: whose block weights")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    p.add_argument("--reps", type=int, default=10, help="timed rounds (profile: calls of each side)")
    p.add_argument("--layers", type=int, help="host: layers of weights in the graph (default: the model's)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--profile", action="store_true", help="run the calls for Nsight Compute's window")
    p.add_argument("--kernels", type=Path, help="read Nsight Compute's CSV of a --profile run")
    p.add_argument("--call-arrays", action="store_true", help="host: no-work kernel calls by their arrays")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    modes = a.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes: {', '.join(unknown)} not among {', '.join(MODES)}")
    result = {"machine": machine(with_torch=False), "model": a.model}
    if a.profile:
        profile(a.model, modes, a.reps)
        return result
    if a.kernels:
        result["gpu"] = kernel_table(a.kernels, a.model, modes, a.reps)
    elif a.call_arrays:
        result["call_arrays"] = call_arrays(a.model, a.layers or config_for(a.model).num_hidden_layers, a.reps)
    else:
        result["host"] = host(a.model, modes, a.layers or config_for(a.model).num_hidden_layers, a.reps)
    return save_json(a.json, result)


if __name__ == "__main__":
    main()
