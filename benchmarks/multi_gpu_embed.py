"""`esmc-mlx embed` on one GPU and on two under `mlx.launch`: sequences per second,
the ratio, and whether the two outputs agree.

    python -m benchmarks.multi_gpu_embed --json OUT.json            # 2-GPU host, NCCL
    python -m benchmarks.multi_gpu_embed --backend ring --device cpu --shape tiny --sequences 200

Writes into --workdir (default: a temporary folder): a FASTA of --sequences random proteins
(lengths 50-500, fixed seed), a random --shape artifact (bf16 on a GPU, made with mx.random:
no torch, no conversion), then runs, each in its own process:
  load  python -c "load(MODEL)" (model load alone, to tell load from throughput)
  one   esmc-mlx embed MODEL in.fasta -o one
  two   mlx.launch --backend BACKEND --hosts 127.0.0.1 -n 2 -- esmc-mlx embed MODEL in.fasta -o two
Throughput is sequences / (wall - load wall): both runs load the model once per process (the
two ranks load concurrently).

Before the timed runs, one untimed ``esmc-mlx embed`` of the same FASTA compiles MLX's kernels
into their cache (``--no-warmup`` skips it). Without it the first timed run pays the compiles and
the ranks, run second, find them cached, which flatters the ranks (docs/decisions.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from esmc_mlx.tasks.store import read_embeddings
from esmc_mlx.testing import SHAPES, child_env, tiny_config, write_random_artifact

NCCL_HELP = (
    "NCCL did not start. MLX's nccl backend loads libnccl.so.2: install it (pip install "
    "nvidia-nccl-cu13, or torch's CUDA wheels bring it under site-packages/nvidia/nccl/lib) and "
    "put its folder on LD_LIBRARY_PATH; check that both GPUs are visible (nvidia-smi)."
)


def write_fasta(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    alphabet = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    with open(path, "w") as f:
        for i in range(n):
            f.write(f">p{i}\n{''.join(rng.choice(alphabet, size=int(rng.integers(50, 501))))}\n")


def nccl_library_dirs() -> list[str]:
    """Folders holding libnccl.so.2 in this environment's nvidia wheels (torch's CUDA wheels)."""
    found = []
    for entry in sys.path:
        lib = Path(entry) / "nvidia" / "nccl" / "lib"
        if (lib / "libnccl.so.2").exists():
            found.append(str(lib))
    return found


def launcher() -> list[str]:
    script = Path(sys.executable).with_name("mlx.launch")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def run(command: list[str], env: dict, label: str) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        text = done.stdout + done.stderr
        print(f"{label} failed (exit {done.returncode}):\n{text[-4000:]}", file=sys.stderr)
        if "nccl" in text.lower() or "nccl" in " ".join(command):
            print(NCCL_HELP, file=sys.stderr)
        sys.exit(1)
    print(f"{label}: {wall:.1f} s  {done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ''}", flush=True)
    return wall, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=20_000)
    parser.add_argument("--shape", choices=["tiny", *SHAPES], default="300M")
    parser.add_argument("--model", help="an existing artifact instead of a random one")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="of the random artifact")
    parser.add_argument("--backend", default="nccl", help="mlx.launch backend: nccl (GPUs) or ring")
    parser.add_argument("-n", type=int, default=2, help="ranks")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="more embed options, written --extra=--batch-tokens=8192 (a bare --batch-tokens is read as this script's)",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--no-warmup", action="store_true", help="time a machine's first run, compiles included")
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="multi_gpu_embed-"))
    work.mkdir(parents=True, exist_ok=True)
    fasta = work / "in.fasta"
    if not fasta.exists():
        write_fasta(fasta, args.sequences)
    model = Path(args.model) if args.model else work / f"random-{args.shape}-{args.dtype}"
    if not args.model and not (model / "config.json").exists():
        config = tiny_config(num_hidden_layers=6) if args.shape == "tiny" else SHAPES[args.shape]
        write_random_artifact(model, config, getattr(mx, args.dtype))

    env = child_env()
    if args.backend == "nccl":
        extra = [d for d in nccl_library_dirs() if d not in env.get("LD_LIBRARY_PATH", "")]
        if extra:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(extra + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
            print(f"LD_LIBRARY_PATH += {os.pathsep.join(extra)} (libnccl.so.2 from the nvidia wheels)")

    # the esmc-mlx command, on the device asked for (MLX has no environment variable for it)
    device = f"import mlx.core as mx; mx.set_default_device(mx.{args.device}); "
    cli = [sys.executable, "-c", device + "import sys; from esmc_mlx.cli import main; sys.argv[0] = 'esmc-mlx'; main()"]
    cli += ["embed", str(model), str(fasta), "--no-progress", "--force"]
    load_code = (
        "import time; t = time.perf_counter(); " + device + "from esmc_mlx import load; "
        f"m, _ = load({str(model)!r}); mx.eval(m.parameters()); print(f'load {{time.perf_counter() - t:.2f}} s')"
    )
    if not args.no_warmup:
        run([*cli, "-o", str(work / "warmup"), *args.extra], env, "warm-up (untimed)")
    load_wall, _ = run([sys.executable, "-c", load_code], env, "load")
    one_wall, _ = run([*cli, "-o", str(work / "one"), *args.extra], env, "1 process")
    two_command = [*launcher(), "--backend", args.backend, "--hosts", "127.0.0.1", "-n", str(args.n)]
    two_wall, out = run([*two_command, "--", *cli, "-o", str(work / "two"), *args.extra], env, f"{args.n} ranks")
    if f"on {args.n} ranks" not in out:
        sys.exit(f"the launched job did not run on {args.n} ranks:\n{out}")

    one, two = read_embeddings(work / "one"), read_embeddings(work / "two")
    same_ids = one.ids == two.ids
    diff = np.abs(one.mean - two.mean)
    rel = np.linalg.norm(one.mean - two.mean, axis=1) / np.linalg.norm(one.mean, axis=1)
    n = args.sequences if not args.model else len(one.ids)
    result = {
        "sequences": n,
        "shape": None if args.model else args.shape,
        "dtype": args.dtype,
        "backend": args.backend,
        "ranks": args.n,
        "warmup": not args.no_warmup,
        "load_wall_s": load_wall,
        "one_wall_s": one_wall,
        "two_wall_s": two_wall,
        "one_seq_per_s": n / max(one_wall - load_wall, 1e-9),
        "two_seq_per_s": n / max(two_wall - load_wall, 1e-9),
        "one_seq_per_s_with_load": n / one_wall,
        "two_seq_per_s_with_load": n / two_wall,
        "same_ids": same_ids,
        "identical": bool(same_ids and np.array_equal(one.mean, two.mean)),
        "max_abs_diff": float(diff.max()),
        "max_row_rel_diff": float(rel.max()),
        # the tolerance of tests/test_distributed.py before ranks ran one process's batches
        "within_test_tolerance": bool(same_ids and np.allclose(two.mean, one.mean, rtol=1e-5, atol=1e-5)),
    }
    result["ratio"] = result["two_seq_per_s"] / result["one_seq_per_s"]
    result["ratio_with_load"] = result["two_seq_per_s_with_load"] / result["one_seq_per_s_with_load"]
    print(
        f"1 process {result['one_seq_per_s']:.1f} seq/s, {args.n} ranks {result['two_seq_per_s']:.1f} seq/s: "
        f"{result['ratio']:.2f}x ({result['ratio_with_load']:.2f}x counting the load of {load_wall:.1f} s); "
        f"outputs identical: {result['identical']} (max |diff| {result['max_abs_diff']:.3g}, "
        f"max row relative {result['max_row_rel_diff']:.3g})"
    )
    save_json(args.json, result, device=args.device)


if __name__ == "__main__":
    main()
