"""Cost of the converter's NaN/Inf check (docs/reliability.md, rule 5): convert one random checkpoint with
the check and without it, interleaved, and print the wall times.

    python -m benchmarks.finite_check --model 300M --dtype bfloat16 --work /tmp/finite --repeats 3

The checkpoint (random weights, the published layout) is written once into WORK and kept for
reruns; the outputs are deleted after each conversion. On a GPU machine MLX runs the check on
the default device, so the same command measures it there.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import esmc_mlx  # noqa: F401  (fast BLAS before mlx)
import esmc_mlx.convert as conversion
from esmc_mlx import testing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="300M", choices=sorted(testing.SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    source = args.work / f"src-{args.model}-{args.dtype}"
    if not (source / "config.json").exists():
        testing.write_random_checkpoint(source, testing.SHAPES[args.model], dtype=args.dtype, progress=True)
    real = conversion.check_finite
    times: dict[str, list[float]] = {"with check": [], "without check": []}
    for _ in range(args.repeats + 1):  # the first pass warms the page cache and is dropped
        for label, check in (("with check", real), ("without check", lambda *a: None)):
            conversion.check_finite = check
            out = args.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            conversion.convert(str(source), out, progress=False)
            times[label].append(time.perf_counter() - started)
            shutil.rmtree(out, ignore_errors=True)
    conversion.check_finite = real
    for label, values in times.items():
        kept = values[1:]
        print(f"{label:>14}: median {statistics.median(kept):.2f} s  ({', '.join(f'{v:.2f}' for v in kept)})")


if __name__ == "__main__":
    main()
