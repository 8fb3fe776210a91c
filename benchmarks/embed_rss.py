"""Peak memory of `esmc-mlx embed` on a large generated FASTA (the FASTA is streamed).

    python -m benchmarks.embed_rss --records 200000 --out /tmp/rss [--model esmc_mlx/data/esmc-tiny]

Writes OUT/big.fasta (random sequences of 20..60 residues), runs the embed command under
/usr/bin/time -v and prints the FASTA size, wall time and peak resident set size.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def write_fasta(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    alphabet = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    with open(path, "w") as f:
        for start in range(0, n, 10_000):
            lines = []
            for i in range(start, min(n, start + 10_000)):
                seq = "".join(rng.choice(alphabet, size=int(rng.integers(20, 61))))
                lines.append(f">rec{i} generated\n{seq}\n")
            f.write("".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=str(Path(__file__).parents[1] / "esmc_mlx/data/esmc-tiny"))
    parser.add_argument("--extra", nargs="*", default=[], help="more embed options")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fasta = args.out / "big.fasta"
    if not fasta.exists():
        write_fasta(fasta, args.records)
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "esmc_mlx.cli",
        "embed",
        args.model,
        str(fasta),
        "-o",
        str(args.out / "emb"),
        "--force",
        "--no-progress",
        *args.extra,
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(done.stdout + done.stderr)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    print(done.stdout.strip())
    print(
        f"fasta: {fasta.stat().st_size / 2**20:.1f} MiB, {args.records} records; wall {wall:.0f} s; "
        f"peak RSS {rss / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
