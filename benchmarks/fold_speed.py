"""ESMFold2 fold speed, the MLX fold against transformers' ``EsmFold2Model.fold``, and MLX's peak
memory of a fold.

    python -m benchmarks.fold_speed --out OUT             # GPU: ESMFold2-Fast at 256 and 512, ESMFold2 at 512
    python -m benchmarks.fold_speed --memory --out OUT    # GPU: MLX peak memory, 4-bit backbone, 512 and 1,024
    python -m benchmarks.fold_speed --shape tiny --lengths 16 --full-lengths 16 --device cpu --out OUT  # CPU

Random weights at the published sizes, built on the device without files: an ESMC-6B backbone
(hidden 2560, 40 heads, 80 blocks) under transformers' ``EsmFold2Config`` defaults, with 24
folding blocks and no MSA encoder (``fast``: ``biohub/ESMFold2-Fast``) or 48 blocks with the MSA
encoder (``full``: ``biohub/ESMFold2``, run on the single-sequence MSA as both implementations
fold without alignments). One sample, the config's steps (68 before the sigma cap: 48 denoising
steps) and loops (10), one random protein of each length (the same on both sides), features made
inside each timed fold.

Sides, each in its own process (one model build serves its lengths and models):

- ``mlx``: ``esmc_mlx.tasks.fold.fold`` on an ESMFold2 in bfloat16 (the tensors transformers keeps
  in float32 stay float32) over a bfloat16 backbone, prepared as ``load_fold`` prepares it. On the
  CPU in float32, as ``load_fold`` computes there (``--mlx-dtype`` overrides).
- ``mlx-affine4`` / ``mlx-mxfp4``: the same over a backbone whose block projections are quantized by
  the loader's own swap (affine 4-bit in groups of 64, or mxfp4), running the shipped kernels.
- ``torch-eager``: transformers' ``EsmFold2Model.fold`` with the folding model's weights in float32
  and the backbone's in bfloat16, the trunk, the denoiser and the confidence head under
  ``torch.autocast(bfloat16)`` (of the confidence head, its pair embedding and pair stack), the sampler's coordinates,
  rotations and alignment in float32: as
  FastPLMs runs ESMFold2 (its backbone "loaded in bf16", its folding model's float32 weights under
  bf16 autocast, the coordinates float32 as the reference keeps them).
- ``torch-compile``: the same with each repeated block compiled on its own (regional compilation,
  ``module.compile()``: every pair-update layer, ESMC block, diffusion layer and atom layer), static
  shapes; its first fold at a length holds the compilation, reported apart.

Each side folds once untimed (``--warmup``), then ``--reps`` timed folds; medians are reported, the
torch / MLX ratios side by side, and whether every fold's coordinates and pLDDT were finite.
``--stages`` adds one more MLX fold per length, each stage (features, trunk with the backbone,
conditioning, sampler, confidence) finished before the next: where the time and the memory go.
``--memory`` folds once per length on an MLX model with a quantized backbone and reports
``mx.get_peak_memory`` (weights included) against the targets: 12 GB at 512 residues (a 16 GB Mac
under MLX's default limit), 16 GB at 1,024. Each of those folds runs under an MLX memory limit of
its target, as on a machine that has no more: a fold evaluates its pairs a piece at a time where
the memory left is short (``runtime/fold/layers.piecewise``). Writes ``OUT/fold_speed.json`` or
``OUT/fold_memory.json`` with the machine, the card, the code's commit and digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
MEMORY_TARGETS_GB = {512: 12.0, 1024: 16.0}
MODELS = {  # the published checkpoints' shapes, over transformers' EsmFold2Config defaults
    "fast": {"folding_trunk_num_hidden_layers": 24, "msa_encoder": {"enabled": False}},
    "full": {"folding_trunk_num_hidden_layers": 48, "msa_encoder": {"enabled": True}},
}
TINY_MSA = dict(enabled=True, num_hidden_layers=2, hidden_size=16, outer_hidden_size=4, num_attention_heads=2,
                head_dim=8, intermediate_size=32)  # fmt: skip
SIDES = {  # name: (library, backbone quantization (MLX) or regional compilation (torch))
    "mlx": ("mlx", None),
    "mlx-affine4": ("mlx", "affine4"),
    "mlx-mxfp4": ("mlx", "mxfp4"),
    "torch-eager": ("torch", False),
    "torch-compile": ("torch", True),
}
DEFAULT_SIDES = ["mlx", "torch-eager", "mlx-affine4", "torch-compile"]


def fold_config(model: str, shape: str) -> dict:
    """transformers' spelling of the config (what both FoldConfig and EsmFold2Config read)."""
    from esmc_mlx.testing import SHAPES, tiny_fold_config

    if shape == "tiny":  # every part of the architecture, a few blocks each, on a 2-block ESMC
        if model == "fast":
            return tiny_fold_config()
        return tiny_fold_config(folding_trunk_num_hidden_layers=4, msa_encoder=TINY_MSA)
    return {"model_type": "esmfold2", "esmc_config": SHAPES["6B"].to_dict(), **MODELS[model]}


def protein(length: int) -> str:
    from esmc_mlx.testing import random_sequences

    return random_sequences(1, length, length, seed=length)[0]


def code_identity() -> dict:
    """The source commit (``esmc_mlx.bench.source_stamp``: git, or SOURCE_COMMIT in a copy without
    git) and a digest of the code that ran."""
    from esmc_mlx.bench import source_stamp

    digest = hashlib.sha256()
    for f in sorted([*(ROOT / "esmc_mlx").rglob("*.py"), Path(__file__)]):
        digest.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return {"commit": source_stamp(ROOT), "digest": digest.hexdigest()[:16]}


def timed_folds(fold_once, warmup: int, reps: int) -> dict:
    """``fold_once() -> finite`` run ``warmup`` times, then ``reps`` times timed."""
    first, finite = [], True
    for _ in range(warmup):
        start = time.perf_counter()
        finite &= fold_once()
        first.append(time.perf_counter() - start)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        finite &= fold_once()
        times.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(times) if times else None,
        "times_s": times,
        "first_s": first[0] if first else None,
        "finite": bool(finite),
    }


def emit(path: Path, row: dict) -> None:
    """One finished measurement, appended as it lands: a side killed later keeps what it measured."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# --- MLX --------------------------------------------------------------------------------------
def mlx_device(device: str):
    import mlx.core as mx

    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    info = {"mlx": mx.__version__, "device": str(mx.default_device())}
    try:
        info["card"] = str(mx.device_info().get("device_name", ""))
    except Exception:  # an MLX that does not describe its device
        pass
    return info


def mlx_models(job: dict, quant: str | None):
    """(model name -> MLX ESMFold2, weights bytes), the backbone built once and shared."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from esmc_mlx.bench import QUANT_MODES
    from esmc_mlx.fold_config import FoldConfig
    from esmc_mlx.tasks.fold import FoldingModel
    from esmc_mlx.testing import init_random_fold_, random_mlx_fold_model

    dtype = getattr(mx, job["mlx_dtype"])
    models, esmc = {}, None
    for name in job["models"]:
        config = FoldConfig.from_dict(fold_config(name, job["shape"]))
        if esmc is None:
            models[name] = random_mlx_fold_model(config, dtype, QUANT_MODES.get(quant), model_class=FoldingModel)
            esmc = models[name].esmc
        else:
            models[name] = FoldingModel(config, esmc)
            init_random_fold_(models[name], dtype, seed=1)
            models[name].eval()
    sizes = {
        name: sum(v.nbytes for _, v in tree_flatten(m.parameters()))
        + sum(v.nbytes for _, v in tree_flatten(m.esmc.parameters()))
        for name, m in models.items()
    }
    return models, sizes


def mlx_side(job: dict, quant: str | None, rows: Path) -> None:
    import mlx.core as mx

    info = {**mlx_device(job["device"]), "dtype": job["mlx_dtype"], "backbone": quant or job["mlx_dtype"]}
    print(f"[{job['side']}] {info}", flush=True)
    start = time.perf_counter()
    models, sizes = mlx_models(job, quant)
    print(f"[{job['side']}] built {', '.join(models)} in {time.perf_counter() - start:.1f} s", flush=True)
    for name, length in job["jobs"]:
        model, sequence = models[name], protein(length)

        def fold_once(model=model, sequence=sequence) -> bool:
            out = model.fold(sequence, samples=job["samples"], steps=job["steps"], loops=job["loops"], seed=0)
            return bool(np.isfinite(out.coords).all() and np.isfinite(out.plddt).all())

        mx.clear_cache()
        mx.reset_peak_memory()
        row = timed_folds(fold_once, job["warmup"], job["reps"])
        row.update(info, side=job["side"], model=name, length=length, weights_gb=sizes[name] / GB)
        row["peak_gb"] = mx.get_peak_memory() / GB
        if job.get("stages"):
            stages = {}
            model.fold(sequence, samples=job["samples"], steps=job["steps"], loops=job["loops"], seed=0, stages=stages)
            row["stages"] = {k: {"seconds": v["seconds"], "peak_gb": v["peak_bytes"] / GB} for k, v in stages.items()}
        emit(rows, row)
        print(f"[{job['side']}] {name} {length}: {describe(row)}", flush=True)
        if "stages" in row:
            parts = (f"{k} {v['seconds'] * 1e3:.0f} ms ({v['peak_gb']:.1f} GB)" for k, v in row["stages"].items())
            print(f"[{job['side']}] {name} {length}, one more fold by stage: " + ", ".join(parts), flush=True)


def memory_side(job: dict, rows: Path) -> None:
    """One fold per length on an MLX model with a quantized backbone: the peak, weights included."""
    import mlx.core as mx

    info = mlx_device(job["device"])
    models, sizes = mlx_models(job, job["quant"])
    for name, length in job["jobs"]:
        model, target = models[name], MEMORY_TARGETS_GB.get(length)
        mx.clear_cache()
        mx.reset_peak_memory()
        previous = mx.set_memory_limit(int(target * GB)) if target else None
        start = time.perf_counter()
        try:
            out = model.fold(protein(length), samples=job["samples"], steps=job["steps"], loops=job["loops"], seed=0)
        finally:
            if previous is not None:
                mx.set_memory_limit(previous)
        seconds = time.perf_counter() - start
        row = {
            **info,
            "side": f"mlx-{job['quant']}",
            "model": name,
            "length": length,
            "peak_gb": mx.get_peak_memory() / GB,
            "weights_gb": sizes[name] / GB,
            "seconds": seconds,
            "finite": bool(np.isfinite(out.coords).all() and np.isfinite(out.plddt).all()),
            "target_gb": target,
            "memory_limit_gb": target,
        }
        emit(rows, row)
        print(
            f"[memory] {name} {length}, {job['quant']} backbone: peak {row['peak_gb']:.2f} GB "
            f"(weights {row['weights_gb']:.2f} GB), {seconds:.1f} s" + ("" if row["finite"] else ", NOT FINITE"),
            flush=True,
        )


# --- torch ------------------------------------------------------------------------------------
def import_transformers() -> str | None:
    """Import transformers; where its import-time version check refuses the host's
    huggingface_hub or tokenizers (a newer transformers carried onto an older image), import it
    without that check and say so (returned), as the modules used here may well run."""
    try:
        import transformers  # noqa: F401

        return None
    except ImportError as e:
        if "is required for a normal functioning of this module" not in str(e):
            raise
        note = f"transformers' dependency check skipped: {str(e).splitlines()[0]}"
    import types

    for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
        del sys.modules[name]
    sys.modules["transformers.dependency_versions_check"] = types.ModuleType("transformers.dependency_versions_check")
    import transformers  # noqa: F401

    return note


def torch_fold_model(raw: dict, device: str, seed: int = 0, backbone=None):
    """transformers' EsmFold2Model built on ``device``: the backbone in bfloat16 (a 6B is never 24
    GB of float32 anywhere), the folding model in float32, every weight random as
    ``esmc_mlx.testing.random_transformers_fold_model`` draws it. ``backbone``: an ESMC module to
    share (its own is then dropped, never filled)."""
    import torch
    from transformers import EsmFold2Config, EsmFold2Model

    from esmc_mlx.testing import init_random_

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = EsmFold2Model(EsmFold2Config.from_dict(raw)).eval()
    finally:
        torch.set_default_dtype(previous)
    for name, child in model.named_children():
        if name != "esmc":
            child.float()
    if backbone is not None:
        model.esmc = backbone
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if backbone is None or not name.startswith("esmc."):
                init_random_(name, p, generator)
        for name, b in model.named_buffers():
            if name.endswith(("frequencies", "phases")):
                b.normal_(0.0, 1.0, generator=generator)
    return model


def compile_regions(model) -> int:
    """``module.compile()`` on each repeated block: the pair-update layers (the MSA encoder's
    included), the ESMC blocks, the diffusion and atom layers. Returns how many."""
    from transformers.models.esmfold2 import modeling_esmfold2 as m

    blocks = (m.EsmFold2PairUpdateLayer, m.EsmFold2DiffusionLayer, m.EsmFold2AtomLayer)
    regions = [module for module in model.modules() if isinstance(module, blocks)] + list(model.esmc.layers)
    for module in regions:
        module.compile()
    return len(regions)


def autocast_regions(model, device: str) -> None:
    """The trunk, the denoiser and the confidence head's pair embedding and pair stack under bf16
    autocast (FastPLMs' regions; the embedding takes the trunk's bf16 single states); the sampler
    between them (noise, rotations, Kabsch, the step) and the rest of the confidence head keep
    float32 (transformers' head scatters float32 sums of its pLDDT)."""
    import torch

    regions = [(model, "forward"), (model.structure_head, "prepare_conditioning"),
               (model.structure_head, "forward"), (model.confidence_head.input_embedder, "forward"),
               (model.confidence_head.folding_trunk, "forward")]  # fmt: skip
    for owner, name in regions:
        original = getattr(owner, name)

        def under_autocast(*args, _original=original, **kwargs):
            with torch.autocast(device, dtype=torch.bfloat16):
                return _original(*args, **kwargs)

        setattr(owner, name, under_autocast)  # an instance attribute: module calls go through it


def torch_side(job: dict, compiled: bool, rows: Path) -> None:
    note = import_transformers()
    import torch

    from esmc_mlx.tasks.fold import protein_features

    device = "cuda" if job["device"] == "gpu" and torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device}
    if device == "cuda":
        info["card"] = torch.cuda.get_device_name()
    if note:
        info["note"] = note
    print(f"[{job['side']}] {info}", flush=True)
    if compiled:
        # one static graph per length (no dynamic-shape kernels); every block's and length's entry kept
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.accumulated_recompile_limit = 4096
    start = time.perf_counter()
    models, backbone = {}, None
    for name in job["models"]:
        models[name] = torch_fold_model(fold_config(name, job["shape"]), device, backbone=backbone)
        backbone = models[name].esmc
        if compiled:
            info["compiled_regions"] = compile_regions(models[name])
        autocast_regions(models[name], device)
    if device == "cuda":
        torch.cuda.empty_cache()
    print(f"[{job['side']}] built {', '.join(models)} in {time.perf_counter() - start:.1f} s", flush=True)
    for name, length in job["jobs"]:
        model, sequence = models[name], protein(length)

        def fold_once(model=model, sequence=sequence) -> bool:
            features = protein_features([sequence])
            inputs = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in features.items()}
            torch.manual_seed(0)
            with torch.inference_mode():
                out = model.fold(
                    **inputs,
                    num_diffusion_samples=job["samples"],
                    num_sampling_steps=job["steps"],
                    num_loops=job["loops"],
                )
            coords, plddt = out.sample_atom_coords.float().cpu(), out.plddt.float().cpu()  # waits for the GPU
            return bool(torch.isfinite(coords).all() and torch.isfinite(plddt).all())

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row = timed_folds(fold_once, job["warmup"], job["reps"])
        row.update(info, side=job["side"], model=name, length=length)
        if device == "cuda":
            row["peak_gb"] = torch.cuda.max_memory_allocated() / GB
        emit(rows, row)
        print(f"[{job['side']}] {name} {length}: {describe(row)}", flush=True)


# --- the parent -------------------------------------------------------------------------------
def describe(row: dict) -> str:
    text = f"median {row['median_s']:.3f} s of {len(row['times_s'])}" if row["median_s"] is not None else "untimed"
    if row.get("first_s") is not None:
        text += f", first fold {row['first_s']:.2f} s"
    if row.get("peak_gb") is not None:
        text += f", peak {row['peak_gb']:.2f} GB"
    return text + ("" if row["finite"] else ", NOT FINITE (NaN or inf in coordinates or pLDDT)")


def run_side(side: str, job: dict, out: Path, timeout: float | None) -> list[dict]:
    """One side in a fresh interpreter; the rows it finished (all of them unless it failed)."""
    from esmc_mlx.testing import child_env

    rows = out / f"{side}.jsonl"
    rows.unlink(missing_ok=True)
    job_path = out / f"{side}-job.json"
    job_path.write_text(json.dumps({**job, "side": side}))
    command = [sys.executable, "-u", "-m", "benchmarks.fold_speed", "--child", side, str(job_path), str(rows)]
    try:
        done = subprocess.run(command, env=child_env(), timeout=timeout)
        failure = f"exit {done.returncode}" if done.returncode else None
    except subprocess.TimeoutExpired:
        failure = f"stopped after {timeout:.0f} s (--side-timeout)"
    if failure:
        print(f"[{side}] {failure}; keeping the rows it finished", flush=True)
    found = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []
    return found + ([{"side": side, "failed": failure}] if failure else [])


def fold_steps(job: dict) -> dict:
    """The sampler's denoising steps and the trunk's loops each model runs (what the config gives)."""
    from esmc_mlx.fold_config import FoldConfig
    from esmc_mlx.tasks.fold import noise_schedule

    out = {}
    for name in job["models"]:
        config = FoldConfig.from_dict(fold_config(name, job["shape"]))
        schedule, _ = noise_schedule(config.structure_head, job["steps"])
        out[name] = {"steps": len(schedule) - 1, "loops": config.num_loops if job["loops"] is None else job["loops"]}
    return out


def dry_run(job: dict) -> dict:
    """What each side would build, counted without a weight made: MLX's modules hold lazy arrays
    (shapes, never evaluated), transformers' are built on the meta device. Returns parameter
    counts and the bytes a side holds (bf16, and the backbone's blocks in 4 bits)."""
    from mlx.utils import tree_flatten

    from esmc_mlx.bench import QUANT_MODES
    from esmc_mlx.fold_config import FoldConfig
    from esmc_mlx.quantize import BLOCK_LINEAR
    from esmc_mlx.runtime.fold.model import ESMFold2
    from esmc_mlx.runtime.model import ESMC
    from esmc_mlx.runtime.quantized import quantize_modules

    out = {}
    for name in job["models"]:
        raw = fold_config(name, job["shape"])
        config = FoldConfig.from_dict(raw)
        esmc = ESMC(config.esmc_config, lm_head=False)
        folding = ESMFold2(config, esmc)
        backbone = dict(tree_flatten(esmc.parameters()))
        head = dict(tree_flatten(folding.parameters()))
        row = {
            "backbone_params": sum(v.size for v in backbone.values()),
            "folding_params": sum(v.size for v in head.values()),
        }
        row["bf16_gb"] = 2 * (row["backbone_params"] + row["folding_params"]) / GB
        quant = job["quant"] if job["quant"] in QUANT_MODES else "affine4"
        quantize_modules(esmc, QUANT_MODES[quant], lambda path: bool(BLOCK_LINEAR.fullmatch(path)))
        row[f"{quant}_backbone_gb"] = sum(v.nbytes for _, v in tree_flatten(esmc.parameters())) / GB
        try:
            import_transformers()
            import torch
            from transformers import EsmFold2Config, EsmFold2Model

            with torch.device("meta"):
                reference = EsmFold2Model(EsmFold2Config.from_dict(raw))
            names = [n for n, _ in reference.named_parameters()]
            row["transformers_params"] = sum(p.numel() for p in reference.parameters())
            row["transformers_backbone_params"] = sum(
                p.numel() for n, p in reference.named_parameters() if n.startswith("esmc.")
            )
            row["transformers_names"] = len(names)
        except ImportError as e:
            row["transformers_params"] = f"not counted: {e}"
        out[name] = row
        print(f"{name}: {row}", flush=True)
    return out


def table(rows: list[dict], sides: list[str]) -> list[str]:
    """Seconds per fold of each side and torch / MLX, one line per (model, length)."""
    timed = {(r["model"], r["length"], r["side"]): r for r in rows if r.get("median_s") is not None}
    keys = list(dict.fromkeys((r["model"], r["length"]) for r in rows if "model" in r))
    mlx = [s for s in sides if s.startswith("mlx")]
    torch = [s for s in sides if s.startswith("torch")]
    ratios = [(t, "mlx") for t in torch if "mlx" in mlx] + [(q, "mlx") for q in mlx if q != "mlx"]
    head = f"{'model':<6} {'L':>5} " + " ".join(f"{s:>14}" for s in sides)
    head += "  " + " ".join(f"{a + ' / ' + b:>26}" for a, b in ratios)
    lines = [head]
    for model, length in keys:
        line = f"{model:<6} {length:>5} "
        cells = []
        for side in sides:
            r = timed.get((model, length, side))
            cell = "-" if r is None else f"{r['median_s']:.3f} s" + ("" if r["finite"] else " NaN")
            cells.append(f"{cell:>14}")
        line += " ".join(cells) + "  "
        for a, b in ratios:
            ra, rb = timed.get((model, length, a)), timed.get((model, length, b))
            ratio = f"{ra['median_s'] / rb['median_s']:.2f}x" if ra and rb else "-"
            line += f"{ratio:>26} "
        lines.append(line.rstrip())
    for r in rows:
        if r.get("side") == "torch-compile" and r.get("first_s") is not None and r.get("median_s") is not None:
            lines.append(
                f"torch-compile {r['model']} {r['length']}: first fold {r['first_s']:.1f} s, of which about "
                f"{r['first_s'] - r['median_s']:.1f} s compiling"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["published", "tiny"], default="published", help="published: the 6B sizes")
    p.add_argument("--lengths", type=int, nargs="*", default=[256, 512], help="residues folded by the fast model")
    p.add_argument("--full-lengths", type=int, nargs="*", default=[512], help="residues folded by the full model")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="the schedule's length (default the config's)")
    p.add_argument("--loops", type=int, default=None, help="trunk recycling loops (default the config's)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", choices=["gpu", "cpu"], default=None, help="default: the GPU where MLX has one")
    p.add_argument(
        "--mlx-dtype",
        choices=["bfloat16", "float32", "float16"],
        default=None,
        help="the MLX fold's dtype (default bfloat16 on a GPU, float32 on the CPU, as load_fold)",
    )
    p.add_argument(
        "--stages",
        action="store_true",
        help="MLX sides: one more fold per length, each stage finished before the next: its seconds and peak",
    )
    p.add_argument("--side-timeout", type=float, default=None, metavar="S", help="stop a side after S seconds")
    p.add_argument("--memory", action="store_true", help="MLX peak memory of one fold per length instead")
    p.add_argument("--memory-lengths", type=int, nargs="*", default=[512, 1024])
    p.add_argument(
        "--quant", default="affine4", help="--memory's backbone quantization (of esmc_mlx.bench.QUANT_MODES)"
    )
    p.add_argument("--dry-run", action="store_true", help="count the models' parameters and bytes; fold nothing")
    p.add_argument("--out", type=Path, default=Path("bench-results/fold"))
    p.add_argument("--child", nargs=3, metavar=("SIDE", "JOB", "ROWS"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        side, job_path, rows = args.child
        job = json.loads(Path(job_path).read_text())
        if side == "memory":
            memory_side(job, Path(rows))
            return
        library, variant = SIDES[side]
        (mlx_side if library == "mlx" else torch_side)(job, variant, Path(rows))
        return

    import mlx.core as mx

    device = args.device or ("gpu" if mx.is_available(mx.gpu) else "cpu")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        p.error(f"--sides: {', '.join(unknown)} unknown; choose of {', '.join(SIDES)}")
    if args.memory:
        jobs = [["fast", n] for n in args.memory_lengths]
    else:
        jobs = [["fast", n] for n in args.lengths] + [["full", n] for n in args.full_lengths]
    job = {
        "shape": args.shape,
        "device": device,
        "models": list(dict.fromkeys(name for name, _ in jobs)),
        "jobs": jobs,
        "samples": args.samples,
        "steps": args.steps,
        "loops": args.loops,
        "warmup": args.warmup,
        "reps": args.reps,
        "quant": args.quant,
        "mlx_dtype": args.mlx_dtype or ("bfloat16" if device == "gpu" else "float32"),
        "stages": args.stages,
    }
    if args.dry_run:
        dry_run(job)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"job": job, "code": code_identity(), "fold": fold_steps(job), "python": sys.version.split()[0]}
    print(
        f"ESMFold2, {args.shape} sizes, {args.samples} sample(s), {device}; {results['fold']}; code {results['code']}"
    )
    if args.memory:
        results["rows"] = run_side("memory", job, args.out, args.side_timeout)
        for r in results["rows"]:
            if r.get("target_gb"):
                r["within_target"] = r["peak_gb"] <= r["target_gb"]
                print(
                    f"{r['model']} {r['length']}: peak {r['peak_gb']:.2f} GB, target {r['target_gb']:.0f} GB: "
                    + ("within" if r["within_target"] else "OVER")
                )
        path = args.out / "fold_memory.json"
    else:
        results["rows"] = [row for side in sides for row in run_side(side, job, args.out, args.side_timeout)]
        cards = {r["side"]: r.get("card") for r in results["rows"] if r.get("card")}
        print("cards: " + (", ".join(f"{s} on {c}" for s, c in cards.items()) or "none named (CPU)"))
        lines = table(results["rows"], sides)
        print("\n".join(lines))
        results["table"] = lines
        path = args.out / "fold_speed.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
