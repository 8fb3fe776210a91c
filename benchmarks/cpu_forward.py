"""This CPU, one run: a 300M-shaped forward in MLX vs transformers, and a 300M conversion.

  1. Forward of a 300M-shaped ESMC (random weights, the same in both) at B x L = 1x256 and
     8x256: transformers fp32 (torch threads = cores) and the MLX runtime variants, timed
     interleaved; prints torch time / MLX time.
  2. Converting a 300M-shaped bf16 checkpoint (published layout) with ``esmc-convert`` in a
     child process: wall time and the child's peak RSS.

    python -m benchmarks.cpu_forward [--out bench-results/cpu] [--source /work/ckpts/300M]

Writes OUT/cpu_forward.json and OUT/cpu_forward.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from benchmarks import measure
from benchmarks.convert_memory import convert_timed
from esmc_mlx import bench
from esmc_mlx.runtime.model import ESMC


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-results/cpu"))
    p.add_argument(
        "--source",
        type=Path,
        default=Path("/work/ckpts/300M"),
        help="300M-shaped bf16 checkpoint (made with esmc_mlx.testing.write_random_checkpoint if absent)",
    )
    p.add_argument("--variants", nargs="+", default=list(bench.VARIANTS), choices=list(bench.VARIANTS))
    p.add_argument("--shapes", default="1x256,8x256")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timing per implementation and shape")
    p.add_argument("--skip-convert", action="store_true")
    p.add_argument(
        "--skip-forward", action="store_true", help="only the conversion (added to an existing OUT/cpu_forward.json)"
    )
    p.add_argument(
        "--memory-length",
        type=int,
        default=2048,
        help="also run B=1 at this length and report MLX peak memory (0: skip)",
    )
    args = p.parse_args()

    if args.skip_forward:
        results = json.loads((args.out / "cpu_forward.json").read_text())
    else:
        results = bench.run(
            models=["300M"],
            shapes=bench.parse_shapes(args.shapes),
            device="cpu",
            dtype="float32",
            variants=args.variants,
            out_dir=args.out,
            budget_s=args.budget,
            stem="cpu_forward",
        )
    if args.memory_length and not args.skip_forward:
        config = bench.config_for("300M")
        rng = np.random.default_rng(0)
        shapes = dict(tree_flatten(ESMC(config).parameters()))
        weights = {
            k: mx.array(rng.standard_normal(v.shape, dtype=np.float32) * v.shape[-1] ** -0.5) for k, v in shapes.items()
        }
        model = bench.mlx_model(config, weights)
        r = measure.forward_memory(model, None, args.memory_length, 1, 16, None)
        r["scores_bytes_per_layer"] = config.num_attention_heads * args.memory_length**2 * 4
        results["forward_memory"] = [r]
        print(
            f"300M 1x{args.memory_length} (16 padded) on the CPU: peak {r['mlx']['peak_extra_bytes'] / 2**30:.2f} GiB "
            f"above the weights, {r['mlx']['third_call_ms'] / 1e3:.1f} s",
            flush=True,
        )
        del model, weights
    if not args.skip_convert:
        with tempfile.TemporaryDirectory(dir=args.out) as tmp:
            source = args.source
            if not (source / "config.json").exists():
                from esmc_mlx.testing import SHAPES, write_random_checkpoint

                source = write_random_checkpoint(Path(tmp) / "src", SHAPES["300M"], "bfloat16")
            for label, extra in (("bfloat16", []), ("mxfp4", ["--q", "mxfp4"])):
                r = convert_timed(source, Path(tmp) / f"out-{label}", extra + ["--no-validate"])
                r["source"] = str(source)
                r["source_bytes"] = sum(f.stat().st_size for f in source.rglob("*") if f.is_file())
                results.setdefault("convert", {})[label] = r
                print(
                    f"convert 300M -> {label}: {r['wall_s']:.1f} s wall, peak RSS "
                    f"{(r['peak_rss_bytes'] or 0) / 2**30:.2f} GiB, output {r['output_bytes'] / 2**20:.0f} MiB",
                    flush=True,
                )
                shutil.rmtree(Path(tmp) / f"out-{label}", ignore_errors=True)
    for r in results.get("forward", []):
        if r["impl"] != "torch":
            print(f"300M {r['batch']}x{r['length']} {r['impl']}: torch/MLX = {r['speedup_vs_torch']:.2f}x")
    json_path, png = bench.write(results, args.out, "cpu_forward")
    print(f"wrote {json_path}" + (f", {png}" if png else ""))


if __name__ == "__main__":
    main()
