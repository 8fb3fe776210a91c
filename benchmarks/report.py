"""Markdown tables and plots for docs/benchmarks.md from the JSON the benchmark scripts write.

    python benchmarks/report.py docs/bench/gpu_suite.json [docs/bench/gpu_suite_2.json ...] \
        [--cpu docs/bench/cpu_forward.json] [--plots docs/bench]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def forward_table(rows: list[dict], peak: float | None) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    head = (
        "| model | B×L | "
        + " | ".join(f"{i} ms" for i in impls)
        + " | best MLX vs torch | best TFLOP/s"
        + (" | % of matmul rate |" if peak else " |")
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key in dict.fromkeys((r["model"], r["batch"], r["length"]) for r in rows):
        group = {r["impl"]: r for r in rows if (r["model"], r["batch"], r["length"]) == key}
        mlx = [r for i, r in group.items() if i != "torch"]
        best = min(mlx, key=lambda r: r["median_ms"])
        cells = [f"{group[i]['median_ms']:.2f}" if i in group else "" for i in impls]
        speed = f"{best['speedup_vs_torch']:.2f}× ({best['impl']})" if best.get("speedup_vs_torch") else ""
        line = f"| {key[0]} | {key[1]}×{key[2]} | " + " | ".join(cells) + f" | {speed} | {best['tflops']:.0f}"
        line += f" | {100 * best['tflops'] / peak:.0f}% |" if peak else " |"
        lines.append(line)
    return "\n".join(lines)


def quant_table(rows: list[dict]) -> str:
    lines = ["| model | B×L | mode | quantized_matmul / bf16 | dequantize+matmul / bf16 |", "|---|---|---|---|---|"]
    keys = dict.fromkeys((r["model"], r["batch"], r["length"], r["mode"]) for r in rows)
    for k in keys:
        got = {r["policy"]: r["vs_bf16"] for r in rows if (r["model"], r["batch"], r["length"], r["mode"]) == k}
        q = f"{got['qmm']:.2f}" if "qmm" in got else "not run (minutes)"
        lines.append(f"| {k[0]} | {k[1]}×{k[2]} | {k[3]} | {q} | {got.get('deq', float('nan')):.2f} |")
    return "\n".join(lines)


def quant_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, model in zip(axes, ("300M", "6B")):
        sub = [r for r in rows if r["model"] == model]
        shapes = list(dict.fromkeys(f"{r['batch']}x{r['length']}" for r in sub))
        series = list(dict.fromkeys(f"{r['mode']}/{r['policy']}" for r in sub))
        width = 0.8 / max(len(series), 1)
        for i, s in enumerate(series):
            vals = {f"{r['batch']}x{r['length']}": r["vs_bf16"] for r in sub if f"{r['mode']}/{r['policy']}" == s}
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(shapes))]
            ax.bar(xs, [vals.get(sh, 0) for sh in shapes], width, label=s)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.15, color="red", linestyle="--", linewidth=0.8, label="1.15× limit")
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_title(f"{model}: quantized forward time / bf16 forward time")
        ax.set_yscale("log")
        ax.set_yticks([1, 1.15, 1.5, 2, 3, 4, 6], ["1", "1.15", "1.5", "2", "3", "4", "6"])
        ax.minorticks_off()
    axes[0].set_ylabel("time ratio (lower is better)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("gpu", nargs="*", type=Path)
    p.add_argument("--cpu", type=Path)
    p.add_argument("--plots", type=Path)
    args = p.parse_args()
    forward, quant, memory, attention, peak = [], [], [], [], None
    for f in args.gpu:
        r = json.loads(f.read_text())
        forward += r.get("forward", [])
        quant += r.get("quantized", [])
        memory += r.get("forward_memory", [])
        attention += r.get("attention", [])
        peak = peak or (r.get("matmul") or {}).get("peak_tflops")
    if forward:
        print("GPU forward (median ms)\n")
        print(forward_table(forward, peak), "\n")
    if quant:
        print("Quantized vs bf16\n")
        print(quant_table(quant), "\n")
    if args.cpu:
        r = json.loads(args.cpu.read_text())
        print("CPU forward (median ms)\n")
        print(forward_table(r["forward"], None), "\n")
    if args.plots and quant:
        quant_plot(quant, args.plots / "gpu_quantized.png")
    for m in memory:
        print("memory", json.dumps(m))
    for a in attention:
        print("attention", json.dumps(a))


if __name__ == "__main__":
    main()
