"""What validating a fold artifact costs next to converting it: ``esmc-convert SOURCE --q 4`` then
``esmc-mlx validate OUT``, each timed from outside, against the target validate <= 3x convert.

    python -m benchmarks.fold_validate_speed --device gpu --out OUT          # GPU host: ESMFold2-Fast shape
    python -m benchmarks.fold_validate_speed --shape tiny --device cpu --out OUT
    python -m benchmarks.fold_validate_speed --device gpu --dtype float32 --q none --out OUT  # MLX fp32 fidelity

SOURCE is a random ESMFold2 checkpoint written here first, as ``save_pretrained`` writes one:
an ESMC-6B backbone under transformers' ``EsmFold2Config`` defaults (``--model fast``: 24 folding
blocks, no MSA encoder; ``full``: 48 with it), every weight random (``fold_speed.torch_fold_model``,
built on the device), stored in ``--dtype`` but for the tensors transformers keeps in float32 in a
half-precision model (``fold_artifact.float32_in_transformers``), with ESMC's tokenizer files. Its
writing is timed apart. With ``--dtype float32 --q none`` the artifact is that checkpoint
unquantized, and the report's fidelity is MLX against transformers (TF32 off) on the weights that
``fold_fidelity_floor`` folds on CUDA and on the CPU (the same builder, seed and device): three
folds of one model side by side. Each step is a child process (``python -m esmc_mlx.cli``), wall
and CPU seconds and peak RSS from ``os.wait4``. Where ``validate`` does not take a fold artifact it
says so and no ratio is given. Writes ``OUT/fold_validate_speed.json``; everything else goes under
``--work`` (default: a temporary directory, deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.fold_speed import code_identity, fold_config, import_transformers, torch_fold_model
from benchmarks.validate_speed import child

TARGET_RATIO = 3.0  # validate / convert


def write_checkpoint(path: Path, raw: dict, dtype: str, device: str) -> dict:
    """The random checkpoint (config.json, model.safetensors shards, tokenizer files); its size."""
    import_transformers()
    import torch
    from transformers import EsmcTokenizer

    from esmc_mlx.fold_artifact import float32_in_transformers

    model = torch_fold_model(raw, device)
    target = getattr(torch, dtype)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if float32_in_transformers(name) else target)
    model.config.dtype = dtype
    model.save_pretrained(path)
    EsmcTokenizer().save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "bytes": sum(f.stat().st_size for f in path.iterdir())}


def validated(result: dict, report: Path) -> bool:
    """Whether validate ran its checks (passed or not): exit 0, or a report written."""
    return result["exit"] == 0 or (report / "report.json").exists()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["published", "tiny"], default="published")
    p.add_argument("--model", choices=["fast", "full"], default="fast")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the checkpoint's dtype")
    p.add_argument("--q", default="4", help="esmc-convert --q; none: convert without quantizing")
    p.add_argument(
        "--device", choices=["gpu", "cpu"], default="gpu", help="where the checkpoint is built and torch runs"
    )
    p.add_argument("--work", type=Path, help="scratch directory (default: a temporary one, deleted)")
    p.add_argument("--out", type=Path, default=Path("bench-results/fold"))
    p.add_argument("--write-checkpoint", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    raw = fold_config(args.model, args.shape)
    torch_device = "cuda" if args.device == "gpu" else "cpu"
    if args.write_checkpoint:  # the child that builds the checkpoint: its GPU memory goes with it
        info = write_checkpoint(args.write_checkpoint, raw, args.dtype, torch_device)
        (args.write_checkpoint.parent / "source.json").write_text(json.dumps(info))
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="fold-validate-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(work / "ptx"), ESMC_MLX_CACHE=str(work / "cache"))
    results: dict = {"shape": args.shape, "model": args.model, "dtype": args.dtype, "q": args.q,
                     "device": args.device, "code": code_identity(), "target_ratio": TARGET_RATIO}  # fmt: skip
    source, artifact, report = work / "source", work / "artifact", work / "report"
    try:
        shutil.rmtree(source, ignore_errors=True)
        start = time.perf_counter()
        command = [sys.executable, "-m", "benchmarks.fold_validate_speed", "--write-checkpoint", str(source),
                   "--shape", args.shape, "--model", args.model, "--dtype", args.dtype, "--device", args.device]  # fmt: skip
        subprocess.run(command, check=True, env=env)
        results["source"] = {**json.loads((work / "source.json").read_text()), "write_s": time.perf_counter() - start}
        print(f"random {args.model} checkpoint ({args.shape}, {args.dtype}): {results['source']}", flush=True)
        quantize = ["--q", args.q] if args.q != "none" else []
        convert = child(
            ["convert", str(source), "-o", str(artifact), *quantize, "--no-validate", "--force"],
            env,
            work / "c.log",
        )
        validate = child(
            ["validate", str(artifact), "--reference", str(source), "--reference-device", torch_device,
             "--report", str(report)],
            env,
            work / "v.log",
        )  # fmt: skip
        results["steps"] = {"convert": convert, "validate": validate}
        ran = validated(validate, report)  # before the work folder goes
        if report.joinpath("report.json").exists():
            results["report"] = json.loads(report.joinpath("report.json").read_text())
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if convert["exit"]:
        print(f"esmc-convert failed (exit {convert['exit']}): {convert.get('log_tail', '')[-800:]}")
    elif not ran:
        tail = validate.get("log_tail", "").strip().splitlines()
        results["skipped"] = f"esmc-mlx validate did not validate the fold artifact: {tail[-1] if tail else ''}"
        print(f"{results['skipped']} (exit {validate['exit']}); no validate / convert ratio")
    else:
        results["ratio"] = validate["wall_s"] / convert["wall_s"]
        results["within_target"] = results["ratio"] <= TARGET_RATIO
        print(
            f"convert {convert['wall_s']:.1f} s, validate {validate['wall_s']:.1f} s: validate / convert "
            f"{results['ratio']:.2f}x, target <= {TARGET_RATIO:.0f}x: "
            + ("within" if results["within_target"] else "OVER")
            + f"; validation {'passed' if validate['exit'] == 0 else 'FAILED (see the JSON report)'}"
        )
    path = args.out / "fold_validate_speed.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
