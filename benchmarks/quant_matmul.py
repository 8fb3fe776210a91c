"""Quantized matmul vs dequantize-then-matmul vs the float matmul, by token count.

For each linear shape (ESMC 300M and 6B MLP projections by default), mode and token count T
it times, side by side in one run:
  qmm      mx.quantized_matmul(x, packed weight)        -- what nn.QuantizedLinear runs
  deq+mm   mx.dequantize(weight) then x @ w.T            -- the weight re-made per call
  float    x @ w.T with a resident float weight           -- the unquantized twin
in the compute dtype the runtime uses there (float32 on the CPU backend, bfloat16 on a GPU),
and reports per (mode, shape) the crossover: the smallest T from which deq+mm is faster at
every larger measured T. The CPU table of esmc_mlx/runtime/dispatch.py takes those numbers.

    python benchmarks/quant_matmul.py                       # CPU, prints the tables
    python benchmarks/quant_matmul.py --device gpu --json out/quant_matmul_h200.json --doc
    python benchmarks/quant_matmul.py --from-json cpu.json --doc   # re-render the doc's table

--doc rewrites the table for this backend in docs/quantization.md (between its
``quant_matmul_<backend>`` markers).

Times are the minimum of --repeat runs after one warm-up (min, not median: on a shared host
the minimum is the least disturbed). When qmm is already --give-up times slower than deq+mm
at two consecutive token counts, larger counts skip qmm (it only scales linearly from there;
the table prints "-"): on the CPU, qmm at 16k tokens of a 6B projection would take minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlx.core as mx  # noqa: E402

import esmc_mlx  # noqa: E402,F401  (loads OpenBLAS before mlx on Linux)
from benchmarks import save_json  # noqa: E402

SHAPES = {  # (out, in) of the largest linears: gate/up (d -> f) of each model
    "300M": (2560, 960),
    "600M": (3072, 1152),
    "6B": (6912, 2560),
}
MODES = {  # name: (mode, bits, group size)
    "affine4": ("affine", 4, 64),
    "affine8": ("affine", 8, 64),
    "mxfp4": ("mxfp4", 4, 32),
    "mxfp8": ("mxfp8", 8, 32),
    "nvfp4": ("nvfp4", 4, 16),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 16384)


def timed(fns: dict, repeat: int) -> dict:
    """Min time (ms) of each function, interleaved (a, b, c, a, b, c, ...) so that load from
    other processes hits all of them alike."""
    best = {}
    for name, fn in fns.items():
        mx.eval(fn())  # warm-up (and lazy inputs)
        best[name] = float("inf")
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn())
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: t * 1e3 for name, t in best.items()}


def crossover(rows: list[dict]) -> int | None:
    """Smallest T from which deq+mm wins at every larger measured T (skipped qmm counts as a
    deq+mm win: it was skipped for being far slower). None: qmm wins at the largest T."""
    found = None
    for r in sorted(rows, key=lambda r: -r["tokens"]):
        if r["qmm_ms"] is None or r["deq_mm_ms"] < r["qmm_ms"]:
            found = r["tokens"]
        else:
            break
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    parser.add_argument("--shapes", nargs="+", default=["300M", "6B"], choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="Compute dtype (default: float32 on cpu, bfloat16 on gpu, as the runtime).",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--doc", action="store_true", help="Write the tables into docs/quantization.md.")
    parser.add_argument("--from-json", type=Path, help="Skip timing; use the results of an earlier --json run.")
    parser.add_argument(
        "--give-up",
        type=float,
        default=4.0,
        help="Stop timing qmm once it is this many times slower than deq+mm twice in a row.",
    )
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        results = run(args)
    if args.doc:
        write_doc(results)


def run(args) -> dict:
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    from esmc_mlx.runtime.quantized import backend

    dtype = getattr(mx, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    results = {
        "backend": backend(),
        "dtype": str(dtype),
        "mlx": mx.__version__,
        "machine": platform.machine(),
        "host": platform.node(),
        "repeat": args.repeat,
        "rows": [],
        "crossover": {},
    }
    try:
        results["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # not every backend/version describes itself
        pass
    print(f"backend {backend()}, compute dtype {dtype}, mlx {mx.__version__}; times in ms (min of {args.repeat})")
    for shape_name in args.shapes:
        out_dims, in_dims = SHAPES[shape_name]
        w = (mx.random.normal((out_dims, in_dims)) * in_dims**-0.5).astype(dtype)
        xs = {t: mx.random.normal((t, in_dims)).astype(dtype) for t in args.tokens}
        mx.eval(w, *xs.values())
        for mode_name in args.modes:
            mode, bits, group = MODES[mode_name]
            packed, scales, *rest = mx.quantize(w, group_size=group, bits=bits, mode=mode)
            biases = rest[0] if rest else None
            mx.eval(packed, scales, *([biases] if biases is not None else []))
            kw = dict(group_size=group, bits=bits, mode=mode)

            def deq():
                return mx.dequantize(packed, scales, biases, dtype=dtype, **kw)

            deq_only = timed({"deq": deq}, args.repeat)["deq"]
            rows, far_slower = [], 0
            print(f"\n{shape_name} {out_dims}x{in_dims} {mode_name} (dequantize alone: {deq_only:.1f} ms)")
            print(f"{'tokens':>7} {'qmm':>10} {'deq+mm':>10} {'float':>10}  faster")
            for t in args.tokens:
                x = xs[t]
                fns = {"float": lambda: x @ w.T, "deq_mm": lambda: x @ deq().T}
                if far_slower < 2:
                    fns["qmm"] = lambda: mx.quantized_matmul(x, packed, scales, biases, transpose=True, **kw)
                ms = timed(fns, args.repeat)
                deq_mm, qmm = ms["deq_mm"], ms.get("qmm")
                far_slower = far_slower + 1 if qmm is None or qmm > args.give_up * deq_mm else 0
                row = {
                    "shape": shape_name,
                    "out": out_dims,
                    "in": in_dims,
                    "mode": mode_name,
                    "tokens": t,
                    "qmm_ms": qmm,
                    "deq_mm_ms": deq_mm,
                    "float_ms": ms["float"],
                    "dequantize_ms": deq_only,
                }
                rows.append(row)
                winner = "deq+mm" if qmm is None or deq_mm < qmm else "qmm"
                qtext = f"{qmm:10.2f}" if qmm is not None else f"{'-':>10}"
                print(f"{t:>7} {qtext} {deq_mm:10.2f} {ms['float']:10.2f}  {winner}", flush=True)
            results["rows"] += rows
            results["crossover"].setdefault(mode_name, {})[shape_name] = crossover(rows)
    print("\ncrossover (tokens from which deq+mm is faster; None = never):")
    for mode_name, by_shape in results["crossover"].items():
        print(f"  {mode_name:8} " + "  ".join(f"{s}: {t}" for s, t in by_shape.items()))
    if args.json:
        save_json(args.json, results, device=args.device)
        print(f"wrote {args.json}")
    return results


def markdown(results: dict) -> str:
    """Crossover summary, then per shape: tokens x modes, each cell "qmm / deq+mm" in ms with
    the faster one in bold and, in brackets, how much slower than the float matmul it is."""
    modes = list(results["crossover"])
    shapes = list(dict.fromkeys(r["shape"] for r in results["rows"]))
    from esmc_mlx.runtime import dispatch

    tuning = dispatch.tuning_for(dispatch.Device(results["backend"], results["machine"]))
    table = dispatch._table(tuning, None, tuning.crossover) if tuning else {}
    lines = [
        f"Crossover (tokens from which dequantize-then-matmul is faster), {results['backend']}, "
        f"{results['dtype'].split('.')[-1]}, mlx {results['mlx']}:",
        "",
        "| mode | " + " | ".join(shapes) + " | runtime/dispatch.py |",
        "|---|" + "---:|" * (len(shapes) + 1),
    ]
    for m in modes:
        key = MODES[m][0]
        lines.append(
            f"| {m} | "
            + " | ".join(str(results["crossover"][m].get(s)) for s in shapes)
            + f" | {table.get(m, table.get(key))} |"
        )
    for shape in shapes:
        rows = [r for r in results["rows"] if r["shape"] == shape]
        out_dims, in_dims = rows[0]["out"], rows[0]["in"]
        lines += [
            "",
            f"{shape} projection {in_dims} -> {out_dims}: qmm / deq+mm, ms (faster one x float's time)",
            "",
            "| tokens | float | " + " | ".join(modes) + " |",
            "|---:|---:|" + "---:|" * len(modes),
        ]
        for t in sorted({r["tokens"] for r in rows}):
            by_mode = {r["mode"]: r for r in rows if r["tokens"] == t}
            cells = []
            for m in modes:
                r = by_mode.get(m)
                if r is None:
                    cells.append("")
                    continue
                q, d, f = r["qmm_ms"], r["deq_mm_ms"], r["float_ms"]
                best = d if q is None or d < q else q
                qt = "-" if q is None else (f"**{_ms(q)}**" if best == q else _ms(q))
                dt = f"**{_ms(d)}**" if best == d else _ms(d)
                cells.append(f"{qt} / {dt} ({best / f:.1f}x)")
            lines.append(f"| {t} | {_ms(by_mode[modes[0]]['float_ms'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def write_doc(results: dict) -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "quantization.md"
    begin, end = f"<!-- quant_matmul_{results['backend']}:begin -->", f"<!-- quant_matmul_{results['backend']}:end -->"
    text = doc.read_text()
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    doc.write_text(f"{head}{begin}\n{markdown(results)}\n{end}{rest.split(end, 1)[1]}")
    print(f"updated {doc}")


if __name__ == "__main__":
    main()
