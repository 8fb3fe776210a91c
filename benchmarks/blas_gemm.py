"""fp32 GEMM rate of every BLAS option on this CPU, each in its own process (docs/benchmarks.md).

MLX with: the bundled reference BLAS, the scipy-openblas32 wheel, the system OpenBLAS, each with
OpenBLAS's own kernel and with kernels forced; numpy's and torch's own BLAS; and torch's rate
in a clean process against one that imported esmc_mlx first (it must stay within 30%).

    python -m benchmarks.blas_gemm [--n 1024] [--json OUT.json]

Exits 1 if torch after ``import esmc_mlx`` is more than 30% slower than in a clean process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import save_json

SYSTEM = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"

MLX = """
import json, sys, esmc_mlx
from esmc_mlx import _blas
rates = [_blas.gemm_gflops({n}, 1.0) for _ in range(3)]
print(json.dumps({{"gflops": max(rates), "info": _blas.info, "serves_mlx": _blas.mlx_blas_library()}}))
"""
NUMPY = """
import json, time, numpy as np
a = np.random.rand({n}, {n}).astype(np.float32); b = a.copy(); a @ b
best = float("inf")
for _ in range(10):
    s = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - s)
print(json.dumps({{"gflops": 2 * {n}**3 / best / 1e9}}))
"""
TORCH = """
import json, time
{pre}
import torch
a = torch.rand({n}, {n}); b = torch.rand({n}, {n}); a @ b
best = float("inf")
for _ in range(10):
    s = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - s)
print(json.dumps({{"gflops": 2 * {n}**3 / best / 1e9, "threads": torch.get_num_threads()}}))
"""


def measure(code: str, env: dict | None = None) -> dict:
    full = {**os.environ, **(env or {})}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    n = args.n
    options = {
        "MLX, bundled reference BLAS": {"ESMC_MLX_BLAS": "none"},
        "MLX, scipy-openblas32 (OpenBLAS's kernel choice)": {},
        "MLX, scipy-openblas32, forced Prescott": {"ESMC_MLX_BLAS_CORETYPE": "Prescott"},
    }
    if os.path.exists(SYSTEM):
        options["MLX, system OpenBLAS (its kernel choice)"] = {"ESMC_MLX_BLAS": SYSTEM}
        options["MLX, system OpenBLAS, forced Prescott"] = {
            "ESMC_MLX_BLAS": SYSTEM,
            "ESMC_MLX_BLAS_CORETYPE": "Prescott",
        }
    rows = {}
    for name, env in options.items():
        rows[name] = measure(MLX.format(n=n), env)
    rows["numpy (its bundled OpenBLAS)"] = measure(NUMPY.format(n=n))
    rows["torch, clean process"] = measure(TORCH.format(n=n, pre=""))
    rows["torch, after import esmc_mlx"] = measure(TORCH.format(n=n, pre="import esmc_mlx"))
    for name, r in rows.items():
        extra = ""
        if "info" in r:
            extra = f"  [{r['info'].get('corename') or 'reference'}]  serves MLX: {r.get('serves_mlx')}"
        print(
            f"{name:<52} {r.get('gflops', float('nan')):7.1f} GFLOP/s{extra}"
            if "gflops" in r
            else f"{name:<52} failed: {r['error']}"
        )
    clean, after = rows["torch, clean process"].get("gflops"), rows["torch, after import esmc_mlx"].get("gflops")
    ratio = after / clean if clean and after else float("nan")
    print(f"torch GEMM after import esmc_mlx / clean: {ratio:.2f} (must be >= 0.70)")
    save_json(args.json, {"n": n, "cpu": _cpu(), "rows": rows, "torch_ratio": ratio}, device="cpu")
    return 0 if ratio >= 0.7 else 1


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
