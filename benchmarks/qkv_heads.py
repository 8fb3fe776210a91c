"""kernels.qkv_heads (QK LayerNorm + RoPE + head layout in one CUDA kernel) against MLX's
unfused ops, on the 6B's shapes (d = 2560, 40 heads of 64, bf16).

1. The q/k/v step alone at 16x256, 64x512, 1x4096 (batch x length): the unfused path eager
   and compiled, and the kernel; median ms per call, the kernel's GB/s (qkv read, q/k/v
   written) and its speedup over the compiled unfused path; in the same run, how many
   elements differ from the unfused path and by how many ulps at most.
2. One whole 6B block (random bf16 weights, q/k/v and gate/up fused, compiled) with
   ESMC_MLX_FUSED_QKV=0 and =1: ms per block, speedup, and the blocks' max difference.
Calls are timed in batches (one mx.eval of --batch calls), contenders interleaved.

    python -m benchmarks.qkv_heads --json $OUT/qkv.json     # H200, well under 40 s
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from esmc_mlx.bench import config_for, machine, time_interleaved
from esmc_mlx.runtime import kernels
from esmc_mlx.runtime.model import ESMC, FUSED_QKV_ENV, Layer
from esmc_mlx.testing import init_random_mlx_

SHAPES = [(16, 256), (64, 512), (1, 4096)]


def batched(fn, x, batch: int):
    def run():
        mx.eval([fn(x) for _ in range(batch)])
        mx.synchronize()

    return run


def differences(got, ref) -> dict:
    """Elements differing and the largest difference in ulps (bf16 bit patterns as integers)."""
    n, worst = 0, 0
    for g, r in zip(got, ref, strict=True):
        a = np.array(g.view(mx.int16)).astype(np.int64)
        b = np.array(r.view(mx.int16)).astype(np.int64)
        a, b = np.where(a < 0, -(a + 32768), a), np.where(b < 0, -(b + 32768), b)
        n += int((a != b).sum())
        worst = max(worst, int(np.abs(a - b).max()))
    return {"elements_differing": n, "elements": sum(g.size for g in got), "max_ulps": worst}


def step_rows(cfg, batch: int, reps: int) -> list[dict]:
    heads, d = cfg.num_attention_heads, cfg.hidden_size
    eps, theta = cfg.layer_norm_eps, cfg.rope_theta
    wq = (1 + 0.2 * mx.random.normal((d,))).astype(mx.bfloat16)
    wk = (1 + 0.2 * mx.random.normal((d,))).astype(mx.bfloat16)

    def unfused(x):
        return kernels.qkv_heads_reference(x, wq, wk, eps, theta, heads)

    def fused(x):
        return kernels.qkv_heads(x, wq, wk, eps, theta, heads)

    rows = []
    for B, L in SHAPES:
        x = (mx.random.normal((B, L, 3 * d)) * 2 + 0.5).astype(mx.bfloat16)
        mx.eval(x)
        diff = differences(fused(x), unfused(x))
        t = time_interleaved(
            {
                "unfused_eager": batched(unfused, x, batch),
                "unfused_compiled": batched(mx.compile(unfused), x, batch),
                "kernel": batched(fused, x, batch),
            },
            reps=reps,
        )
        ms = {k: v["median_ms"] / batch for k, v in t.items()}
        moved = 2 * x.nbytes + 2 * d * 2  # qkv read, q/k/v written, the two norm weights
        rows.append(
            {
                "batch": B,
                "length": L,
                **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
                "kernel_GBps": round(moved / (ms["kernel"] * 1e-3) / 1e9, 1),
                "speedup_vs_compiled": round(ms["unfused_compiled"] / ms["kernel"], 2),
                **diff,
            }
        )
        print(rows[-1], flush=True)
    return rows


def random_block(cfg):
    """One fused 6B block with random bf16 weights (``testing.init_random_mlx_``)."""
    model = ESMC(dataclasses.replace(cfg, num_hidden_layers=1))
    model.esmc.layers = [Layer(cfg)]  # the 6B's residual scale
    return init_random_mlx_(model, mx.bfloat16).fuse().esmc.layers[0]


def block_rows(cfg, repeat: int, reps: int) -> list[dict]:
    layer = random_block(cfg)
    before = os.environ.get(FUSED_QKV_ENV)

    def chain(enabled: bool):
        def f(x):
            os.environ[FUSED_QKV_ENV] = "1" if enabled else "0"  # read while tracing
            for _ in range(repeat):
                x = layer(x, None)[0]
            return x

        return mx.compile(f)

    off, on = chain(False), chain(True)
    rows = []
    try:
        for B, L in SHAPES:
            x = mx.random.normal((B, L, cfg.hidden_size)).astype(mx.bfloat16)
            mx.eval(x)
            a, b = off(x), on(x)  # traces each under its own setting
            err = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
            t = time_interleaved({"off": batched(off, x, 1), "on": batched(on, x, 1)}, reps=reps)
            ms = {k: v["median_ms"] / repeat for k, v in t.items()}
            rows.append(
                {
                    "batch": B,
                    "length": L,
                    "block_unfused_ms": round(ms["off"], 3),
                    "block_kernel_ms": round(ms["on"], 3),
                    "speedup": round(ms["off"] / ms["on"], 3),
                    "saved_ms": round(ms["off"] - ms["on"], 3),
                    f"max_abs_diff_after_{repeat}_blocks": err,
                }
            )
            print(rows[-1], flush=True)
    finally:
        if before is None:
            os.environ.pop(FUSED_QKV_ENV, None)
        else:
            os.environ[FUSED_QKV_ENV] = before
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--batch", type=int, default=20, help="calls per timed batch of the q/k/v step")
    p.add_argument("--reps", type=int, default=7, help="timed batches per contender")
    p.add_argument("--repeat", type=int, default=5, help="6B blocks chained per timed call")
    a = p.parse_args(argv)
    if not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        raise SystemExit("Error: benchmarks.qkv_heads needs MLX on a CUDA GPU")
    cfg = config_for("6B")
    mx.random.seed(0)
    result = {
        "machine": machine(with_torch=False),
        "mlx": mx.__version__,
        "step": step_rows(cfg, a.batch, a.reps),
        "block": block_rows(cfg, a.repeat, a.reps),
    }
    return save_json(a.json, result)


if __name__ == "__main__":
    main()
