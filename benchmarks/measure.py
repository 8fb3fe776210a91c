"""GPU and profiling measurements that only the scripts in benchmarks/ use (moved out of
esmc_mlx/bench.py, which keeps what `esmc-mlx bench` and the tests need): GEMM rates, a block's
GEMM profile, attention and whole-forward memory. Run the scripts from the repository root as
modules, e.g. ``python -m benchmarks.gpu_suite``."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from esmc_mlx.bench import sync_torch, time_interleaved
from esmc_mlx.config import ESMCConfig
from esmc_mlx.runtime.model import ESMC


def matmul_rates(n: int = 8192, dtype: str = "bfloat16", torch_device: str | None = "cuda", reps: int = 10) -> dict:
    """Square GEMM rate (TFLOP/s) in MLX and (if given) torch: the ceiling a forward is
    measured against."""
    out = {"n": n, "dtype": dtype}
    a = mx.random.normal((n, n)).astype(getattr(mx, dtype))
    b = mx.random.normal((n, n)).astype(getattr(mx, dtype))
    mx.eval(a, b)

    def mlx_mm():
        mx.eval([a @ b for _ in range(reps)])

    fns = {"mlx": mlx_mm}
    if torch_device:
        import torch

        ta = torch.randn(n, n, device=torch_device, dtype=getattr(torch, dtype))
        tb = torch.randn(n, n, device=torch_device, dtype=getattr(torch, dtype))

        def torch_mm():
            for _ in range(reps):
                ta @ tb
            sync_torch()

        fns["torch"] = torch_mm
    t = time_interleaved(fns, warmup=2, reps=5)
    for name, v in t.items():
        out[f"{name}_tflops"] = 2 * n**3 * reps / (v["min_ms"] * 1e-3) / 1e12
    out["peak_tflops"] = max(out[k] for k in out if k.endswith("_tflops"))
    return out


def gemm_profile(
    config: ESMCConfig, tokens: int, torch_device: str | None = "cuda", dtype: str = "bfloat16", reps: int = 10
) -> dict:
    """Time each of a block's GEMMs (fused and unfused) at ``tokens`` rows in MLX and torch:
    their sum x layers is the GEMM floor of a forward; the rest is attention and elementwise."""
    d, f = config.hidden_size, config.intermediate_size
    gemms = {
        "q|k|v|o (each)": (d, d),
        "qkv fused": (3 * d, d),
        "gate|up (each)": (f, d),
        "gate_up fused": (2 * f, d),
        "down": (d, f),
    }
    mdt = getattr(mx, dtype)
    rows = {}
    for name, (out_dim, in_dim) in gemms.items():
        x = mx.random.normal((tokens, in_dim)).astype(mdt)
        w = mx.random.normal((out_dim, in_dim)).astype(mdt)
        mx.eval(x, w)
        fns = {"mlx": lambda x=x, w=w: mx.eval([x @ w.T for _ in range(reps)])}
        if torch_device:
            import torch

            tx = torch.randn(tokens, in_dim, device=torch_device, dtype=getattr(torch, dtype))
            tw = torch.randn(out_dim, in_dim, device=torch_device, dtype=getattr(torch, dtype))

            def tmm(tx=tx, tw=tw):
                for _ in range(reps):
                    torch.nn.functional.linear(tx, tw)
                sync_torch()

            fns["torch"] = tmm
        t = time_interleaved(fns, warmup=2, reps=5)
        flops = 2 * tokens * out_dim * in_dim
        rows[name] = {
            k: {"ms": v["min_ms"] / reps, "tflops": flops * reps / (v["min_ms"] * 1e-3) / 1e12} for k, v in t.items()
        }
    n = config.num_hidden_layers
    per_layer = {
        impl: {
            "unfused_ms": n
            * (
                4 * rows["q|k|v|o (each)"][impl]["ms"]
                + 2 * rows["gate|up (each)"][impl]["ms"]
                + rows["down"][impl]["ms"]
            ),
            "fused_ms": n
            * (
                rows["qkv fused"][impl]["ms"]
                + rows["q|k|v|o (each)"][impl]["ms"]
                + rows["gate_up fused"][impl]["ms"]
                + rows["down"][impl]["ms"]
            ),
        }
        for impl in rows["down"]
    }
    return {"tokens": tokens, "gemms": rows, "forward_gemm_ms": per_layer}


def attention_memory(
    heads: int, length: int, batch: int = 1, dtype: str = "bfloat16", torch_device: str | None = "cuda"
) -> dict:
    """Peak memory above the inputs of one attention call at ``length``: a fused kernel stays
    far below the (B, H, L, L) scores a naive one materializes."""
    mdt = getattr(mx, dtype)
    shape = (batch, heads, length, 64)
    q, k, v = (mx.random.normal(shape).astype(mdt) for _ in range(3))
    keep = mx.arange(length)[None, :] < (length - 16)  # 16 padded keys
    masks = {
        "none": None,
        "bool": keep[:, None, None, :],
        "additive": mx.where(keep, 0.0, -mx.inf).astype(mdt)[:, None, None, :],
    }
    mx.eval(q, k, v, *[m for m in masks.values() if m is not None])
    scores_bytes = batch * heads * length * length * mdt.size
    out = {"heads": heads, "length": length, "batch": batch, "scores_bytes": scores_bytes, "mlx": {}}
    for name, m in masks.items():
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        fn = lambda m=m: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m))  # noqa: E731
        fn()
        peak = mx.get_peak_memory() - base
        t = time_interleaved({"x": fn}, warmup=1, reps=5)["x"]
        out["mlx"][name] = {"peak_extra_bytes": int(peak), "ms": t["median_ms"]}
    if torch_device:
        import torch

        tq, tk, tv = (torch.randn(*shape, device=torch_device, dtype=getattr(torch, dtype)) for _ in range(3))
        tkeep = torch.arange(length, device=torch_device)[None, None, None, :] < (length - 16)
        out["torch"] = {}
        for name, m in {"none": None, "bool": tkeep}.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()

            def fn(m=m):
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=m, scale=0.125)
                sync_torch()

            fn()
            peak = torch.cuda.max_memory_allocated() - base
            t = time_interleaved({"x": fn}, warmup=1, reps=5)["x"]
            out["torch"][name] = {"peak_extra_bytes": int(peak), "ms": t["median_ms"]}
    return out


def forward_memory(
    model: ESMC, tmodel, length: int, batch: int = 1, padded: int = 0, torch_device: str | None = "cuda"
) -> dict:
    """Peak memory of a whole forward at ``length`` above the weights, MLX and torch;
    ``padded`` > 0 right-pads that many tokens (so a key mask is needed)."""
    ids = np.random.default_rng(0).integers(4, 24, size=(batch, length))
    mask = np.ones((batch, length), dtype=np.int32)
    if padded:
        mask[:, -padded:] = 0
    out = {"length": length, "batch": batch, "padded": padded, "mlx": {}}
    mx.eval(model.parameters())
    for call in ("first", "second", "third"):  # eager, then traced+compiled, then compiled
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        start = time.perf_counter()
        mx.eval(model(mx.array(ids), attention_mask=mx.array(mask) if padded else None).logits)
        out["mlx"][f"{call}_call_ms"] = (time.perf_counter() - start) * 1e3
        out["mlx"][f"{call}_peak_extra_bytes"] = int(mx.get_peak_memory() - base)
    out["mlx"]["peak_extra_bytes"] = max(v for k, v in out["mlx"].items() if k.endswith("peak_extra_bytes"))
    mx.clear_cache()
    if tmodel is not None and torch_device:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.inference_mode():
            _ = tmodel(
                input_ids=torch.tensor(ids, device=torch_device),
                attention_mask=torch.tensor(mask, device=torch_device) if padded else None,
            ).logits
        torch.cuda.synchronize()
        out["torch"] = {"peak_extra_bytes": int(torch.cuda.max_memory_allocated() - base)}
        torch.cuda.empty_cache()
    return out
