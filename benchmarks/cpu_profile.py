"""Where a 300M forward spends its time on this CPU, MLX vs torch (the evidence in docs/benchmarks.md).

  python -m benchmarks.cpu_profile [--json docs/bench/cpu_profile.json]

1. forward at 1x256: torch with 1 and with 2 threads, interleaved with the MLX runtime;
2. the GEMM floor: the block GEMMs at 256 tokens x 30 layers, MLX (OpenBLAS) vs torch;
3. one MLX block at 1x256 and its pieces: attention, layer norm, RoPE, silu(gate)*up, ...
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from benchmarks import measure
from esmc_mlx import bench
from esmc_mlx.runtime.model import Layer


def median_ms(fn, n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import torch

    cfg = bench.config_for("300M")
    out = {"machine": bench.machine(), "forward": {}, "gemm_floor": {}, "block_ms": {}}
    tmodel = bench.torch_model(cfg, "float32", "cpu")
    model = bench.mlx_model(cfg, bench.mlx_weights(tmodel, mx.float32))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        r = bench.time_interleaved(bench.forward_fns(tmodel, {"mlx": model}, 1, 256), warmup=1, reps=3)
        out["forward"][f"torch_threads_{threads}"] = r
        print(
            f"1x256, torch {threads} thread(s): torch {r['torch']['median_ms']:.0f} ms, MLX {r['mlx']['median_ms']:.0f} ms, "
            f"torch/MLX {r['torch']['median_ms'] / r['mlx']['median_ms']:.2f}",
            flush=True,
        )
        g = measure.gemm_profile(cfg, 256, torch_device="cpu", dtype="float32", reps=3)["forward_gemm_ms"]
        out["gemm_floor"][f"torch_threads_{threads}"] = g
        print(
            f"   GEMM floor of a forward: MLX {g['mlx']['unfused_ms']:.0f} ms, torch {g['torch']['unfused_ms']:.0f} ms",
            flush=True,
        )
    del tmodel, model

    layer = Layer(cfg)
    mx.eval(layer.parameters())
    B, L, d, f, H = 1, 256, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    x, h, q = mx.random.normal((B, L, d)), mx.random.normal((B, L, f)), mx.random.normal((B, H, L, 64))
    qt = mx.random.normal((B, L, H, 64)).transpose(0, 2, 1, 3)
    mx.eval(x, h, q, qt)
    pieces = {
        "whole block": lambda: mx.eval(layer(x, None)[0]),
        "attention (mx.fast.sdpa, CPU fallback)": lambda: mx.eval(
            mx.fast.scaled_dot_product_attention(q, q, q, scale=0.125)
        ),
        "layer norm (d)": lambda: mx.eval(layer.input_layernorm(x)),
        "rope (one of q/k)": lambda: mx.eval(layer.self_attn._rope(qt)),
        "silu(gate) * up": lambda: mx.eval(nn.silu(h) * h),
        "exp on L x f": lambda: mx.eval(mx.exp(h)),
        "multiply on L x f": lambda: mx.eval(h * h),
        "residual x + y / s": lambda: mx.eval(x + x / 1.2),
    }
    for name, fn in pieces.items():
        out["block_ms"][name] = median_ms(fn)
        print(f"   {name:40s} {out['block_ms'][name]:8.2f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
