"""Which figures of a benchmark moved between two runs by more than the runs' own noise.

    python -m benchmarks.compare NEW.json OLD.json       # e.g. a fresh run against docs/bench/...
    python -m benchmarks.compare --stamp                 # write SOURCE_COMMIT (for a copy without git)

Reads any benchmark's JSON (``esmc-mlx bench``'s, ``benchmarks.finetune_speed``'s, and the
others'): every timing, rate and memory figure in it, found by name (``*_ms``, ``*_s``,
``*_gb``, ``*_mb``, ``*_per_s``, ``seconds``), rows of a list matched by what names them (model,
shape, implementation, mode ...). A figure timed several times carries its run's spread: the
distance from its best repeat to its median, as a share of the median (``min_ms`` beside
``median_ms``, or the repeats themselves, ``times_ms`` / ``times_s``). A figure moved when

    |new / old - 1|  >  max(NOISE_K x the larger spread of the two runs, NOISE_FLOOR)

and it is reported as worse or better by its direction (times and memory: lower is better; rates:
higher). Figures in one run only are listed as missing or new. Exit status 1 when a figure got
worse, else 0. The two runs' provenance (commit, device) is printed; figures of different
devices are compared but said to be.

``--stamp`` writes the source commit (``HASH`` or ``HASH+dirty``) to SOURCE_COMMIT at the
checkout's root, for a copy of the tree that travels without git (a GPU host): benchmarks run
from that copy record it (``esmc_mlx.bench.provenance``). SOURCE_COMMIT is git-ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

# A change counts only past NOISE_K times the larger of the two runs' spreads, and never below
# NOISE_FLOOR. The spread is (median - best) / median: 0.5-2% for a GPU-bound forward timed 3-20
# times, 10-20% for a host-bound one (the 6B's bf16 forward at 1x256 ran 13-21 ms within one
# run). Two copies of one model timed interleaved agreed within 6%; runs on two machines of a
# kind differ more, hence the floor of 5% for a figure timed once (memory, a single wall time).
NOISE_K = 3.0
NOISE_FLOOR = 0.05

# Keys that describe a run rather than measure it; their numbers are never figures. A compile
# time and a memory limit are not compared either: the first is timed once and moves with the
# compiler's disk cache, the second is a setting.
NOT_FIGURES = {"machine", "provenance", "job", "env", "host", "command", "commands", "agreement", "device_info"}
NOT_FIGURES |= {"compile_s", "memory_limit_gb"}
# The settings of a run's "job" that make its figures another measurement's.
JOB_KEYS = ("model", "shape", "dtype", "rank", "device", "qlora", "accumulate", "memory_limit")
# Older records' names for what newer ones call otherwise.
RENAMED = {"torch_peft": "torch"}
# Integer fields of a row that count repeats rather than name the row.
COUNTS = {"reps", "steps", "timed_steps", "warmup", "exit", "runs", "sequences_done"}
UNITS = {"_per_s": "/s", "_ms": "ms", "_s": "s", "_gb": "GB", "_mb": "MB"}  # first match wins


@dataclasses.dataclass
class Figure:
    value: float
    spread: float | None  # (median - best) / median of the run's repeats; None: measured once
    unit: str
    higher_is_better: bool = False


def _unit(key: str) -> str | None:
    if key == "seconds":
        return "s"
    for suffix, unit in UNITS.items():
        if key.endswith(suffix):
            return unit
    return None


def _spread(median: float, best: float | None) -> float | None:
    return None if best is None or median <= 0 else max(0.0, (median - best) / median)


def _row_name(row: dict) -> str:
    """What names a row of a list: its text, flags and integer fields (not its counts)."""
    parts = []
    for k, v in row.items():
        if k in COUNTS or k in NOT_FIGURES or _unit(k) or isinstance(v, (float, dict, list)):
            continue
        if isinstance(v, (str, bool, int)):  # None: not set, as a row that lacks the field
            parts.append(f"{k}={v}")
    return " ".join(parts) or "row"


def figures(record, path: str = "") -> dict[str, Figure]:
    """Every figure of a benchmark's JSON, by a name that places it ("forward[model=300M batch=1
    length=256 impl=torch] median_ms")."""
    found: dict[str, Figure] = {}
    if isinstance(record, list):
        seen: dict[str, int] = {}
        for item in record:
            if not isinstance(item, dict):
                continue
            name = _row_name(item)
            seen[name] = seen.get(name, 0) + 1
            label = name if seen[name] == 1 else f"{name} #{seen[name]}"
            found |= figures(item, f"{path}[{label}]")
        return found
    if not isinstance(record, dict):
        return found
    for key, value in record.items():
        here = f"{path} {RENAMED.get(key, key)}".strip()
        if key in NOT_FIGURES:
            continue
        if isinstance(value, (dict, list)):
            if not key.startswith("times_"):
                found |= figures(value, here)
            continue
        unit = _unit(key)
        if unit is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith(("min_", "max_", "mean_")) and f"median_{key.split('_', 1)[1]}" in record:
            continue  # the spread of the median beside it
        best = None
        if key.startswith("median_"):
            rest = key.split("_", 1)[1]
            samples = record.get(f"times_{rest}")
            best = min(samples) if isinstance(samples, list) and samples else record.get(f"min_{rest}")
        found[here] = Figure(float(value), _spread(float(value), best), unit, unit == "/s")
    return found


def moved(new: Figure, old: Figure) -> float | None:
    """new / old - 1 when it is past the runs' noise (``NOISE_K``, ``NOISE_FLOOR``), else None."""
    if old.value == 0:
        return None
    change = new.value / old.value - 1
    spreads = [s for s in (new.spread, old.spread) if s is not None]
    noise = max(NOISE_K * max(spreads, default=0.0), NOISE_FLOOR)
    return change if abs(change) > noise else None


@dataclasses.dataclass
class Comparison:
    worse: list[tuple[str, Figure, Figure, float]]
    better: list[tuple[str, Figure, Figure, float]]
    steady: list[str]
    missing: list[str]  # in the old run only
    new: list[str]  # in the new run only


def compare(new_record: dict, old_record: dict) -> Comparison:
    new, old = figures(new_record), figures(old_record)
    result = Comparison([], [], [], sorted(set(old) - set(new)), sorted(set(new) - set(old)))
    for name in sorted(set(new) & set(old)):
        change = moved(new[name], old[name])
        if change is None:
            result.steady.append(name)
            continue
        got_worse = (change < 0) if new[name].higher_is_better else (change > 0)
        (result.worse if got_worse else result.better).append((name, new[name], old[name], change))
    return result


def describe(record: dict) -> str:
    """The run's commit and device, from its provenance (or what an older record holds)."""
    p = record.get("provenance") or {}
    commit = p.get("commit")
    commit = (commit[:10] + ("+dirty" if p.get("dirty") else "")) if commit else "commit not recorded"
    machine = record.get("machine") or {}
    device = p.get("device") or machine.get("gpu") or (machine.get("device_info") or {}).get("device_name")
    return f"{commit}, {device or 'device not recorded'}"


def _line(name: str, new: Figure, old: Figure, change: float) -> str:
    spread = "/".join("-" if s is None else f"{s:.1%}" for s in (new.spread, old.spread))
    return f"  {name}: {old.value:.4g} -> {new.value:.4g} {new.unit} ({change:+.1%}; spreads new/old {spread})"


def report(result: Comparison, new_record: dict, old_record: dict) -> list[str]:
    lines = [f"new: {describe(new_record)}", f"old: {describe(old_record)}"]
    devices = [(r.get("provenance") or {}).get("device") for r in (new_record, old_record)]
    if all(devices) and devices[0] != devices[1]:
        lines.append(f"note: different devices ({devices[0]} / {devices[1]}): a move may be the machine's")
    jobs = [r.get("job") for r in (new_record, old_record)]
    if all(isinstance(j, dict) for j in jobs):
        differ = [k for k in JOB_KEYS if jobs[0].get(k) != jobs[1].get(k)]
        if differ:
            lines.append(
                "note: the runs measured different jobs: "
                + ", ".join(f"{k} {jobs[0].get(k)} / {jobs[1].get(k)}" for k in differ)
            )
    lines.append(
        f"a figure moved when |new/old - 1| > max({NOISE_K:g} x the larger spread, {NOISE_FLOOR:.0%}); "
        f"{len(result.steady)} within noise"
    )
    for title, rows in (("worse", result.worse), ("better", result.better)):
        if rows:
            lines.append(f"{title}:")
            lines += [_line(*row) for row in rows]
    for title, names in (("missing from the new run", result.missing), ("only in the new run", result.new)):
        if names:
            lines.append(f"{title}:")
            lines += [f"  {name}" for name in names]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("new", nargs="?", type=Path, help="the new run's JSON")
    p.add_argument("old", nargs="?", type=Path, help="the recorded run's JSON")
    p.add_argument("--stamp", action="store_true", help="write SOURCE_COMMIT at the checkout's root and exit")
    args = p.parse_args(argv)
    if args.stamp:
        from esmc_mlx.bench import ROOT, SOURCE_STAMP, source_stamp

        stamp = source_stamp()
        if stamp is None:
            p.error("no git checkout here to stamp")
        (ROOT / SOURCE_STAMP).write_text(stamp + "\n")
        print(f"{ROOT / SOURCE_STAMP}: {stamp}")
        return 0
    if args.new is None or args.old is None:
        p.error("give NEW.json and OLD.json (or --stamp)")
    new_record, old_record = (json.loads(path.read_text()) for path in (args.new, args.old))
    result = compare(new_record, old_record)
    print("\n".join(report(result, new_record, old_record)))
    return 1 if result.worse else 0


if __name__ == "__main__":
    sys.exit(main())
