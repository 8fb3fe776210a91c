"""Side-by-side speed: the MLX runtime against transformers, same weights, same inputs, one run.

Every comparison here is a ratio measured in one process: the torch model (transformers'
``EsmcForMaskedLM``, random weights) and the MLX model built from *its* state dict are timed
interleaved (torch, mlx, torch, mlx, ...), so that a noisy shared host disturbs both alike.
``esmc-mlx bench`` and the scripts in ``benchmarks/`` call ``run()`` and the helpers below.

Needs the torch extra (``esmc-mlx[torch]``) for the torch side and matplotlib for the plot;
without torch only the MLX times are reported.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .config import ESMCConfig
from .outputs import atomic_file
from .quantize import BLOCK_LINEAR  # what `esmc-convert --q` quantizes by default
from .runtime.model import ESMC

GPU_SHAPES = ((1, 256), (1, 1024), (16, 256), (64, 512))
CPU_SHAPES = ((1, 256), (8, 256))
QUANT_MODES = {  # name: quantization record (mode, bits, group size)
    "affine8": {"mode": "affine", "bits": 8, "group_size": 64},
    "affine4": {"mode": "affine", "bits": 4, "group_size": 64},
    "mxfp4": {"mode": "mxfp4", "bits": 4, "group_size": 32},
}
# MLX model variants: (fuse q/k/v + gate/up, mx.compile the forward)
VARIANTS = {"mlx": (False, False), "mlx+fuse": (True, False), "mlx+compile": (False, True),
            "mlx+fuse+compile": (True, True)}
DEFAULT_VARIANT = "mlx+fuse+compile"  # what load() gives on a GPU


def default_variant(device: str) -> str:
    """The variant ``load()`` gives on ``device`` ("cpu" or "gpu")."""
    from .runtime.model import RUNTIME_DEFAULTS

    d = RUNTIME_DEFAULTS[device]
    return next(name for name, flags in VARIANTS.items() if flags == (d["fuse"], d["compile"]))


# --- models --------------------------------------------------------------------------------
def config_for(name: str) -> ESMCConfig:
    from .testing import SHAPES, tiny_config

    if name == "tiny":
        return tiny_config()
    if name == "small":  # a 4-layer 300M-wide model: for smoke runs of the GPU suite
        return ESMCConfig(960, 15, 4, 2560)
    return SHAPES[name]


def torch_model(config: ESMCConfig, dtype: str = "float32", device: str = "cpu", seed: int = 0):
    """transformers' EsmcForMaskedLM (sdpa attention), random N(0, 1/fan_in) weights, built
    directly on ``device`` in ``dtype`` (a 6B never passes through host memory in fp32)."""
    import torch
    from transformers import EsmcForMaskedLM

    from .validate.reference import hf_config as transformers_config

    hf_config = transformers_config(config)
    torch_dtype = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = EsmcForMaskedLM(hf_config).eval()
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=generator)
    return model


def mlx_weights(tmodel, dtype: mx.Dtype) -> dict[str, mx.array]:
    """The torch model's state dict as MLX arrays in ``dtype`` (bf16 moves as raw bits)."""
    from .convert.sources import torch_to_mlx

    out = {}
    for name, t in tmodel.state_dict().items():
        out[name] = torch_to_mlx(t).astype(dtype)
        mx.eval(out[name])
    return out


def mlx_model(config: ESMCConfig, weights: dict[str, mx.array], fuse: bool = False, compile: bool = False,
              quant: dict | None = None) -> ESMC:
    """An MLX ESMC holding ``weights`` (shared, not copied), optionally quantized (the block
    projections, as ``esmc-convert --q`` does), fused and compiled."""
    model = ESMC(config)
    names = {k for k, _ in tree_flatten(model.parameters())}
    model.load_weights([(k, v) for k, v in weights.items() if k in names], strict=True)
    if quant:
        from .runtime.quantized import quantize_modules

        quantize_modules(model, dict(quant), lambda path: bool(BLOCK_LINEAR.fullmatch(path)))
    mx.eval(model.parameters())
    if fuse:
        model.fuse()
    if compile:
        model.compile()
    model.eval()
    return model


# --- timing --------------------------------------------------------------------------------
def sync_torch() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], None]], warmup: int = 2, reps: int | None = None,
                     budget_s: float = 3.0, max_reps: int = 20) -> dict[str, dict]:
    """Run each fn ``warmup`` times, then ``reps`` rounds of all fns in turn (interleaved).
    Without ``reps``: as many rounds (3..max_reps) as fit ``budget_s`` per fn."""
    last = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            start = time.perf_counter()
            fn()
            last[name] = time.perf_counter() - start
    if reps is None:
        reps = int(min(max_reps, max(3, budget_s / max(max(last.values()), 1e-6))))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3, "reps": len(t)}
            for name, t in times.items()}


def forward_fns(tmodel, models: dict[str, ESMC], batch: int, length: int, device: str = "cpu",
                seed: int = 0, env: dict[str, dict] | None = None) -> dict[str, Callable[[], None]]:
    """Timed callables: one full forward (logits evaluated) per model, same token ids."""
    ids = np.random.default_rng(seed).integers(4, 24, size=(batch, length))
    fns: dict[str, Callable[[], None]] = {}
    if tmodel is not None:
        import torch

        tids = torch.tensor(ids, device=device)

        def run_torch():
            with torch.inference_mode():
                tmodel(input_ids=tids).logits
            sync_torch()

        fns["torch"] = run_torch
    mids = mx.array(ids)
    for name, model in models.items():
        settings = (env or {}).get(name, {})

        def run_mlx(model=model, settings=settings):
            for k, v in settings.items():
                os.environ[k] = v
            mx.eval(model(mids).logits)
            for k in settings:
                os.environ.pop(k, None)

        fns[name] = run_mlx
    return fns


def model_flops(config: ESMCConfig, batch: int, length: int) -> float:
    """Multiply-adds x 2 of one forward: the projections, attention scores and values, head."""
    d, f, n, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    tokens = batch * length
    per_layer = 2 * tokens * (4 * d * d + 3 * d * f) + 4 * batch * length * length * d
    return n * per_layer + 2 * tokens * (d * d + d * v)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def agreement(tmodel, model: ESMC, device: str, length: int = 64) -> float:
    """rel L2 of MLX logits against torch logits on one sequence: a guard against timing a
    model that computes something else."""
    import torch

    ids = np.random.default_rng(1).integers(4, 24, size=(1, length))
    with torch.inference_mode():
        ref = tmodel(input_ids=torch.tensor(ids, device=device)).logits.float().cpu().numpy()
    out = np.array(model(mx.array(ids)).logits.astype(mx.float32))
    return rel_l2(out, ref)


def compare_forward(tmodel, models: dict[str, ESMC], config: ESMCConfig, shapes, device: str,
                    label: str, budget_s: float = 3.0, log=print, env: dict | None = None) -> list[dict]:
    """One row per (shape, implementation): median/min ms, TFLOP/s, speedup over torch."""
    rows = []
    for batch, length in shapes:
        timings = time_interleaved(forward_fns(tmodel, models, batch, length, device, env=env), budget_s=budget_s)
        flops = model_flops(config, batch, length)
        base = timings.get("torch", {}).get("median_ms")
        for name, t in timings.items():
            row = {"model": label, "batch": batch, "length": length, "impl": name, **t,
                   "tflops": flops / (t["median_ms"] * 1e-3) / 1e12,
                   "speedup_vs_torch": (base / t["median_ms"]) if base else None}
            rows.append(row)
            log(f"{label:>6} {batch:>3}x{length:<5} {name:<22} {t['median_ms']:10.2f} ms  (min {t['min_ms']:.2f}, "
                f"{t['reps']} reps)  {row['tflops']:7.1f} TFLOP/s"
                + (f"  torch/this {row['speedup_vs_torch']:.2f}x" if base else ""))
        mx.clear_cache()
    return rows


# --- GPU extras -----------------------------------------------------------------------------
def matmul_rates(n: int = 8192, dtype: str = "bfloat16", torch_device: str | None = "cuda",
                 reps: int = 10) -> dict:
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


def gemm_profile(config: ESMCConfig, tokens: int, torch_device: str | None = "cuda",
                 dtype: str = "bfloat16", reps: int = 10) -> dict:
    """Time each of a block's GEMMs (fused and unfused) at ``tokens`` rows in MLX and torch:
    their sum x layers is the GEMM floor of a forward; the rest is attention and elementwise."""
    d, f = config.hidden_size, config.intermediate_size
    gemms = {"q|k|v|o (each)": (d, d), "qkv fused": (3 * d, d), "gate|up (each)": (f, d),
             "gate_up fused": (2 * f, d), "down": (d, f)}
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
        rows[name] = {k: {"ms": v["min_ms"] / reps, "tflops": flops * reps / (v["min_ms"] * 1e-3) / 1e12}
                      for k, v in t.items()}
    n = config.num_hidden_layers
    per_layer = {
        impl: {"unfused_ms": n * (4 * rows["q|k|v|o (each)"][impl]["ms"] + 2 * rows["gate|up (each)"][impl]["ms"]
                                  + rows["down"][impl]["ms"]),
               "fused_ms": n * (rows["qkv fused"][impl]["ms"] + rows["q|k|v|o (each)"][impl]["ms"]
                                + rows["gate_up fused"][impl]["ms"] + rows["down"][impl]["ms"])}
        for impl in rows["down"]}
    return {"tokens": tokens, "gemms": rows, "forward_gemm_ms": per_layer}


def attention_memory(heads: int, length: int, batch: int = 1, dtype: str = "bfloat16",
                     torch_device: str | None = "cuda") -> dict:
    """Peak memory above the inputs of one attention call at ``length``: a fused kernel stays
    far below the (B, H, L, L) scores a naive one materializes."""
    mdt = getattr(mx, dtype)
    shape = (batch, heads, length, 64)
    q, k, v = (mx.random.normal(shape).astype(mdt) for _ in range(3))
    keep = mx.arange(length)[None, :] < (length - 16)  # 16 padded keys
    masks = {"none": None, "bool": keep[:, None, None, :],
             "additive": mx.where(keep, 0.0, -mx.inf).astype(mdt)[:, None, None, :]}
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


def forward_memory(model: ESMC, tmodel, length: int, batch: int = 1, padded: int = 0,
                   torch_device: str | None = "cuda") -> dict:
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
            tmodel(input_ids=torch.tensor(ids, device=torch_device),
                   attention_mask=torch.tensor(mask, device=torch_device) if padded else None).logits
        torch.cuda.synchronize()
        out["torch"] = {"peak_extra_bytes": int(torch.cuda.max_memory_allocated() - base)}
        torch.cuda.empty_cache()
    return out


# --- report --------------------------------------------------------------------------------
def machine() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "mlx": mx.__version__, "device": str(mx.default_device()), "cpu_count": os.cpu_count(),
            "date": datetime.date.today().isoformat()}
    try:
        info["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # older mlx, or a backend that does not describe itself
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    from . import _blas

    info["blas"] = _blas.loaded_path
    return info


def plot(results: dict, path: Path, title: str | None = None) -> Path | None:
    """Bar chart of torch-time / MLX-time per (model, shape) and implementation; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in results.get("forward", []) if r["impl"] != "torch" and r.get("speedup_vs_torch")]
    if not rows:
        return None
    groups = list(dict.fromkeys(f"{r['model']}\n{r['batch']}x{r['length']}" for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups)), 4))
    for i, impl in enumerate(impls):
        values = {f"{r['model']}\n{r['batch']}x{r['length']}": r["speedup_vs_torch"] for r in rows if r["impl"] == impl}
        xs = [g + (i - (len(impls) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [values.get(g, 0) for g in groups], width, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    target = results.get("target_speedup")
    if target and target != 1.0:
        ax.axhline(target, color="red", linestyle="--", linewidth=0.8, label=f"target {target}x")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup over transformers (torch time / MLX time)")
    ax.set_title(title or f"ESMC forward, {results.get('backend', '')} {results.get('dtype', '')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_file(path, "wb") as f:  # whole or not at all, a full disk named
            fig.savefig(f, dpi=120, format="png")
    finally:
        plt.close(fig)
    return path


def write(results: dict, out_dir: Path, stem: str = "bench") -> tuple[Path, Path | None]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    with atomic_file(path) as f:
        f.write(json.dumps(results, indent=2, default=str) + "\n")
    return path, plot(results, out_dir / f"{stem}.png")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x256,8x256' -> [(1, 256), (8, 256)]."""
    shapes = []
    for part in text.replace(" ", "").split(","):
        b, _, l = part.lower().partition("x")
        if not (b.isdigit() and l.isdigit()):
            raise ValueError(f"{part!r}: write a shape as BATCHxLENGTH, e.g. 8x256")
        shapes.append((int(b), int(l)))
    return shapes


def run(models=("300M",), shapes=None, device: str = "auto", dtype: str | None = None,
        variants=None, quant=(), out_dir: Path | str = "bench-results", with_torch: bool = True,
        budget_s: float = 3.0, log=print, stem: str = "bench") -> dict:
    """The comparison ``esmc-mlx bench`` runs: for each model size, a random-weight
    transformers model and the MLX model from the same weights, timed interleaved at each
    (batch, length); optionally quantized twins (``quant``: names of QUANT_MODES). Writes
    ``{stem}.json`` and ``{stem}.png`` under ``out_dir`` and returns the results."""
    if device == "auto":
        device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    shapes = list(shapes or (CPU_SHAPES if device == "cpu" else GPU_SHAPES))
    base_variant = default_variant(device)
    variants = list(variants or (base_variant,))
    torch_device = None
    if with_torch:
        try:
            import torch

            torch_device = "cuda" if device == "gpu" and torch.cuda.is_available() else "cpu"
            if torch_device == "cpu":
                torch.set_num_threads(os.cpu_count() or 1)
        except ImportError:
            log("torch is not installed: timing MLX only (pip install 'esmc-mlx[torch]' for the comparison)")
            with_torch = False
    results = {"machine": machine(), "backend": device, "dtype": dtype, "forward": [], "agreement": {},
               "target_speedup": 1.2 if device == "gpu" else 1.0, "quantized": []}
    log(f"backend {device}, {dtype}, mlx {mx.__version__}; torch {'on ' + torch_device if with_torch else 'absent'}")
    for name in models:
        config = config_for(name)
        if with_torch:
            tmodel = torch_model(config, dtype, torch_device)
            weights = mlx_weights(tmodel, getattr(mx, dtype))
        else:
            tmodel = None
            rng = np.random.default_rng(0)
            shapes_ = dict(tree_flatten(ESMC(config).parameters()))
            weights = {k: mx.array(rng.standard_normal(v.shape, dtype=np.float32) * v.shape[-1] ** -0.5)
                       .astype(getattr(mx, dtype)) for k, v in shapes_.items()}
        models_ = {v: mlx_model(config, weights, *VARIANTS[v]) for v in variants}
        if tmodel is not None:
            for v, m in models_.items():
                results["agreement"][f"{name} {v}"] = agreement(tmodel, m, torch_device)
        results["forward"] += compare_forward(tmodel, models_, config, shapes, torch_device or "cpu", name,
                                              budget_s, log)
        for q in quant:
            flags = VARIANTS[base_variant]
            twin = {base_variant: models_.get(base_variant) or mlx_model(config, weights, *flags),
                    q: mlx_model(config, weights, *flags, QUANT_MODES[q])}
            rows = compare_forward(None, twin, config, shapes, "cpu", name, budget_s, log)
            bf = {(r["batch"], r["length"]): r["median_ms"] for r in rows if r["impl"] == base_variant}
            for r in rows:
                if r["impl"] == q:
                    r["vs_float"] = r["median_ms"] / bf[(r["batch"], r["length"])]
                    results["quantized"].append(r)
                    log(f"{name:>6} {r['batch']:>3}x{r['length']:<5} {q} time / float time = {r['vs_float']:.2f}")
        del tmodel, weights, models_
        mx.clear_cache()
    json_path, png = write(results, Path(out_dir), stem)
    log(f"wrote {json_path}" + (f" and {png}" if png else ""))
    return results
