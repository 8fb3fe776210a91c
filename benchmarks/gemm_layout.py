"""bf16 GEMM rate of the ESMC linears: MLX's weight layouts and settings against torch (issue 16).

For the 6B's four per-layer GEMMs (out x in: fused qkv 7680x2560, o 2560x2560, fused gate/up
13824x2560, down 2560x6912) and the 300M's (2880x960, 960x960, 5120x960, 960x2560) at 256, 1024,
4096 and 32768 tokens, bf16, each in its own process (MLX reads its env vars once, at import):

- MLX ``x @ W.T`` (W (out, in) row-major: cublasLt op T on the weight, what nn.Linear does);
  ``x @ Wt`` with Wt a contiguous (in, out) copy (op N); ``mx.addmm(c, x, W.T)`` with c the
  (M, out) residual (cublasLt's C input, beta 1), under the default settings and under
  MLX_USE_CUDA_GRAPHS=0 (the only MLX env var that touches a bf16 GEMM; docs in the report).
- torch ``y @ W.T`` and ``y @ Wt``, with its default BLAS (cuBLAS) and with cublasLt preferred.

Each figure is the median of --reps samples after warmup; a sample is a burst of calls (MLX: one
mx.eval of the burst, as a model's forward is one eval; torch: async launches) then a synchronize,
divided by the count, so launch overhead overlaps the GPU work as in a model (at 256 tokens a GEMM
is ~10 us: those rows still weigh dispatch as much as the kernel). The loaded libcublas files
are recorded: MLX and torch may ship different cuBLAS builds, whose heuristics differ.
--algos adds one pass per library with CUBLASLT_LOG_LEVEL=2 and keeps the logged cublasLtMatmul
lines (tile, stages: which kernel each picked; torch's default path may log nothing).

    python -m benchmarks.gemm_layout --json $OUT/gemm.json --algos   # H200, about a minute
    python -m benchmarks.gemm_layout --small                         # CPU smoke run, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import save_json

SHAPES = {
    "6B": {"qkv": (7680, 2560), "o": (2560, 2560), "gate_up": (13824, 2560), "down": (2560, 6912)},
    "300M": {"qkv": (2880, 960), "o": (960, 960), "gate_up": (5120, 960), "down": (960, 2560)},
}
TOKENS = [256, 1024, 4096, 32768]
SMALL_SHAPES = {"tiny": {"qkv": (96, 32), "o": (32, 32), "gate_up": (128, 32), "down": (32, 64)}}
SMALL_TOKENS = [16, 64]

MLX_SETTINGS = {"default": {}, "no_graphs": {"MLX_USE_CUDA_GRAPHS": "0"}}
TORCH_SETTINGS = {"torch": "default", "torch_lt": "cublaslt"}
MLX_VARIANTS = ("wt", "pre", "addmm")
TORCH_VARIANTS = ("wt", "pre")
BURST_S = 2e-3  # a sample lasts at least this long, so launch overhead is a small share


def loaded_blas() -> list[str]:
    """The cuBLAS shared objects this process mapped (which build serves the GEMMs)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "libcublas" in line})
    except OSError:
        return []


def time_bursts(launch, sync, reps: int) -> float:
    """Median seconds per call: warm up, size a burst to BURST_S, then time reps bursts."""
    for _ in range(3):
        launch()
    sync()
    start = time.perf_counter()
    launch()
    sync()
    inner = max(1, min(20, int(BURST_S / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            launch()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def child_mlx(spec: dict) -> dict:
    import mlx.core as mx  # imported here: the parent sets the env vars first

    out = {"mlx": mx.__version__, "device": str(mx.default_device()), "times": {}}
    held = []

    def launch(fn):
        return lambda: held.append(fn())  # lazy: a burst runs as one eval, as a model's forward does

    def sync():
        mx.eval(held)
        mx.synchronize()
        held.clear()

    for model, shapes in spec["shapes"].items():
        for name, (n_out, n_in) in shapes.items():
            w = (mx.random.normal((n_out, n_in)) * n_in**-0.5).astype(mx.bfloat16)
            wt = mx.contiguous(w.T)
            mx.eval(w, wt)
            for m in spec["tokens"]:
                x = mx.random.normal((m, n_in)).astype(mx.bfloat16)
                c = mx.random.normal((m, n_out)).astype(mx.bfloat16)
                mx.eval(x, c)
                fns = {"wt": lambda: x @ w.T, "pre": lambda: x @ wt, "addmm": lambda: mx.addmm(c, x, w.T)}
                for variant in spec["variants"]:
                    t = time_bursts(launch(fns[variant]), sync, spec["reps"])
                    out["times"][f"{model}/{name}/{m}/{variant}"] = t
    out["blas"] = loaded_blas()
    return out


def child_torch(spec: dict) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if cuda and spec["blas"] != "default":
        torch.backends.cuda.preferred_blas_library(spec["blas"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": dev, "times": {}}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
        out["blas_library"] = str(torch.backends.cuda.preferred_blas_library())
    with torch.inference_mode():
        for model, shapes in spec["shapes"].items():
            for name, (n_out, n_in) in shapes.items():
                w = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) * n_in**-0.5
                wt = w.T.contiguous()
                for m in spec["tokens"]:
                    x = torch.randn(m, n_in, device=dev, dtype=torch.bfloat16)
                    fns = {"wt": lambda: x @ w.T, "pre": lambda: x @ wt}
                    for variant in spec["variants"]:
                        out["times"][f"{model}/{name}/{m}/{variant}"] = time_bursts(fns[variant], sync, spec["reps"])
    out["blas"] = loaded_blas()
    return out


def run_child(spec: dict, env: dict) -> dict:
    full = {**os.environ, **env}
    code = [sys.executable, "-m", "benchmarks.gemm_layout", "--child", json.dumps(spec)]
    proc = subprocess.run(code, env=full, capture_output=True, text=True)
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-3:] if proc.stderr.strip() else [f"exit {proc.returncode}"]
        return {"error": " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def algo_log(spec: dict, env: dict) -> list[str]:
    """cublasLt's own trace of the matmuls one pass runs (one rep, the largest token count)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lt.log")
        one = {**spec, "reps": 1, "tokens": spec["tokens"][-1:], "variants": spec["variants"][:2]}
        result = run_child(one, {**env, "CUBLASLT_LOG_LEVEL": "2", "CUBLASLT_LOG_FILE": path})
        if "error" in result:
            return [result["error"]]
        if not os.path.exists(path):
            return []
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if "Matmul" in line]
    seen, kept = set(), []
    for line in lines:  # one line per distinct call: the bursts repeat each one many times
        key = re.sub(r"0x[0-9a-f]+", "", line.split("]", 3)[-1])  # pointers differ call to call
        if key not in seen:
            seen.add(key)
            kept.append(line[:600])
    return kept[:200]


def tflops(seconds: float, m: int, n_out: int, n_in: int) -> float:
    return 2 * m * n_out * n_in / seconds / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--small", action="store_true", help="tiny shapes and token counts (CPU smoke run)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--algos", action="store_true", help="also log which cublasLt kernel each library picks")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_mlx(spec) if spec["lib"] == "mlx" else child_torch(spec)))
        return 0

    shapes = SMALL_SHAPES if args.small else SHAPES
    tokens = SMALL_TOKENS if args.small else TOKENS
    reps = min(args.reps, 5) if args.small else args.reps
    base = {"shapes": shapes, "tokens": tokens, "reps": reps}
    runs = {}
    for label, env in MLX_SETTINGS.items():
        runs[f"mlx_{label}"] = run_child({**base, "lib": "mlx", "variants": MLX_VARIANTS}, env)
    for label, blas in TORCH_SETTINGS.items():
        runs[label] = run_child({**base, "lib": "torch", "blas": blas, "variants": TORCH_VARIANTS}, {})
    for name, r in runs.items():
        if "error" in r:
            print(f"{name}: Error: {r['error']}")

    ref = runs["torch"].get("times", {})
    rows = []
    header = f"{'model':5} {'gemm':8} {'tokens':>6} {'run':16} {'var':6} {'ms':>8} {'TFLOP/s':>8} {'vs torch':>8}"
    print(header)
    for model, named in shapes.items():
        for name, (n_out, n_in) in named.items():
            for m in tokens:
                torch_t = ref.get(f"{model}/{name}/{m}/wt")
                for run, r in runs.items():
                    for key, t in sorted(r.get("times", {}).items()):
                        mo, na, mm, variant = key.split("/")
                        if (mo, na, int(mm)) != (model, name, m):
                            continue
                        ratio = torch_t / t if torch_t else None  # > 1: faster than torch y @ W.T
                        rows.append(
                            {
                                "model": model,
                                "gemm": name,
                                "out_in": [n_out, n_in],
                                "tokens": m,
                                "run": run,
                                "variant": variant,
                                "seconds": t,
                                "tflops": tflops(t, m, n_out, n_in),
                                "speed_vs_torch": ratio,
                            }
                        )
                        print(
                            f"{model:5} {name:8} {m:>6} {run:16} {variant:6} {t * 1e3:8.3f} "
                            f"{tflops(t, m, n_out, n_in):8.1f} {'' if ratio is None else f'{ratio:8.2f}'}"
                        )
    # The four GEMMs of one layer together, per run and variant: the figure issue 16 needs.
    totals = {}
    for row in rows:
        key = f"{row['model']}/{row['tokens']}/{row['run']}/{row['variant']}"
        totals[key] = totals.get(key, 0.0) + row["seconds"]
    print("\nper layer, four GEMMs (ms; ratio = torch y @ W.T total / this)")
    for key, t in totals.items():
        model, m, run, variant = key.split("/")
        torch_total = totals.get(f"{model}/{m}/torch/wt")
        ratio = f"{torch_total / t:.2f}" if torch_total else ""
        print(f"{model:5} {m:>6} {run:16} {variant:6} {t * 1e3:8.3f} {ratio:>6}")

    result = {
        "runs": {k: {f: v for f, v in r.items() if f != "times"} for k, r in runs.items()},
        "rows": rows,
        "layer_totals_s": totals,
    }
    if args.algos:
        result["cublaslt_log"] = {
            "mlx": algo_log({**base, "lib": "mlx", "variants": MLX_VARIANTS}, {}),
            "torch_lt": algo_log({**base, "lib": "torch", "blas": "cublaslt", "variants": TORCH_VARIANTS}, {}),
            "torch": algo_log({**base, "lib": "torch", "blas": "default", "variants": TORCH_VARIANTS}, {}),
        }
        for lib, lines in result["cublaslt_log"].items():
            print(f"\ncublasLt log, {lib}: {len(lines)} distinct lines" + (f"; first: {lines[0]}" if lines else ""))
    for name, r in result["runs"].items():
        print(f"{name}: {json.dumps(r)}")
    save_json(args.json, result)
    return 1 if any("error" in r for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
