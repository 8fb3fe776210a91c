"""Measure fidelity and quality of every precision on one trained checkpoint: the numbers behind
the QUALITY table of thresholds.py (docs/validation.md shows the last run).

    python -m esmc_mlx.validate.calibrate [--source tiny] [--json out.json] [--quick]

Converts the source to each dtype and quantization spec, runs the panel through each artifact
(MLX) and through torch on its dequantized weights (fidelity), and compares each with the
original (quality), the original's torch run being computed once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ..convert import convert
from . import mlx_side
from . import reference as torch_ref
from .core import compare_weights
from .metrics import fidelity, quality
from .panel import build_panel
from .thresholds import QUALITY_COLUMNS
from .weights import ArtifactWeights, SourceWeights, names_for

SPECS = [
    ("bfloat16", None),
    ("float16", None),
    (None, "8"),
    (None, "mxfp8"),
    (None, "6"),
    (None, "5"),
    (None, "4"),
    (None, "mxfp4"),
    (None, "nvfp4"),
    (None, "3"),
    (None, "2"),
    (None, "mixed_4_6"),
    (None, "mixed_3_6"),
    (None, "mixed_2_6"),
]


def calibrate(source: str = "tiny", quick: bool = False, specs=SPECS) -> dict:
    src = SourceWeights(source)
    panel = build_panel(max_length=256 if quick else None, marginal_positions=8 if quick else 24)
    batches = panel.batches()
    n = len(panel.inputs)
    original = torch_ref.run_full(src.get_many, src.config, batches, n, names_for(src.config, ""))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, q in specs:
            label = q or dtype
            started = time.perf_counter()
            out = convert(source, Path(tmp) / label, dtype=dtype, q=q, progress=False)
            art = ArtifactWeights(out)
            mine = mlx_side.run_full(art, batches, n, mx.float32)
            same_weights = torch_ref.run_full(art.get_many, art.config, batches, n, names_for(art.config, ""))
            fid = fidelity(panel, mine, same_weights)
            qual = quality(panel, mine, original)
            weights, _, _ = compare_weights(art, src, float("inf"))
            rows[label] = {
                "fidelity_logits": fid["logits_rel_l2"],
                "fidelity_hidden": fid["hidden_rel_l2"],
                "weights": weights.value,
                **{k: qual[k] for k in QUALITY_COLUMNS if k != "weights"},  # weights: the check above
                "seconds": round(time.perf_counter() - started, 1),
            }
            print(label, json.dumps(rows[label]), flush=True)
    return {"source": src.id, "panel": panel.describe(), "rows": rows}


def table(result: dict) -> str:
    cols = ["fidelity_logits", *QUALITY_COLUMNS]
    lines = ["| precision | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, row in result["rows"].items():
        lines.append(f"| {label} | " + " | ".join(f"{row[c]:.3g}" for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="tiny")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = calibrate(args.source, args.quick)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
