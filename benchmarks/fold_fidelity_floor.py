"""How far two correct float32 folds of one ESMFold2 lie apart: transformers' fold of the same
random weights under the same draws, on two torch devices (fp32, TF32 off: validation's
reference), compared with validation's own ``fold_fidelity``. The distance sets the scale under
which ``FOLD_FIDELITY["float32"]`` cannot go: no implementation agrees with the reference more
closely than the reference agrees with itself. A third fold with TF32 on shows what a precision
leak looks like.

    python -m benchmarks.fold_fidelity_floor --out OUT                      # GPU host: published sizes, CUDA vs CPU
    python -m benchmarks.fold_fidelity_floor --shape tiny --devices cpu,cpu --out OUT

Random weights at the published sizes (``fold_speed.torch_fold_model``, ESMFold2-Fast shape) in
float32, the bundled fold panel, the config's steps and loops, one sample. The folds on the first
device record the draws; the second device replays them. Writes ``OUT/fold_fidelity_floor.json``
(each comparison's figures per protein, as the validation report writes them), rewritten after
each protein of the slow device so that a run stopped at its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.fold_speed import code_identity, fold_config, import_transformers, torch_fold_model


def summary(fidelity: dict) -> dict:
    """``fold_fidelity``'s figures without the per-residue arrays."""
    out = {k: v for k, v in fidelity.items() if k != "per_input"}
    out["per_input"] = {n: {k: v for k, v in r.items() if k != "per_residue"} for n, r in fidelity["per_input"].items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["published", "tiny"], default="published")
    p.add_argument("--devices", default="cuda,cpu", help="the recording device, then the replaying one")
    p.add_argument("--out", type=Path, default=Path("bench-results/fold"))
    args = p.parse_args()
    import_transformers()
    import torch

    from esmc_mlx.tasks.fold.features import protein_features
    from esmc_mlx.validate.fold import _torch_outputs
    from esmc_mlx.validate.fold_reference import reference_fold
    from esmc_mlx.validate.metrics import fold_fidelity
    from esmc_mlx.validate.panel import build_fold_panel
    from esmc_mlx.validate.reference import pick_device

    first, second = (pick_device(name) for name in args.devices.split(","))  # validation's: TF32 off on CUDA
    torch.set_num_threads(os.cpu_count() or 1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fold_fidelity_floor.json"
    results = {"shape": args.shape, "devices": [first.type, second.type], "code": code_identity(), "seconds": {}}
    start = time.perf_counter()
    model = torch_fold_model(fold_config("fast", args.shape), first).float()
    results["seconds"]["build"] = time.perf_counter() - start
    panel = build_fold_panel(None, None)
    features = sorted(  # shortest first: a run stopped early has the most proteins
        [(p.name, protein_features(list(p.chains))) for p in panel.proteins],
        key=lambda x: x[1]["token_index"].shape[-1],
    )
    run = dict(samples=1, steps=None, loops=None)
    boundaries = model.confidence_head.boundaries.float().cpu().numpy()

    def folds(names, draws=None):
        out, drawn = [], []
        for i, (name, f) in enumerate(names):
            t = time.perf_counter()
            o, d = reference_fold(model, f, draws=None if draws is None else draws[i], **run)
            out.append(_torch_outputs(o))
            drawn.append(d)
            print(f"{next(model.parameters()).device} {name}: {time.perf_counter() - t:.1f} s", flush=True)
        return out, drawn

    reference, drawn = folds(features)
    if first.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32, _ = folds(features, drawn)
        torch.backends.cuda.matmul.allow_tf32 = False
        results["tf32_vs_fp32"] = summary(fold_fidelity(features, tf32, reference, boundaries))
    model = model.to(second)
    other = []
    for i, (name, f) in enumerate(features):
        other += folds([(name, f)], [drawn[i]])[0]
        done = features[: len(other)]
        results["floor"] = summary(fold_fidelity(done, other, reference[: len(other)], boundaries))
        path.write_text(json.dumps(results, indent=1, default=float) + "\n")
    worst = {k: v for k, v in results["floor"].items() if k not in ("per_input", "bin_flips")}
    print(
        f"{second.type} against {first.type}, worst over {len(other)} proteins: "
        + ", ".join(f"{k} {v:.2g}" for k, v in worst.items())
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
