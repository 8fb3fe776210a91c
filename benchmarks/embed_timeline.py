"""Where one rank of `esmc-mlx embed` spends its time: one JSON line per rank (issue 16).

    python -m benchmarks.embed_timeline MODEL in.fasta OUT                       # one process
    mlx.launch --backend nccl --hosts 127.0.0.1 -n 2 -- \\
        python -m benchmarks.embed_timeline MODEL in.fasta OUT                   # two ranks
    T0=$(date +%s.%N) ...   # optional: "start" is then the launcher's share (seconds from T0)

Runs ``tasks.jobs.embed_fasta`` as the CLI does, with timers wrapped around the job's own steps
(the batch iterator's ``next``, the ranks' ``all_gather``, the part writes, the final merge):
this script is a probe, so it patches those functions in its own process only. ``--no-compile``
loads the model with ``compile=False``. A FASTA and a random model come from
``benchmarks.multi_gpu_embed`` (``--workdir`` keeps them).
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402  (the clock starts before the imports it measures)
import json  # noqa: E402
import os  # noqa: E402

import mlx.core as mx  # noqa: E402

from esmc_mlx import load  # noqa: E402
from esmc_mlx.tasks import distributed, jobs  # noqa: E402
from esmc_mlx.tasks.store import EmbeddingStore  # noqa: E402

IMPORTED = time.time()
SPENT: dict[str, float] = {"next": 0.0, "all_gather": 0.0, "write_part": 0.0, "merge": 0.0}
CALLS: dict[str, int] = dict.fromkeys(SPENT, 0)


def _timed(owner, name: str) -> None:
    """Replace ``owner.name`` by the same function adding its wall time to SPENT[name]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[name.strip("_")] += time.perf_counter() - t
            CALLS[name.strip("_")] += 1

    setattr(owner, name, wrapper)


def _timed_iterator(owner, name: str) -> None:
    """The same for a generator function: the time spent in each ``next`` of what it returns."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        items = inner(*args, **kwargs)
        while True:
            t = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                SPENT["next"] += time.perf_counter() - t
                CALLS["next"] += 1
            yield item

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("fasta")
    parser.add_argument("out")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    _timed(distributed.World, "_all_gather")
    _timed(EmbeddingStore, "write_part")
    _timed(EmbeddingStore, "merge")
    _timed_iterator(jobs, "iter_embeddings")

    world = distributed.World.current()
    joined = time.time()
    world.barrier()
    synced = time.time()
    model, _ = load(args.model, compile=not args.no_compile)
    mx.eval(model.parameters())
    loaded = time.time()
    jobs.embed_fasta(model, args.fasta, args.out, force=True, group=world)
    done = time.time()
    zero = float(os.environ.get("T0", STARTED))
    row = {
        "rank": world.rank,
        "ranks": world.size,
        "start": STARTED - zero,
        "imports": IMPORTED - STARTED,
        "distributed_init": joined - IMPORTED,
        "first_barrier": synced - joined,
        "load": loaded - synced,
        "job": done - loaded,
        "end": done - zero,
        **{f"{k}_s": v for k, v in SPENT.items()},
        **{f"{k}_calls": v for k, v in CALLS.items()},
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
