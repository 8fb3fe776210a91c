"""Every GPU measurement of docs/benchmarks.md in one call (device time is scarce).

On the H200, for the 300M- and 6B-shaped models (random weights, transformers' model built
in bf16 on CUDA and the MLX model made from its state dict):
  * bf16 GEMM rate (8192^3) in MLX and torch: the ceiling for "% of matmul rate";
  * forward time, transformers eager (sdpa) vs the MLX variants (plain, +fuse, +compile,
    +fuse+compile) at B x L = 1x256, 1x1024, 16x256, 64x512, interleaved;
  * GEMM profile: each block GEMM at each token count, MLX vs torch (what a forward cannot
    go below);
  * quantized twins (affine8, affine4, mxfp4): forced quantized_matmul and forced
    dequantize-then-matmul against the bf16 twin;
  * attention memory at L=4096: one SDPA call (no mask, bool, additive) and whole forwards
    with and without padding, MLX and torch;
  * the quantized-matmul crossover sweep (benchmarks/quant_matmul.py --device gpu).
Results go to OUT/gpu_suite.json after every section (a call killed at its time limit
keeps what was done).

    python -m benchmarks.gpu_suite --out $OUT            # on the GPU machine
    python -m benchmarks.gpu_suite --smoke --out /tmp/s  # tiny shapes, any machine
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks import measure
from esmc_mlx import bench

START = time.time()
SECTIONS = ("matmul", "forward", "memory", "gemm", "quant", "attention", "quant_matmul")


def log(*a):
    print(f"[{time.time() - START:6.1f}s]", *a, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny models and shapes (checks the script, not speed)")
    p.add_argument("--budget", type=float, default=540, help="seconds; later sections are skipped past it")
    p.add_argument("--models", nargs="+")
    p.add_argument("--no-quant-matmul", action="store_true")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--quant-modes", nargs="+", default=list(bench.QUANT_MODES), choices=list(bench.QUANT_MODES))
    p.add_argument("--quant-matmul-args", default="", help="extra arguments for quant_matmul.py, one string")
    args = p.parse_args()
    want = set(args.sections)

    gpu = mx.default_device() == mx.gpu
    import torch

    torch_device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
    if torch_device == "cpu":
        torch.set_num_threads(2)
    models = args.models or (["tiny", "small"] if args.smoke else ["300M", "6B"])
    shapes = [(1, 16), (2, 32)] if args.smoke else list(bench.GPU_SHAPES)
    profile_tokens = [32, 64] if args.smoke else [256, 1024, 4096, 32768]
    att_len = 128 if args.smoke else 4096
    dtype = "bfloat16"
    mem_device = "cuda" if torch_device == "cuda" else None
    results = {
        "machine": bench.machine(),
        "backend": "gpu" if gpu else "cpu",
        "dtype": dtype,
        "target_speedup": 1.2,
        "forward": [],
        "agreement": {},
        "gemm_profile": {},
        "quantized": [],
        "attention": [],
        "forward_memory": [],
        "skipped": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save():
        results["elapsed_s"] = time.time() - START
        (args.out / "gpu_suite.json").write_text(json.dumps(results, indent=2, default=str) + "\n")

    def time_left(need: float, what: str) -> bool:
        if time.time() - START + need > args.budget:
            log(f"skipping {what}: budget")
            results["skipped"].append(what)
            return False
        return True

    log("machine", json.dumps(results["machine"]))
    if "matmul" in want:
        results["matmul"] = measure.matmul_rates(256 if args.smoke else 8192, dtype, torch_device if gpu else None)
        log("matmul", results["matmul"])
        save()

    for name in models:
        config = bench.config_for(name)
        big = config.hidden_size >= 2048
        if not time_left(120 if big else 30, f"{name} forward"):
            continue
        log(f"building {name}")
        tmodel = bench.torch_model(config, dtype, torch_device)
        weights = bench.mlx_weights(tmodel, mx.bfloat16)
        variants = {v: bench.mlx_model(config, weights, *bench.VARIANTS[v]) for v in bench.VARIANTS}
        log(f"built {name}; active MLX memory {mx.get_active_memory() / 2**30:.1f} GiB")
        if "forward" in want:
            for v, m in variants.items():
                results["agreement"][f"{name} {v}"] = bench.agreement(tmodel, m, torch_device)
            log("agreement (rel L2 of logits vs torch, bf16)", results["agreement"])
            results["forward"] += bench.compare_forward(
                tmodel, variants, config, shapes, torch_device, name, budget_s=2.0, log=log
            )
            save()

        best = variants[bench.DEFAULT_VARIANT]
        # attention memory: whole forwards at L=4096 (no padding / 16 padded keys)
        if "memory" in want and time_left(40 if big else 10, f"{name} forward memory"):
            for variant in (bench.DEFAULT_VARIANT, "mlx"):
                for padded in (0, 16):
                    try:
                        r = measure.forward_memory(
                            variants[variant],
                            tmodel if variant == bench.DEFAULT_VARIANT else None,
                            att_len,
                            1,
                            padded,
                            mem_device,
                        )
                    except Exception as e:  # out of memory or a missing kernel is a finding, not a crash
                        r = {"length": att_len, "padded": padded, "error": repr(e)}
                    r["model"], r["variant"] = name, variant
                    results["forward_memory"].append(r)
                    log("forward memory", r)
            save()

        # the unfused variants are not needed past here
        for v in [v for v in variants if v != bench.DEFAULT_VARIANT]:
            del variants[v]
        gc.collect()
        mx.clear_cache()

        if "gemm" in want and time_left(20, f"{name} gemm profile"):
            results["gemm_profile"][name] = [
                measure.gemm_profile(config, t, torch_device if gpu else None, dtype) for t in profile_tokens
            ]
            for prof in results["gemm_profile"][name]:
                log(f"gemm profile {name} tokens={prof['tokens']}: ", json.dumps(prof["forward_gemm_ms"]))
            save()

        del tmodel
        torch.cuda.empty_cache() if torch_device == "cuda" else None
        gc.collect()

        for mode, record in bench.QUANT_MODES.items():
            if "quant" not in want or mode not in args.quant_modes:
                continue
            if not time_left(90 if big else 20, f"{name} {mode}"):
                continue
            q = bench.mlx_model(config, weights, True, True, record)
            models_ = {"bf16": best, f"{mode}/qmm": q, f"{mode}/deq": q}
            env = {
                f"{mode}/qmm": {"ESMC_MLX_QUANT_MATMUL": "quantized"},
                f"{mode}/deq": {"ESMC_MLX_QUANT_MATMUL": "dequantize"},
            }
            for b, l in shapes:
                chosen = dict(models_)
                if b * l > 4096 and not args.smoke:  # qmm at 32k tokens: minutes on a 6B (DESIGN.md)
                    chosen.pop(f"{mode}/qmm")
                rows = bench.compare_forward(
                    None, chosen, config, [(b, l)], "cpu", name, budget_s=1.5, log=log, env=env
                )
                bf = next(r["median_ms"] for r in rows if r["impl"] == "bf16")
                for r in rows:
                    if r["impl"] != "bf16":
                        r["vs_bf16"] = r["median_ms"] / bf
                        r["mode"] = mode
                        r["policy"] = r["impl"].split("/")[1]
                        results["quantized"].append(r)
                        log(f"  {r['impl']} / bf16 = {r['vs_bf16']:.2f}")
            del q, models_
            gc.collect()
            mx.clear_cache()
            save()
        del best, variants, weights
        gc.collect()
        mx.clear_cache()

    # one attention call at L=4096: fused kernels vs the (B, H, L, L) scores
    for heads in (2,) if args.smoke else (15, 40):
        if "attention" in want and time_left(15, f"attention H={heads}"):
            try:
                r = measure.attention_memory(heads, att_len, 1, dtype, mem_device)
            except Exception as e:
                r = {"heads": heads, "length": att_len, "error": repr(e)}
            results["attention"].append(r)
            log("attention", json.dumps(r))
            save()

    script = Path(__file__).resolve().parent / "quant_matmul.py"
    if script.exists() and not args.no_quant_matmul and "quant_matmul" in want:
        remaining = args.budget - (time.time() - START)
        if remaining > 30:
            cmd = [
                sys.executable,
                str(script),
                "--device",
                "gpu" if gpu else "cpu",
                "--json",
                str(args.out / "quant_matmul.json"),
            ]
            if args.smoke:
                cmd += ["--shapes", "300M", "--modes", "affine4", "--tokens", "1", "16", "--repeat", "1"]
            cmd += args.quant_matmul_args.split()
            log("running", " ".join(cmd), f"(timeout {remaining:.0f}s)")
            try:
                subprocess.run(cmd, timeout=remaining, check=False)
            except subprocess.TimeoutExpired:
                log("quant_matmul.py timed out")
                results["skipped"].append("quant_matmul (timeout)")
        else:
            results["skipped"].append("quant_matmul (budget)")
    save()
    png = bench.plot(results, args.out / "gpu_forward.png", "ESMC forward on the GPU, bf16: torch time / MLX time")
    log("done", png)


if __name__ == "__main__":
    main()
