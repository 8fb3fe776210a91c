"""`esmc-mlx features` against `esmc-mlx embed --layers N` on the same FASTA, each in its own
process, and the memory the SAE adds.

    python -m benchmarks.features_speed                                   # CPU: esmc-tiny, random SAE
    python -m benchmarks.features_speed --shape 6B --codebook 16384 --k 64 --layer 60 \\
        --sequences 2000 --workdir /tmp/fs --json features_speed_6b.json   # GPU: a 6B-shaped random model

The parent writes the inputs once into --workdir (a random-weight artifact of the shape, bf16;
``tiny`` is the packaged trained esmc-tiny in float32; a random float32 SAE with one layer; a
FASTA of --sequences random proteins of --min-length..--max-length residues), then runs each
side --repeat times, alternating, each run in a fresh process that loads the model (and the SAE),
runs the job (``embed_fasta`` with layers=[N] / ``features_job`` at layer N, the default batch
size of the device) and reports its wall time and MLX's peak memory above the weights. Printed:
features time / embed time (the median of each side), the SAE layer's size, and the features
run's peak above the embed run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from benchmarks import save_json
from esmc_mlx.resolve import LOCAL_ALIASES
from esmc_mlx.runtime.sae import ENCODE_BYTES
from esmc_mlx.testing import SHAPES, random_sequences, write_random_artifact, write_random_sae

MB = 2**20
# shape -> (codebook, k, layer): the 6B's is the published SAE's shape (codebook 6.4x d_model);
# tiny's keeps about that expansion (8x its 256) at a similar depth (4 of 6 blocks; 60 of 80)
DEFAULTS = {
    "tiny": (2048, 16, 4),
    "300M": (16384, 64, 22),
    "600M": (16384, 64, 27),
    "6B": (16384, 64, 60),
}


def prepare(args) -> tuple[Path, Path, Path]:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="features-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.shape == "tiny":
        model = LOCAL_ALIASES["tiny"]
    else:
        model = work / f"model-{args.shape}"
        if not (model / "config.json").exists():
            write_random_artifact(model, SHAPES[args.shape], mx.bfloat16)
    d = 256 if args.shape == "tiny" else SHAPES[args.shape].hidden_size
    sae = work / f"sae-{args.codebook}-k{args.k}-layer{args.layer}"
    if not (sae / "config.json").exists():
        write_random_sae(sae, d, args.codebook, args.k, [args.layer])
    fasta = work / f"proteins-{args.sequences}.fasta"
    if not fasta.exists():
        seqs = random_sequences(args.sequences, args.min_length, args.max_length, seed=1)
        fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(seqs)))
    return model, sae, fasta


def child(side: str, model_dir: str, sae_dir: str, fasta: str, layer: int, out: str) -> dict:
    from esmc_mlx import load, load_sae
    from esmc_mlx.tasks.features import features_job
    from esmc_mlx.tasks.jobs import embed_fasta

    model = load(model_dir)[0]
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    sae = load_sae(sae_dir) if side == "features" else None
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    if side == "embed":
        done = embed_fasta(model, fasta, out, layers=[layer], force=True)
    else:
        done = features_job(model, sae, out, fasta=fasta, layers=[layer], force=True, plot=False)
    seconds = time.perf_counter() - start
    return {
        "side": side,
        "seconds": seconds,
        "sequences": done.computed,
        "weights_mb": weights / MB,
        "peak_above_weights_mb": (mx.get_peak_memory() - weights) / MB,
        "sae_layer_mb": sae.layer(layer).nbytes / MB if sae else 0.0,
        "device": str(mx.default_device()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(DEFAULTS), default="tiny")
    parser.add_argument("--codebook", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--layer", type=int)
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--min-length", type=int, default=30)
    parser.add_argument("--max-length", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--workdir", help="where the inputs and outputs go (kept: a rerun reuses the inputs)")
    parser.add_argument("--json", help="write the runs and the ratio here")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, model, sae, fasta, layer, out = args.child
        print("ROW " + json.dumps(child(side, model, sae, fasta, int(layer), out)), flush=True)
        return
    codebook, k, layer = DEFAULTS[args.shape]
    args.codebook, args.k, args.layer = args.codebook or codebook, args.k or k, args.layer or layer
    model, sae, fasta = prepare(args)
    mx.clear_cache()  # the buffers that drew the random model: the children need the GPU's memory
    rows = []
    for run in range(args.repeat):
        for side in ("embed", "features"):
            out = fasta.parent / f"out-{side}"
            command = [sys.executable, "-m", "benchmarks.features_speed", "--child", side, str(model), str(sae)]
            done = subprocess.run([*command, str(fasta), str(args.layer), str(out)], capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if done.returncode or not lines:
                sys.exit(f"{side} failed:\n{done.stdout}\n{done.stderr}")
            row = json.loads(lines[-1][4:])
            rows.append(row)
            print(
                f"run {run + 1} {side:8s} {row['seconds']:8.2f} s, peak above weights {row['peak_above_weights_mb']:.0f} MiB"
            )
    median = {s: statistics.median(r["seconds"] for r in rows if r["side"] == s) for s in ("embed", "features")}
    peak = {s: max(r["peak_above_weights_mb"] for r in rows if r["side"] == s) for s in ("embed", "features")}
    layer_mb = next(r["sae_layer_mb"] for r in rows if r["side"] == "features")
    result = {
        "shape": args.shape,
        "codebook": args.codebook,
        "k": args.k,
        "layer": args.layer,
        "sequences": args.sequences,
        "lengths": [args.min_length, args.max_length],
        "device": rows[0]["device"],
        "runs": rows,
        "features_over_embed": median["features"] / median["embed"],
        "sae_layer_mb": layer_mb,
        "features_peak_above_embed_mb": peak["features"] - peak["embed"],
        "bound_mb": layer_mb + ENCODE_BYTES / MB,
    }
    print(
        f"{args.shape}, SAE codebook {args.codebook} k {args.k} at layer {args.layer}, {args.sequences} sequences, "
        f"{result['device']}: features / embed time = {result['features_over_embed']:.3f} "
        f"(medians {median['features']:.2f} s / {median['embed']:.2f} s)"
    )
    print(
        f"SAE layer {layer_mb:.1f} MiB; features' peak above embed's {result['features_peak_above_embed_mb']:.1f} MiB "
        f"(bound: the layer + {ENCODE_BYTES / MB:.0f} MiB of pre-activations = {result['bound_mb']:.1f} MiB)"
    )
    save_json(args.json, result)


if __name__ == "__main__":
    main()
