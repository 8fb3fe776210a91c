"""A wt-marginal scan of a protein longer than the scoring window, against the same scan in one
window (``--window 0``): what the shared windows of ``tasks.scoring.unmasked_window`` cost.

    python -m benchmarks.scan_windows                          # esmc-tiny, 3,000 residues, CPU
    python -m benchmarks.scan_windows --length 6000 --json scan_windows.json

Both scans run in their own process (``python -m esmc_mlx.cli scan ... --no-plot``), one after
the other, ``--repeats`` times each, alternating; the time is the one the command prints for the
scoring (the model's loading and the files' writing excluded), and the wall time of the whole
process is printed beside it. The model is the packaged esmc-tiny converted to float32 MLX here
first (``esmc-convert tiny --no-validate``; no Hub); the protein is random (``--seed``) over the
20 amino acids. Prints the windowed / whole ratio of the median times and how far the windowed
scores are from the whole-sequence ones (the context a window leaves out changes them).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from esmc_mlx.tasks.mutations import AMINO_ACIDS_20


def run(args: list[str]) -> tuple[float, float, int, str]:
    """Run ``python -m esmc_mlx.cli ARGS``: (scoring seconds it printed, wall seconds, passes, output)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "esmc_mlx.cli", *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"esmc-mlx {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    found = re.search(r"\((\d+) forward pass(?:es)?, ([\d.]+) s\)", proc.stdout)
    if not found:
        raise RuntimeError(f"no timing in the output of esmc-mlx {' '.join(args)}:\n{proc.stdout}")
    return float(found.group(2)), wall, int(found.group(1)), proc.stdout


def scores(folder: Path) -> np.ndarray:
    with open(folder / "bench_matrix.csv", newline="") as f:
        rows = list(csv.reader(f))[1:]
    return np.array([[float(x) for x in r[2:22]] for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=3000, help="residues of the protein (default 3000)")
    parser.add_argument("--window", type=int, default=None, help="the windowed side's --window (default: scan's)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="scan-windows-") as tmp:
        work = Path(tmp)
        model = work / "esmc-tiny"
        subprocess.run(
            [sys.executable, "-m", "esmc_mlx.cli", "convert", "tiny", "-o", str(model), "--no-validate"],
            check=True,
            capture_output=True,
        )
        rng = np.random.default_rng(options.seed)
        protein = "".join(rng.choice(list(AMINO_ACIDS_20), options.length))
        fasta = work / "bench.fasta"
        fasta.write_text(f">bench\n{protein}\n")
        windowed_args = [] if options.window is None else ["--window", str(options.window)]
        sides = {"windowed": windowed_args, "whole": ["--window", "0"]}
        results = {name: [] for name in sides}
        for repeat in range(options.repeats):
            for name, extra in sides.items():
                out = work / f"{name}-{repeat}"
                base = ["scan", str(model), "--sequence", str(fasta), "-o", str(out), "--method", "wt-marginal"]
                seconds, wall, passes, _ = run([*base, *extra, "--no-plot", "--no-progress"])
                results[name].append({"scan_s": seconds, "wall_s": round(wall, 2), "passes": passes, "out": out})
                print(f"  {name:8s} {seconds:7.2f} s scan {wall:7.2f} s wall {passes:4d} pass(es)", flush=True)
        median = {name: statistics.median(r["scan_s"] for r in runs) for name, runs in results.items()}
        ratio = median["windowed"] / median["whole"]
        diff = np.abs(scores(results["windowed"][0]["out"]) - scores(results["whole"][0]["out"]))
    print(
        f"wt-marginal scan of {options.length} residues, esmc-tiny, {platform.machine()} CPU: "
        f"windowed {median['windowed']:.2f} s ({results['windowed'][0]['passes']} pass(es)), "
        f"--window 0 {median['whole']:.2f} s ({results['whole'][0]['passes']} pass): ratio {ratio:.2f}"
    )
    print(f"|windowed - whole| over the {diff.size:,} scores: median {np.median(diff):.3f}, max {diff.max():.3f}")
    if options.json:
        record = {
            "length": options.length,
            "window": options.window,
            "machine": platform.machine(),
            "median_scan_s": median,
            "ratio_windowed_over_whole": round(ratio, 3),
            "abs_diff_median": float(np.median(diff)),
            "abs_diff_max": float(diff.max()),
            "runs": {n: [{k: v for k, v in r.items() if k != "out"} for r in runs] for n, runs in results.items()},
        }
        options.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
