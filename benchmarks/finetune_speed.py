r"""LoRA training speed of esmc-mlx against torch + peft, and QLoRA memory on a 6B-shaped model.

  1. LoRA (default): rank R on every block projection (q, k, v, o, gate, up, down) of all
     blocks of a random-weight ESMC, a linear head on the mean-pooled final hidden state, AdamW,
     B x L batches. MLX runs esmc-mlx's own training step (``finetune.train.Updates``);
     torch runs transformers' ``EsmcForMaskedLM`` wrapped by peft's ``get_peft_model`` with the
     same rank, modules, head and batch. Each side in its own process, one after the other;
     prints training tokens per second of each and MLX / torch. MLX's step is also timed up to
     the moment MLX has queued all of its work (``mx.async_eval`` returns): the host's share of
     the step; a step whose host share is close to its whole is bound by the host, not the GPU.
  2. QLoRA (``--qlora``): the same on an affine 4-bit model (built block by block: the bf16
     weights never exist whole) with gradient checkpointing (``--no-checkpointing``: without,
     as LoRA runs); prints tokens per second and MLX's peak memory (weights, adapters,
     optimizer, activations), under the memory limit that ``esmc-mlx finetune`` sets
     (``--memory-limit GB`` for another). The base goes through ``finetune.model.training_base``
     as ``esmc-mlx finetune``'s does: on the CPU dequantized once where memory allows
     (``--packed``: kept packed, MLX's quantized matmul in every step).

    python -m benchmarks.finetune_speed --model 300M --dtype bfloat16 --shape 16x256     # GPU, 1.
    python -m benchmarks.finetune_speed --qlora --model 6B --shape 4x1024                # GPU, 2.
    python -m benchmarks.finetune_speed --qlora --model 6B --shape 1x1024 --grad-accumulation-steps 4
    python -m benchmarks.finetune_speed --model 300M --dtype bfloat16 --shape 16x256 --memory-limit mlx --no-torch
    python -m benchmarks.finetune_speed --model tiny --dtype float32 --shape 4x64 --steps 3 --device cpu   # CPU
    python -m benchmarks.finetune_speed --device cpu --model small --dtype float32 --shape 4x128 --steps 3  # CPU LoRA
    python -m benchmarks.finetune_speed --device cpu --model small --dtype float32 --shape 4x128 --steps 3 --qlora \
        --no-checkpointing    # CPU QLoRA, the same batch (--packed: the base kept packed)

Writes OUT/finetune_speed.json (or finetune_qlora.json) with the source commit and the device
(``python -m benchmarks.compare NEW OLD`` says which figures moved). peft is only needed by the
torch side (the dev extra has it); without it that side is skipped with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import save_json

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batch_arrays(batch: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (<cls>, residues, <eos>) and class targets, the same on both sides."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 24, size=(batch, length), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 0, 2
    return ids, rng.integers(0, 2, size=batch, dtype=np.int64)


def time_steps(step, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


# --- MLX --------------------------------------------------------------------------------------
def quantized_model(config, bits: int, group_size: int, dtype):
    """An ESMC whose block projections are affine-quantized, drawn and quantized block by block."""
    import mlx.core as mx
    import mlx.nn as nn

    from esmc_mlx.runtime.model import ESMC
    from esmc_mlx.testing import init_random_mlx_

    model = ESMC(config)
    for i, layer in enumerate(model.esmc.layers):
        init_random_mlx_(layer, dtype, seed=i)
        nn.quantize(layer, group_size=group_size, bits=bits, class_predicate=lambda _, m: isinstance(m, nn.Linear))
        mx.eval(layer.parameters())
    for part in (model.esmc.embed_tokens, model.esmc.norm, model.lm_head):
        init_random_mlx_(part, dtype, seed=len(model.esmc.layers))
    return model


def mlx_side(job: dict) -> dict:
    import mlx.core as mx
    import mlx.optimizers as optim

    from esmc_mlx.bench import config_for
    from esmc_mlx.finetune import model as finetune_model
    from esmc_mlx.finetune.data import Labels
    from esmc_mlx.finetune.model import AdaptedModel, training_base
    from esmc_mlx.finetune.train import Updates, under_memory_limit
    from esmc_mlx.testing import random_mlx_model

    mx.set_default_device(mx.gpu if job["device"] == "gpu" else mx.cpu)
    config, dtype = config_for(job["model"]), getattr(mx, job["dtype"])
    if job["qlora"]:
        base = quantized_model(config, 4, 64, dtype)
    else:
        base = random_mlx_model(config, dtype)
    if job["packed"]:
        finetune_model.FLOAT_BASE_SHARE = 0.0  # QLoRA as it ran before the float base
    path = training_base(base)  # as esmc-mlx finetune readies its base
    model = AdaptedModel(base, Labels("classification", classes=["0", "1"]))
    model.add_lora(job["rank"], config.num_hidden_layers, 2.0)
    object.__setattr__(model, "gradient_checkpointing", job["qlora"] and not job["no_checkpointing"])
    model.train()
    optimizer = optim.AdamW(learning_rate=1e-4)
    step = Updates(model, optimizer, job["accumulate"])
    ids, targets = batch_arrays(job["batch"], job["length"])
    ids, targets = mx.array(ids.astype(np.int32)), mx.array(targets.astype(np.int32))
    attention = mx.ones(ids.shape, dtype=mx.int32)

    queued = []  # per update: seconds until MLX had queued all of its work

    def run():  # one AdamW update: --grad-accumulation-steps batches
        started = time.perf_counter()
        for _ in range(job["accumulate"]):
            loss, _ = step(ids, attention, targets)
            mx.async_eval(loss, step.state)
        queued.append(time.perf_counter() - started)
        mx.eval(loss, step.state)

    # as esmc-mlx finetune trains, unless --memory-limit mlx (MLX's own limit)
    limited = contextlib.nullcontext() if job["memory_limit"] == "mlx" else under_memory_limit(job["memory_limit"])
    with limited:
        mx.reset_peak_memory()  # the training's peak, not the block-by-block build's
        times = time_steps(run, job["steps"], job["warmup"])
        limit = mx.get_memory_limit()
    host = queued[job["warmup"] :]
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": [round(t, 6) for t in times],
        "host_median_s": statistics.median(host),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "cache_memory_gb": mx.get_cache_memory() / 1e9,
        "memory_limit_gb": limit / 1e9,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "base": path,
    }


# --- torch + peft -------------------------------------------------------------------------------
def torch_side(job: dict) -> dict:
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return {"skipped": "peft is not installed (pip install peft)"}
    from esmc_mlx.bench import config_for, sync_torch, torch_model

    device = "cuda" if job["device"] == "gpu" and torch.cuda.is_available() else "cpu"
    config = config_for(job["model"])
    model = torch_model(config, job["dtype"], device).train()
    lora = LoraConfig(r=job["rank"], lora_alpha=2 * job["rank"], lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = get_peft_model(model, lora)
    head = torch.nn.Linear(config.hidden_size, 2, device=device, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids, targets = (torch.tensor(a, device=device) for a in batch_arrays(job["batch"], job["length"]))
    attention = torch.ones_like(ids)
    encoder = model.base_model.model.esmc

    def run():
        hidden = encoder(input_ids=ids, attention_mask=attention).last_hidden_state.float()
        pooled = hidden[:, 1:-1].mean(dim=1)
        loss = torch.nn.functional.cross_entropy(head(pooled), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync_torch()

    times = time_steps(run, job["steps"], job["warmup"])
    out = {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": [round(t, 6) for t in times],
        "torch": torch.__version__,
        "device": device,
    }
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


SIDES = {"mlx": mlx_side, "torch": torch_side}


def run_side(kind: str, job: dict) -> dict:
    """One side in a fresh interpreter; its result read back from the JSON it writes."""
    job_path = Path(job["out"]) / f"finetune-{kind}-job.json"
    job_path.write_text(json.dumps(job))
    subprocess.run([sys.executable, "-m", "benchmarks.finetune_speed", "--side", kind, str(job_path)], check=True)
    return json.loads(job_path.with_name(f"finetune-{kind}.json").read_text())


def memory_limit(text: str) -> float | str:
    """--memory-limit: GB, or 'mlx' for MLX's own limit."""
    if text.strip().lower() == "mlx":
        return "mlx"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give GB (a number) or 'mlx'") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="300M", help="tiny, small, 300M, 600M or 6B (random weights of that shape)")
    p.add_argument("--shape", default="16x256", help="BATCHxLENGTH of a training step (tokens with <cls>/<eos>)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--qlora", action="store_true", help="affine 4-bit base, gradient checkpointing, MLX only")
    p.add_argument("--no-checkpointing", action="store_true", help="--qlora without gradient checkpointing")
    p.add_argument("--packed", action="store_true", help="--qlora with the base kept packed on the CPU too")
    p.add_argument(
        "--grad-accumulation-steps",
        dest="accumulate",
        type=int,
        default=1,
        help="batches averaged into one update (MLX only: a step is then that many batches)",
    )
    p.add_argument(
        "--memory-limit",
        type=memory_limit,
        metavar="GB",
        help="MLX's memory limit (mx.set_memory_limit): past it MLX waits for queued GPU work, and the "
        "buffers that work holds, before it queues more. Default: what esmc-mlx finetune sets (0.7 x the "
        "GPU's memory; on the CPU, MLX's own); 'mlx': MLX's own limit, none set",
    )
    p.add_argument("--no-torch", action="store_true", help="time MLX only")
    p.add_argument("--out", type=Path, default=Path("bench-results/finetune"))
    p.add_argument("--side", nargs=2, metavar=("KIND", "JOB"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        kind, job_path = args.side
        job = json.loads(Path(job_path).read_text())
        result = SIDES[kind](job)
        Path(job_path).with_name(f"finetune-{kind}.json").write_text(json.dumps(result, indent=2))
        return
    if args.accumulate > 1 and not args.qlora:
        p.error("--grad-accumulation-steps is for --qlora runs (the torch side does not accumulate)")
    batch, length = (int(n) for n in args.shape.lower().split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    job = dict(vars(args), out=str(args.out), batch=batch, length=length, side=None)
    tokens = batch * length * args.accumulate
    results = {"job": {k: v for k, v in job.items() if k != "side"}, "mlx": run_side("mlx", job)}
    mlx_tps = tokens / results["mlx"]["median_s"]
    results["mlx"]["tokens_per_s"] = mlx_tps
    qlora = f"affine4 QLoRA ({results['mlx']['base']} base){'' if args.no_checkpointing else ' + checkpointing'}"
    what = f"{args.model} {qlora if args.qlora else args.dtype + ' LoRA'} rank {args.rank}"
    per_update = f" x {args.accumulate} batches" if args.accumulate > 1 else ""
    print(f"{what}, {args.shape}{per_update} ({tokens} tokens a step), {args.device}")
    mlx = results["mlx"]
    print(f"  MLX   {mlx_tps:10.0f} tokens/s  ({mlx['median_s'] * 1e3:.1f} ms a step", end="")
    print(f", all of it queued after {mlx['host_median_s'] * 1e3:.1f} ms)", end="")
    print(f", peak memory {mlx['peak_memory_gb']:.2f} GB", end="")
    print(f" (memory limit {mlx['memory_limit_gb']:.1f} GB, cache {mlx['cache_memory_gb']:.2f} GB)")
    if not args.qlora and not args.no_torch:
        results["torch"] = run_side("torch", job)
        if "skipped" in results["torch"]:
            print(f"  torch side skipped: {results['torch']['skipped']}")
        else:
            torch_tps = tokens / results["torch"]["median_s"]
            results["torch"]["tokens_per_s"] = torch_tps
            results["mlx_over_torch"] = mlx_tps / torch_tps
            print(f"  torch {torch_tps:10.0f} tokens/s  ({results['torch']['median_s'] * 1e3:.1f} ms a step, peft)")
            print(f"  MLX / torch tokens per second: {results['mlx_over_torch']:.2f}")
    path = args.out / ("finetune_qlora.json" if args.qlora else "finetune_speed.json")
    save_json(path, results, device=args.device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
