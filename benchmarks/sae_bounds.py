"""The measurements behind ``thresholds.SAE_QUALITY``: a bf16 / fp16 / 8-bit SAE against the float32
SAE it was made from, on the validation panel through the packaged esmc-tiny.

    python -m benchmarks.sae_bounds [--json out.json]

Random float32 SAEs (codebook 1,024 k 32 and 4,096 k 64, plain and residual-update, layers 3
and 6) are written to a temporary folder, each stored with ``convert.sae.write_sae`` in every
spec and validated with ``validate.sae.validate_sae``; printed: the worst topk_agreement and
value_rel_err per precision over those SAEs and layers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from esmc_mlx import load, load_sae
from esmc_mlx.convert.sae import parse_sae_spec, write_sae
from esmc_mlx.testing import write_random_sae
from esmc_mlx.validate.sae import validate_sae

SHAPES = ((1024, 32), (4096, 64))
SPECS = {"bf16": "bfloat16", "fp16": "float16", "8": "8bit"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    model = load("tiny")[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for codebook, k in SHAPES:
            for residual in (False, True):
                source = Path(tmp) / f"sae-{codebook}-{residual}"
                write_random_sae(source, model.config.hidden_size, codebook, k, [3, 6], residual, seed=codebook)
                reference = load_sae(source)
                for spec, precision in SPECS.items():
                    out = Path(tmp) / f"{source.name}-{spec}"
                    out.mkdir()
                    write_sae(reference.config, reference.file, out, parse_sae_spec(spec))
                    report = validate_sae(load_sae(out), reference, model)
                    for c in report.checks:
                        row = {"precision": precision, "codebook": codebook, "k": k, "residual": residual}
                        rows.append(dict(row, check=c.name, layer=c.detail, value=c.value))
                        print(json.dumps(rows[-1]), flush=True)
    print("| precision | worst topk_agreement | worst value_rel_err |\n|---|---|---|")
    for precision in SPECS.values():
        mine = [r for r in rows if r["precision"] == precision]
        agree = min(r["value"] for r in mine if r["check"] == "topk_agreement")
        error = max(r["value"] for r in mine if r["check"] == "value_rel_err")
        print(f"| {precision} | {agree:.6f} | {error:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
