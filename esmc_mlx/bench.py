"""Side-by-side speed: the MLX runtime against transformers, same weights, same inputs.

``run()`` (what ``esmc-mlx bench`` calls) times each side in its own process: the torch model
(transformers' ``EsmcForMaskedLM``, random weights) first, eager and then with its blocks
compiled (``--torch``), then the MLX model built from *its* weights. The helpers below also time
several callables interleaved in one process (torch, mlx, torch, mlx, ...), which the GPU
scripts in ``benchmarks/`` use. ``provenance()`` is what every benchmark's JSON records of the
source and the device it measured.

Needs the torch extra (``esmc-mlx[torch]``) for the torch side and matplotlib for the plot;
without torch only the MLX times are reported.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import _blas
from ._version import __version__
from .config import ESMCConfig
from .convert.sources import torch_to_mlx
from .errors import EsmcMlxError, install_hint
from .outputs import atomic_file, guard, held
from .quantize import BLOCK_LINEAR  # what `esmc-convert --q` quantizes by default
from .runtime import dispatch
from .runtime.cuda import cutlass_qmm
from .runtime.execution import RUNTIME_DEFAULTS
from .runtime.load import prepare
from .runtime.model import ESMC
from .runtime.quantized import quantize_modules
from .testing import SHAPES, tiny_config
from .validate.reference import hf_config as transformers_config

GPU_SHAPES = ((1, 256), (1, 1024), (16, 256), (64, 512))
CPU_SHAPES = ((1, 256), (8, 256))
QUANT_MODES = {  # name: quantization record (mode, bits, group size)
    "affine8": {"mode": "affine", "bits": 8, "group_size": 64},
    "affine4": {"mode": "affine", "bits": 4, "group_size": 64},
    "mxfp4": {"mode": "mxfp4", "bits": 4, "group_size": 32},
}
# MLX model variants: (fuse q/k/v + gate/up, mx.compile the forward)
VARIANTS = {
    "mlx": (False, False),
    "mlx+fuse": (True, False),
    "mlx+compile": (False, True),
    "mlx+fuse+compile": (True, True),
}
DEFAULT_VARIANT = "mlx+fuse+compile"  # what load() gives on a GPU
# How the torch side runs: transformers' model as it comes, or with each EsmcLayer compiled by
# torch.compile (regional compilation: one block's graph, reused by every block; a 6B compiles
# in seconds, where compiling the whole 80-block model did not finish in 4 minutes). The row
# names in bench.json.
TORCH_MODES = {"eager": "torch", "compiled": "torch-compiled"}


def default_torch_modes(device: str) -> tuple[str, ...]:
    """Both on a GPU. On the CPU eager only: inductor builds each compiled graph as C++, which
    took 58 s for esmc-tiny's first shape on a 2-core host (4 s from its disk cache), and again
    for each new shape."""
    return tuple(TORCH_MODES) if device == "gpu" else ("eager",)


def parse_torch_modes(text: str) -> tuple[str, ...]:
    """'eager,compiled' -> ('eager', 'compiled'); ValueError for anything else."""
    modes = tuple(dict.fromkeys(m.strip().lower() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in TORCH_MODES]
    if unknown or not modes:
        raise ValueError(f"{text!r}: choose one or both of {', '.join(TORCH_MODES)} (comma-separated)")
    return modes


def default_variant(device: str) -> str:
    """The variant ``load()`` gives on ``device`` ("cpu" or "gpu")."""
    d = RUNTIME_DEFAULTS[device]
    return next(name for name, flags in VARIANTS.items() if flags == (d["fuse"], d["compile"]))


# --- models --------------------------------------------------------------------------------
def config_for(name: str) -> ESMCConfig:
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
    out = {}
    for name, t in tmodel.state_dict().items():
        out[name] = torch_to_mlx(t).astype(dtype)
        mx.eval(out[name])
    return out


def mlx_model(
    config: ESMCConfig,
    weights: dict[str, mx.array],
    fuse: bool = False,
    compile: bool = False,
    quant: dict | None = None,
) -> ESMC:
    """An MLX ESMC holding ``weights`` (shared, not copied), optionally quantized (the block
    projections, as ``esmc-convert --q`` does), fused and compiled, with load()'s fused steps
    on a CUDA GPU."""
    model = ESMC(config)
    names = {k for k, _ in tree_flatten(model.parameters())}
    model.load_weights([(k, v) for k, v in weights.items() if k in names], strict=True)
    if quant:
        quantize_modules(model, dict(quant), lambda path: bool(BLOCK_LINEAR.fullmatch(path)))
    mx.eval(model.parameters())
    return prepare(model, fuse=fuse, compile=compile)


# --- timing --------------------------------------------------------------------------------
def sync_torch() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compile_blocks(tmodel) -> None:
    """Compile each transformer block of transformers' ``EsmcForMaskedLM`` in place
    (``nn.Module.compile``: torch.compile's default mode, inductor), for each shape its own
    graph (``dynamic=False``: as MLX traces each shape; dynamic-shape kernels give up the
    shape's specializations). A block compiles at its first call at a new shape."""
    for layer in tmodel.esmc.layers:
        layer.compile(dynamic=False)


def time_interleaved(
    fns: dict[str, Callable[[], None]],
    warmup: int = 2,
    reps: int | None = None,
    budget_s: float = 3.0,
    max_reps: int = 20,
) -> dict[str, dict]:
    """Run each fn ``warmup`` times, then ``reps`` rounds of all fns in turn (interleaved), each
    turn a call of the fn and a timed call right after it. Without ``reps``: as many rounds
    (3..max_reps) as fit ``budget_s`` of calls per fn.

    Each round starts one fn further on (A B C, B C A, C A B, ...), so that no fn is always
    first or last; interleaving spreads the machine's drift over every fn alike. Each timed call
    follows a call of its own fn, as in a process that runs one model: a model timed right after
    another ran slower than in a run of its own calls (on an H200 two identical copies of a
    quantized 6B read 3-4% apart by their place without this)."""
    last = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            start = time.perf_counter()
            fn()
            last[name] = time.perf_counter() - start
    if reps is None:
        reps = int(min(max_reps, max(3, budget_s / (2 * max(max(last.values()), 1e-6)))))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fns[name]()  # the state the previous fn left (caches, buffers) is this fn's again
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {
        name: {
            "median_ms": statistics.median(t) * 1e3,
            "min_ms": min(t) * 1e3,
            "reps": len(t),
            "times_ms": [round(x * 1e3, 4) for x in t],
        }
        for name, t in times.items()
    }


def forward_fns(
    tmodel,
    models: dict[str, ESMC],
    batch: int,
    length: int,
    device: str = "cpu",
    seed: int = 0,
    torch_name: str = "torch",
) -> dict[str, Callable[[], None]]:
    """Timed callables: one full forward (logits evaluated) per model, same token ids; the torch
    model's under ``torch_name``."""
    ids = np.random.default_rng(seed).integers(4, 24, size=(batch, length))
    fns: dict[str, Callable[[], None]] = {}
    if tmodel is not None:
        import torch

        tids = torch.tensor(ids, device=device)

        def run_torch():
            with torch.inference_mode():
                _ = tmodel(input_ids=tids).logits
            sync_torch()

        fns[torch_name] = run_torch
    mids = mx.array(ids)
    for name, model in models.items():

        def run_mlx(model=model):
            mx.eval(model(mids).logits)

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

    ids = _agreement_ids(length)
    with torch.inference_mode():
        ref = tmodel(input_ids=torch.tensor(ids, device=device)).logits.float().cpu().numpy()
    out = np.array(model(mx.array(ids)).logits.astype(mx.float32))
    return rel_l2(out, ref)


def flop_rate(tflops: float) -> str:
    """A rate with three significant digits: a tiny model's 0.0004 TFLOP/s reads 0.4 GFLOP/s."""
    return f"{tflops:.3g} TFLOP/s" if tflops >= 0.1 else f"{tflops * 1e3:.3g} GFLOP/s"


def compare_forward(
    tmodel,
    models: dict[str, ESMC],
    config: ESMCConfig,
    shapes,
    device: str,
    label: str,
    budget_s: float = 3.0,
    log=print,
    torch_name: str = "torch",
) -> list[dict]:
    """One row per (shape, implementation): median/min ms, TFLOP/s, speedup over torch."""
    rows = []
    for batch, length in shapes:
        fns = forward_fns(tmodel, models, batch, length, device, torch_name=torch_name)
        timings = time_interleaved(fns, budget_s=budget_s)
        flops = model_flops(config, batch, length)
        base = timings.get(torch_name, {}).get("median_ms")
        for name, t in timings.items():
            row = {
                "model": label,
                "batch": batch,
                "length": length,
                "impl": name,
                **t,
                "tflops": flops / (t["median_ms"] * 1e-3) / 1e12,
                "speedup_vs_torch": (base / t["median_ms"]) if base else None,
            }
            rows.append(row)
            log(
                f"{label:>6} {batch:>3}x{length:<5} {name:<22} {t['median_ms']:10.2f} ms  (min {t['min_ms']:.2f}, "
                f"{t['reps']} reps)  {flop_rate(row['tflops']):>14}"
                + (f"  torch/this {row['speedup_vs_torch']:.2f}x" if base and name != torch_name else "")
            )
        mx.clear_cache()
    return rows


# --- report --------------------------------------------------------------------------------
def machine(with_torch: bool = True, device: str | None = None) -> dict:
    """What ran a benchmark; ``device`` ("cpu" or "gpu"; default MLX's default device) is where
    its MLX side runs."""
    device = device or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "cpu_count": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
    }
    try:
        info["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
        # whether quantized layers may take CUTLASS's mixed-input GEMM here (never on the CPU,
        # though the GPU beside it has the extension)
        info["cutlass_qmm"] = device == "gpu" and dispatch.current().cutlass
    except Exception:  # older mlx, or a backend that does not describe itself
        pass
    try:
        if not with_torch:
            raise ImportError
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass

    info["blas"] = _blas.loaded_path
    info["blas_info"] = dict(_blas.info)
    return info


# Where the source is no git checkout (a copy of one on a GPU host), the file at its root that
# names the commit: "HASH", or "HASH+dirty" for a tree that differed from it.
SOURCE_STAMP = "SOURCE_COMMIT"
ROOT = Path(__file__).resolve().parent.parent  # the checkout, when esmc_mlx runs from one


def source_commit(root: Path = ROOT) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the source esmc_mlx runs from: ``git rev-parse HEAD`` and whether
    tracked files differ from it, when ``root`` is a git checkout's top; else, or where that
    repository lacks the commit ``SOURCE_STAMP`` names, the stamp's; else (None, None) (an
    installed wheel)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    stamp = root / SOURCE_STAMP
    stamped, _, flag = stamp.read_text().strip().partition("+") if stamp.is_file() else ("", "", "")
    top = git("rev-parse", "--show-toplevel")
    # a stamp naming a commit this repository lacks came with a copy of a newer tree (a GPU host's)
    foreign = bool(stamped) and git("cat-file", "-e", stamped + "^{commit}") is None
    if top and Path(top).resolve() == root.resolve() and not foreign:  # not a repository that merely holds a venv
        head, changes = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
        if head:
            return head, bool(changes)
    if stamped:
        return stamped, flag == "dirty"
    return None, None


def source_stamp(root: Path = ROOT) -> str | None:
    """``source_commit`` as SOURCE_STAMP's one line ("HASH" or "HASH+dirty"); None without one."""
    commit, dirty = source_commit(root)
    return None if commit is None else commit + ("+dirty" if dirty else "")


def provenance(device: str | None = None) -> dict:
    """What a benchmark's figures belong to: the source commit and whether the tree differed
    from it (``source_commit``), esmc-mlx's and MLX's versions, the device that ran MLX
    (``device``: "gpu" or "cpu"; default MLX's default) by name and architecture, and the time."""
    commit, dirty = source_commit()
    device = device or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    try:
        info = mx.device_info(mx.gpu if device == "gpu" else mx.cpu)
    except Exception:  # a backend that does not describe itself
        info = {}
    name = str(info.get("device_name") or platform.processor() or platform.machine())
    arch = info.get("architecture")
    return {
        "commit": commit,
        "dirty": dirty,
        "esmc_mlx": __version__,
        "mlx": mx.__version__,
        "device": f"{name} ({arch})" if arch else name,
        "backend": device,
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def plot(results: dict, path: Path, title: str | None = None) -> Path | None:
    """Bar chart of torch time / MLX time per (model, shape), one bar per MLX implementation and
    torch mode (eager, compiled); without torch rows, MLX's milliseconds. None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    mlx_rows = [r for r in results.get("forward", []) if r["impl"] not in TORCH_MODES.values()]
    bars = []  # (label, row, key)
    for mode, key in SPEEDUP_KEYS.items():
        bars += [(f"{r['impl']} vs torch {mode}", r, key) for r in mlx_rows if r.get(key)]
    versus_torch = bool(bars)
    if not versus_torch:  # MLX alone (no torch): its own times
        bars = [(r["impl"], r, "median_ms") for r in mlx_rows]
    if not bars:
        return None
    groups = list(dict.fromkeys(f"{r['model']}\n{r['batch']}x{r['length']}" for _, r, _ in bars))
    labels = list(dict.fromkeys(label for label, _, _ in bars))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups)), 4))
    for i, label in enumerate(labels):
        values = {f"{r['model']}\n{r['batch']}x{r['length']}": r[key] for name, r, key in bars if name == label}
        xs = [g + (i - (len(labels) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [values.get(g, 0) for g in groups], width, label=label)
    target = results.get("target_speedup")
    if versus_torch:
        ax.axhline(1.0, color="black", linewidth=0.8)
    if versus_torch and target and target != 1.0:
        ax.axhline(target, color="red", linestyle="--", linewidth=0.8, label=f"target {target}x")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(
        "speedup over transformers (torch time / MLX time)" if versus_torch else "ms per forward (median; no torch)"
    )
    ax.set_title(title or f"ESMC forward, {results.get('backend', '')} {results.get('dtype', '')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    folder = held(path.parent)  # bench's output folder (``run``), or a caller's own folder
    if folder is not None:
        folder.claim(path.name)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_file(path, "wb") as f:  # whole or not at all, a full disk named
            fig.savefig(f, dpi=120, format="png")
    finally:
        plt.close(fig)
    return path


def write(results: dict, out_dir: Path, stem: str = "bench") -> tuple[Path, Path | None]:
    """``{stem}.json`` and ``{stem}.png`` in ``out_dir``, through the output guard of the folder
    (a bench folder: a file esmc-mlx did not write there is never replaced)."""
    out_dir = Path(out_dir)
    with guard(out_dir, "bench", "folder", resumable=False) as folder:
        with folder.file(f"{stem}.json") as f:
            f.write(json.dumps(results, indent=2, default=str) + "\n")
        return out_dir / f"{stem}.json", plot(results, out_dir / f"{stem}.png")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x256,8x256' -> [(1, 256), (8, 256)]."""
    shapes = []
    for part in text.replace(" ", "").split(","):
        b, _, l = part.lower().partition("x")
        if not (b.isdigit() and l.isdigit() and int(b) > 0 and int(l) > 0):
            raise ValueError(f"{part!r}: write a shape as BATCHxLENGTH of positive integers, e.g. 8x256")
        shapes.append((int(b), int(l)))
    return shapes


def run(
    models=("300M",),
    shapes=None,
    device: str = "auto",
    dtype: str | None = None,
    variants=None,
    quant=(),
    out_dir: Path | str = "bench-results",
    with_torch: bool = True,
    budget_s: float = 3.0,
    log=print,
    stem: str = "bench",
    torch_modes=None,
) -> dict:
    """The comparison ``esmc-mlx bench`` runs: for each model size, a random-weight
    transformers model and the MLX model from the same weights, timed at each (batch, length);
    optionally quantized twins (``quant``: names of QUANT_MODES). The torch side runs in each of
    ``torch_modes`` (TORCH_MODES; default ``default_torch_modes``): eager, and with its blocks
    compiled, whose compile time (the first call at each shape) is reported apart from its
    timings. Each side runs in its own fresh process (``python -m esmc_mlx.bench``), one after
    the other: the first torch side builds the model, saves its weights and reference logits and
    times its forwards; a compiled torch side rebuilds the same weights, compiles and times; the
    MLX side loads those weights, checks its logits against the reference and times its
    variants. In one process each library's BLAS, threads and memory disturb the other's (torch
    ran 9x slower on the CPU there). Writes ``{stem}.json`` and ``{stem}.png`` under
    ``out_dir`` (a folder esmc-mlx made, or a new or empty one: the output guard's, checked
    now, not after the timing) and returns the results."""
    with guard(out_dir, "bench", "folder", resumable=False) as folder:
        folder.check_free(f"{stem}.json")
        folder.check_free(f"{stem}.png")
        return _run(
            models, shapes, device, dtype, variants, quant, out_dir, with_torch, budget_s, log, stem, torch_modes
        )


def _run(models, shapes, device, dtype, variants, quant, out_dir, with_torch, budget_s, log, stem, torch_modes) -> dict:
    if device == "auto":
        device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    if device == "gpu" and not mx.is_available(mx.gpu):  # else the MLX child's traceback, after the torch side
        raise EsmcMlxError("--device gpu: this MLX has no GPU backend (it runs on the CPU here); use --device cpu")
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    shapes = [tuple(s) for s in (shapes or (CPU_SHAPES if device == "cpu" else GPU_SHAPES))]
    torch_modes = tuple(torch_modes or default_torch_modes(device))
    torch_state = f"{' and '.join(torch_modes)}, in its own process" if with_torch else "not run (--no-torch)"
    if with_torch and not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "safetensors")):
        log(f"torch is not installed: timing MLX only ({install_hint('torch')} for the comparison)")
        with_torch, torch_state = False, "not installed"
    results = {
        "machine": machine(with_torch=False, device=device),
        "provenance": provenance(device),
        "backend": device,
        "dtype": dtype,
        "torch_modes": list(torch_modes) if with_torch else [],
        "forward": [],
        "agreement": {},
        "target_speedup": 1.2 if device == "gpu" else 1.0,
        "quantized": [],
        "isolation": "each side in its own process",
    }
    cutlass = ""
    if results["machine"].get("cutlass_qmm"):
        cutlass = "; CUTLASS mixed-input GEMM built (quantized layers use it)"
    elif device == "gpu" and quant and (unused := cutlass_qmm.why_unused()):
        cutlass = f"; quantized layers without CUTLASS's mixed-input GEMM: {unused}"
    log(f"backend {device}, {dtype}, mlx {mx.__version__}; torch {torch_state}{cutlass}")
    with tempfile.TemporaryDirectory(prefix="esmc-bench-") as tmp:
        for name in models:
            job = {
                "model": name,
                "device": device,
                "dtype": dtype,
                "shapes": shapes,
                "budget_s": budget_s,
                "variants": list(variants or ()),
                "quant": list(quant),
                "dir": str(Path(tmp) / name),
            }
            Path(job["dir"]).mkdir()
            torch_rows = []
            for i, mode in enumerate(torch_modes if with_torch else ()):
                side = _side("torch", {**job, "torch_mode": mode, "save": i == 0}, log)
                results["machine"].update(side["machine"])
                results["agreement"].update(side.get("agreement", {}))
                torch_rows += side["rows"]
            results["forward"] += torch_rows
            mlx_side = _side("mlx", job, log)
            add_speedups(mlx_side["rows"], torch_rows)
            results["forward"] += mlx_side["rows"]
            results["agreement"].update(mlx_side["agreement"])
            results["quantized"] += mlx_side["quantized"]
            for line in summary(name, torch_rows + mlx_side["rows"]):
                log(line)
    json_path, png = write(results, Path(out_dir), stem)
    if png is None and importlib.util.find_spec("matplotlib") is None:
        log(f"wrote {json_path}; no plot: matplotlib is not installed ({install_hint('plot')})")
    else:
        log(f"wrote {json_path}" + (f" and {png}" if png else ""))
    return results


# The MLX rows' ratio to each torch mode: torch time / MLX time.
SPEEDUP_KEYS = {"eager": "speedup_vs_torch", "compiled": "speedup_vs_torch_compiled"}


def add_speedups(mlx_rows: list[dict], torch_rows: list[dict]) -> None:
    """Set each MLX row's torch time / MLX time for every torch mode timed at its shape (None
    for a mode not timed there)."""
    by_mode = {impl: mode for mode, impl in TORCH_MODES.items()}
    base = {(by_mode[r["impl"]], r["batch"], r["length"]): r["median_ms"] for r in torch_rows}
    for r in mlx_rows:
        for mode, key in SPEEDUP_KEYS.items():
            torch_ms = base.get((mode, r["batch"], r["length"]))
            r[key] = torch_ms / r["median_ms"] if torch_ms else None


def summary(name: str, rows: list[dict]) -> list[str]:
    """One line per (shape, MLX variant): each side's median ms and TFLOP/s, the compiled
    side's compile seconds, and torch time / MLX time for each torch mode."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        by_shape.setdefault((r["batch"], r["length"]), []).append(r)
    lines = []
    for (batch, length), shape_rows in by_shape.items():
        torch_rows = [r for r in shape_rows if r["impl"] in TORCH_MODES.values()]
        sides = []
        for r in torch_rows:
            compiled = f", compiled in {r['compile_s']:.1f} s" if r.get("compile_s") is not None else ""
            sides.append(f"{r['impl']} {r['median_ms']:.2f} ms ({flop_rate(r['tflops'])}{compiled})")
        for r in shape_rows:
            if r in torch_rows:
                continue
            ratios = ", ".join(
                f"{mode} / MLX {r[key]:.2f}x" for mode, key in SPEEDUP_KEYS.items() if r.get(key) is not None
            )
            mlx = f"{r['impl']} {r['median_ms']:.2f} ms ({flop_rate(r['tflops'])})"
            lines.append(
                f"{name:>6} {batch:>3}x{length:<5} " + " | ".join([*sides, mlx]) + (f" | {ratios}" if ratios else "")
            )
    return lines


def _side(kind: str, job: dict, log) -> dict:
    """Run one side in a fresh interpreter, its progress lines passed to ``log``."""
    label = f"{kind}-{job['torch_mode']}" if kind == "torch" else kind
    job_path = Path(job["dir"]) / f"{label}-job.json"
    job_path.write_text(json.dumps(job))
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "esmc_mlx.bench", kind, str(job_path)],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    for line in proc.stdout:
        log(line.rstrip("\n"))
    if proc.wait() != 0:
        raise EsmcMlxError(f"the {label} side of the benchmark failed (exit {proc.returncode}); its error is above")
    return json.loads(job_path.with_name(job_path.name.replace("-job.json", ".json")).read_text())


def _torch_side(job: dict) -> dict:
    import torch
    from safetensors.torch import save_file

    config = config_for(job["model"])
    mode = job.get("torch_mode", "eager")
    impl = TORCH_MODES[mode]
    device = "cuda" if job["device"] == "gpu" and torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    tmodel = torch_model(config, job["dtype"], device)
    weights, reference = Path(job["dir"]) / "weights.safetensors", Path(job["dir"]) / "reference_logits.npy"
    if job.get("save", True):
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tmodel.state_dict().items()}, str(weights))
    agreement = {}
    if mode == "compiled":
        compile_blocks(tmodel)
    with torch.inference_mode():
        logits = tmodel(input_ids=torch.tensor(_agreement_ids(), device=device)).logits.float().cpu().numpy()
    if job.get("save", True):
        np.save(reference, logits)
    elif reference.exists():  # the same weights as the first torch side: the same function, or a bug
        key = f"{job['model']} {impl}"
        agreement[key] = rel_l2(logits, np.load(reference))
        print(f"{job['model']:>6} {impl}: logits vs the first torch side's, rel. L2 {agreement[key]:.2e}", flush=True)
    compile_s = {}
    if mode == "compiled":  # the first call at each shape compiles (or recompiles): timed apart
        for batch, length in job["shapes"]:
            first = forward_fns(tmodel, {}, batch, length, device, torch_name=impl)[impl]
            started = time.perf_counter()
            first()
            compile_s[(batch, length)] = time.perf_counter() - started
    rows = compare_forward(
        tmodel, {}, config, job["shapes"], device, job["model"], job["budget_s"], print, torch_name=impl
    )
    for r in rows:
        if mode == "compiled":
            r["compile_s"] = compile_s[(r["batch"], r["length"])]
        r.pop("speedup_vs_torch", None)
    import transformers

    info = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return {"rows": rows, "machine": info, "agreement": agreement}


def _mlx_side(job: dict) -> dict:
    device = job["device"]
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    dtype = getattr(mx, job["dtype"])
    name, config = job["model"], config_for(job["model"])
    saved = Path(job["dir"]) / "weights.safetensors"
    if saved.exists():  # the torch side's weights
        weights = {k: v.astype(dtype) for k, v in mx.load(str(saved)).items()}
    else:
        rng = np.random.default_rng(0)
        shapes_ = dict(tree_flatten(ESMC(config).parameters()))
        weights = {
            k: mx.array(rng.standard_normal(v.shape, dtype=np.float32) * v.shape[-1] ** -0.5).astype(dtype)
            for k, v in shapes_.items()
        }
    base_variant = default_variant(device)
    models_ = {v: mlx_model(config, weights, *VARIANTS[v]) for v in (job["variants"] or [base_variant])}
    out = {"rows": [], "agreement": {}, "quantized": []}
    reference = Path(job["dir"]) / "reference_logits.npy"
    if reference.exists():
        ids = mx.array(_agreement_ids())
        for v, m in models_.items():
            out["agreement"][f"{name} {v}"] = rel_l2(np.array(m(ids).logits.astype(mx.float32)), np.load(reference))
            print(f"{name:>6} {v}: logits vs torch, rel. L2 {out['agreement'][f'{name} {v}']:.2e}", flush=True)
    out["rows"] = compare_forward(None, models_, config, job["shapes"], "cpu", name, job["budget_s"], print)
    floats = [r for r in out["rows"] if r["impl"] == base_variant]  # every timing of the float model
    for q in job["quant"]:
        flags = VARIANTS[base_variant]
        twin = {
            base_variant: models_.get(base_variant) or mlx_model(config, weights, *flags),
            q: mlx_model(config, weights, *flags, QUANT_MODES[q]),
        }
        rows = compare_forward(None, twin, config, job["shapes"], "cpu", name, job["budget_s"], print)
        floats += [r for r in rows if r["impl"] == base_variant]
        bf = {(r["batch"], r["length"]): r["median_ms"] for r in rows if r["impl"] == base_variant}
        for r in rows:
            if r["impl"] == q:
                r["vs_float"] = r["median_ms"] / bf[(r["batch"], r["length"])]
                out["quantized"].append(r)
                print(
                    f"{name:>6} {r['batch']:>3}x{r['length']:<5} {q} time / float time = {r['vs_float']:.2f}",
                    flush=True,
                )
    ranges = float_ranges(floats)
    for r in out["quantized"]:
        r["float_ms_range"] = list(ranges[(r["batch"], r["length"])])
    for (batch, length), (lo, hi) in ranges.items():
        if hi > FLOAT_SPREAD * lo:
            print(
                f"{name:>6} {batch:>3}x{length:<5} note: the float model took {lo:.2f} to {hi:.2f} ms in this run, so the "
                "ratios at this shape move with the host's speed (a host-bound shape: docs/benchmarks.md, 'Noise')",
                flush=True,
            )
    return out


# The float model's medians at one shape, across the sections of one run, beyond which bench
# says that the shape's ratios move with the machine: on the H200 the 6B's bf16 forward at B=1
# ran 13-14.5 or 17-21 ms by the host's CPU state within one process, where the GPU-bound
# quantized twins held still; two bf16 copies timed interleaved agreed within 6%.
FLOAT_SPREAD = 1.15


def float_ranges(rows: list[dict]) -> dict[tuple[int, int], tuple[float, float]]:
    """(batch, length) -> (lowest, highest) median ms of the rows timed at that shape."""
    ranges: dict[tuple[int, int], tuple[float, float]] = {}
    for r in rows:
        key, ms = (r["batch"], r["length"]), r["median_ms"]
        lo, hi = ranges.get(key, (ms, ms))
        ranges[key] = (min(lo, ms), max(hi, ms))
    return ranges


def _agreement_ids(length: int = 64) -> np.ndarray:
    return np.random.default_rng(1).integers(4, 24, size=(1, length))


if __name__ == "__main__":  # one side of `run`: python -m esmc_mlx.bench {torch|mlx} JOB.json
    _kind, _job_path = sys.argv[1], Path(sys.argv[2])
    _job = json.loads(_job_path.read_text())
    _result = (_torch_side if _kind == "torch" else _mlx_side)(_job)
    _job_path.with_name(_job_path.name.replace("-job.json", ".json")).write_text(json.dumps(_result, default=str))
