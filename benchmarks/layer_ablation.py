"""Where one 6B-shaped bf16 block's time goes, by ablation: the block with one part left out at
a time (block LayerNorms, QK-norm, RoPE, attention with its head transposes, SwiGLU), the GEMMs
alone, eager and compiled; torch's EsmcLayer and its four GEMMs beside it (GPU only). The
difference between "full" and a "-part" row is that part's cost. Issue 16's profile:

    python -m benchmarks.layer_ablation --json $OUT/ablation.json       # on the GPU machine
    python -m benchmarks.layer_ablation --small                         # smoke run, any machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from benchmarks import save_json
from esmc_mlx.bench import config_for, transformers_config
from esmc_mlx.runtime.model import ESMC, Layer
from esmc_mlx.testing import init_random_mlx_

REPEAT = 10  # block calls chained per evaluation
VARIANTS = {
    "full": set(),
    "-ln": {"ln"},
    "-qknorm": {"qknorm"},
    "-rope": {"rope"},
    "-attn(sdpa+rope+transposes)": {"attn"},
    "-swiglu": {"swiglu"},
    "gemm_only": {"ln", "qknorm", "attn", "swiglu"},
}


def fused_layer(config) -> Layer:
    """One block of ``config`` (its residual scale), random bf16 weights, q/k/v and gate/up fused."""
    model = ESMC(dataclasses.replace(config, num_hidden_layers=1))
    model.esmc.layers = [Layer(config)]
    return init_random_mlx_(model, mx.bfloat16).fuse().esmc.layers[0]


def variant(layer: Layer, drop: set[str]):
    """The block's forward with the parts in ``drop`` left out (fused q/k/v and gate/up)."""
    a = layer.self_attn

    def block(x):
        B, L, _ = x.shape
        h = x if "ln" in drop else layer.input_layernorm(x)
        q, k, v = mx.split(a.qkv_proj(h), 3, axis=-1)
        if "qknorm" not in drop:
            q, k = a.q_norm(q), a.k_norm(k)
        if "attn" in drop:
            o = v
        else:
            q, k, v = a._heads(q), a._heads(k), a._heads(v)
            if "rope" not in drop:
                q, k = a._rope(q), a._rope(k)
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=a.scale, mask=None)
            o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        x = x + a.o_proj(o) / layer.residual_scale
        h = x if "ln" in drop else layer.post_attention_layernorm(x)
        g, u = mx.split(layer.mlp.gate_up_proj(h), 2, axis=-1)
        act = g if "swiglu" in drop else nn.silu(g) * u
        return x + layer.mlp.down_proj(act) / layer.residual_scale

    def chained(x):
        for _ in range(REPEAT):
            x = block(x)
        return x

    return chained


def median_ms(fn, x, reps: int) -> float:
    for _ in range(2):
        mx.eval(fn(x))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def torch_rows(config, shapes, reps: int) -> dict:
    import torch
    from transformers.models.esmc.modeling_esmc import EsmcLayer, EsmcRotaryEmbedding

    hf = transformers_config(config)
    with torch.device("cuda"):
        layer = EsmcLayer(hf, layer_idx=0).to(torch.bfloat16).eval()
        rotary = EsmcRotaryEmbedding(hf)
    d, f = config.hidden_size, config.intermediate_size

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    rows = {}
    for B, L in shapes:
        x = torch.randn(B, L, d, device="cuda", dtype=torch.bfloat16)
        pe = rotary(x, torch.arange(L, device="cuda")[None])
        y = x.reshape(-1, d)
        ws = [
            torch.randn(o, i, device="cuda", dtype=torch.bfloat16) for o, i in ((3 * d, d), (d, d), (2 * f, d), (d, f))
        ]
        z = torch.zeros(y.shape[0], f, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            rows[f"{B}x{L}"] = {
                "layer": timed(lambda x=x, pe=pe: layer(x, None, position_embeddings=pe)),
                "4 GEMMs": timed(lambda y=y, z=z, ws=ws: [y @ ws[0].T, y @ ws[1].T, y @ ws[2].T, z @ ws[3].T]),
            }
    return rows


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="6B")
    p.add_argument("--small", action="store_true", help="a small shape and input, eager only (smoke run)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    config = config_for("small" if a.small else a.shape)
    shapes = [(2, 16)] if a.small else [(16, 256), (64, 512), (1, 4096)]
    layer = fused_layer(config)
    result = {"shape": "small" if a.small else a.shape, "device": str(mx.default_device()), "mlx_ms_per_block": {}}
    for B, L in shapes:
        x = mx.random.normal((B, L, config.hidden_size)).astype(mx.bfloat16)
        mx.eval(x)
        row = {}
        for name, drop in VARIANTS.items():
            fn = variant(layer, drop)
            row[f"{name} eager"] = median_ms(fn, x, a.reps) / REPEAT
            if not a.small:
                row[f"{name} compiled"] = median_ms(mx.compile(fn), x, a.reps) / REPEAT
        result["mlx_ms_per_block"][f"{B}x{L}"] = row
        print(f"{B}x{L}", json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    if not a.small and mx.default_device() == mx.gpu:
        result["torch_ms_per_block"] = torch_rows(config, shapes, a.reps)
        print("torch", json.dumps(result["torch_ms_per_block"]), flush=True)
    return save_json(a.json, result)


if __name__ == "__main__":
    main()
