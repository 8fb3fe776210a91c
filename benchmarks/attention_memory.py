"""Peak memory of `esmc-mlx attention` on a long protein, against one layer's maps and against the
plain forward of the same protein, each in its own process.

    python -m benchmarks.attention_memory                          # 300M-shaped, 2,000 residues, CPU
    python -m benchmarks.attention_memory --shape 6B --residues 4000 --layers 1,40,80 --json out.json

Each side builds a random float32 model of the shape in memory (no disk), then resets the
process's peak resident set (``/proc/self/clear_refs``, Linux) and runs: ``forward`` one
``model(ids)`` of the protein; ``attention`` ``tasks.attention.attention_job`` writing every
--layers block's maps (all heads) and the contact map into a temporary folder. Printed: each
side's peak RSS above the model, and that of attention against one layer's maps
(4 x heads x (residues + 2)^2 bytes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from esmc_mlx.testing import SHAPES, random_mlx_model, random_sequences, tiny_config

MB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now, VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(side: str, shape: str, residues: int, layers: str | None) -> dict:
    from esmc_mlx.tasks.attention import attention_job

    config = tiny_config(num_hidden_layers=6) if shape == "tiny" else SHAPES[shape]
    model = random_mlx_model(config, mx.float32)
    mx.eval(model.parameters())
    mx.clear_cache()
    sequence = random_sequences(1, residues, residues, seed=7)[0]
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    base = _status("VmRSS")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        if side == "forward":
            ids = mx.array(model_ids(sequence))
            mx.eval(model(ids).logits)
        else:
            attention_job(model, out, sequence=sequence, layers=layers, plot=False)
        written = sum(p.stat().st_size for p in Path(out).iterdir())
    return {
        "side": side,
        "seconds": time.perf_counter() - start,
        "peak_above_model_mb": (_status("VmHWM") - base) / MB,
        "model_mb": base / MB,
        "written_mb": written / MB,
        "heads": config.num_attention_heads,
        "device": str(mx.default_device()),
    }


def model_ids(sequence: str) -> np.ndarray:
    from esmc_mlx.runtime.tokenizer import ESMCTokenizer

    return ESMCTokenizer()([sequence], return_tensors="np")["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["tiny", *SHAPES], default="300M")
    parser.add_argument("--residues", type=int, default=2000)
    parser.add_argument("--layers", help="blocks whose maps are written, e.g. 1,15,-1 (default: all)")
    parser.add_argument("--json", help="write both sides here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("ROW " + json.dumps(child(args.child, args.shape, args.residues, args.layers)), flush=True)
        return
    rows = {}
    for side in ("forward", "attention"):
        command = [sys.executable, "-m", "benchmarks.attention_memory", "--child", side, "--shape", args.shape]
        command += ["--residues", str(args.residues)] + (["--layers", args.layers] if args.layers else [])
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode or not lines:
            sys.exit(f"{side} failed:\n{done.stdout}\n{done.stderr}")
        rows[side] = json.loads(lines[-1][4:])
        r = rows[side]
        print(
            f"{side:9s} {r['seconds']:7.1f} s, peak RSS above the model {r['peak_above_model_mb']:7.0f} MiB "
            f"(model {r['model_mb']:.0f} MiB; wrote {r['written_mb']:.0f} MiB)"
        )
    one_layer = 4 * rows["attention"]["heads"] * (args.residues + 2) ** 2 / MB
    result = {
        "shape": args.shape,
        "residues": args.residues,
        "layers": args.layers or "all",
        "one_layer_maps_mb": one_layer,
        "attention_over_one_layer": rows["attention"]["peak_above_model_mb"] / one_layer,
        "forward_over_one_layer": rows["forward"]["peak_above_model_mb"] / one_layer,
        "sides": rows,
    }
    print(
        f"{args.shape}, {args.residues} residues: one layer's maps {one_layer:.0f} MiB; attention's peak above the "
        f"model = {result['attention_over_one_layer']:.2f} x that (the plain forward's: "
        f"{result['forward_over_one_layer']:.2f} x)"
    )
    save_json(args.json, result)


if __name__ == "__main__":
    main()
