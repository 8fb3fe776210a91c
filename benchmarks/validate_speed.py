"""What validation costs next to the conversion it proves: wall and CPU seconds, peak RSS.

    python -m benchmarks.validate_speed                                # esmc-tiny --q 4, CPU
    python -m benchmarks.validate_speed --shape 6B --device gpu --json 6b.json   # H200 host

The load average before and after is recorded: on a machine shared with other jobs, torch's
OpenMP threads spin against them (measured: a 2-thread torch pass 7-14x slower than 1 thread at
load 8 on 2 cores); ``--env OMP_NUM_THREADS=1`` shows what the work itself costs there.

Every step is its own child process (``python -m esmc_mlx.cli ...``), timed from outside, its
peak RSS and CPU time read from ``os.wait4``; in one run:
  1. ``convert SOURCE --q Q --no-validate``: the conversion alone;
  2. ``convert SOURCE --q Q --validate`` with an empty reference cache: validation = 2 - 1;
  3. ``convert SOURCE --q Q2 --no-validate`` and 4. ``... --q Q2 --validate``, the cache now
     holding the original's outputs from step 2: the second precision's validation;
  5. ``validate OUT --quick`` (empty cache), alone;
  6. ``validate OUT --mode layered`` (empty cache), alone: its peak RSS.
SOURCE is the packaged, trained esmc-tiny (``--shape tiny``) or a random checkpoint of the
published shape written here first (``esmc_mlx.testing.write_random_checkpoint``, bf16; no Hub).
``--device gpu`` puts the torch reference on CUDA (``--reference-device cuda``); ``cpu`` on the
CPU. Everything is written under ``--work`` (default: a temporary directory, deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import save_json


def child(args: list[str], env: dict, log: Path) -> dict:
    """Run ``python -m esmc_mlx.cli ARGS``; wall seconds, CPU seconds, peak RSS, exit code."""
    cmd = [sys.executable, "-m", "esmc_mlx.cli", *args]
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    result = {
        "command": "esmc-mlx " + " ".join(args),
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_bytes": peak,
        "exit": proc.returncode,
    }
    if proc.returncode:
        result["log_tail"] = log.read_text()[-3000:]
    print(
        f"  {result['wall_s']:8.2f} s wall {result['cpu_s']:8.2f} s CPU {peak / 2**30:6.2f} GiB  "
        f"exit {proc.returncode}  {result['command']}",
        flush=True,
    )
    return result


def report_seconds(out: Path) -> dict:
    """What the report itself says about its run (timings per pass, cache hit, device, mode)."""
    path = out / "validation" / "report.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {
        "passed": data["passed"],
        "seconds": data["resources"]["seconds"],
        "timings": data["resources"]["timings"],
        "reference_mode": data["reference_mode"],
        "cache_hit": data.get("reference_cache", {}).get("hit"),
        "panel_tokens": data["panel"]["tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        default="tiny",
        choices=["tiny", "random-tiny", "300M", "600M", "6B"],
        help="tiny: the packaged trained esmc-tiny; the others: random weights of that shape "
        "(random-tiny: the test suite's 2-layer shape, a smoke test of this script)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"], help="where the torch reference runs")
    parser.add_argument("--q", help="first precision (default: 4 for tiny, mxfp4 otherwise)")
    parser.add_argument("--second-q", help="second precision (default: mxfp4 for tiny, 4 otherwise)")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one, deleted)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["quick", "layered", "second", "warmup"])
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in every child's environment (e.g. OMP_NUM_THREADS=1 on a shared machine)",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    q1 = args.q or ("4" if args.shape == "tiny" else "mxfp4")
    q2 = args.second_q or ("mxfp4" if args.shape == "tiny" else "4")
    work = args.work or Path(tempfile.mkdtemp(prefix="validate-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **dict(item.split("=", 1) for item in args.env))
    device = ["--reference-device", "cuda" if args.device == "gpu" else "cpu"]
    results: dict = {
        "shape": args.shape,
        "device": args.device,
        "q": q1,
        "second_q": q2,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "env": args.env,
        # every child compiles torch's sources when set and no .pyc exists (5.7 s a process on
        # an H200 host that sets it): a figure to read beside the times
        "python_bytecode_off": bool(env.get("PYTHONDONTWRITEBYTECODE")),
        "load_average_before": os.getloadavg(),
        "steps": {},
    }
    steps = results["steps"]
    try:
        if args.shape == "tiny":
            source = "tiny"
        else:
            import esmc_mlx  # noqa: F401
            from esmc_mlx.testing import SHAPES, tiny_config, write_random_checkpoint

            source = str(work / "source")
            t = time.perf_counter()
            config = tiny_config() if args.shape == "random-tiny" else SHAPES[args.shape]
            write_random_checkpoint(Path(source), config, dtype="bfloat16", progress=True)
            results["random_checkpoint_s"] = round(time.perf_counter() - t, 1)

        def cache(name: str) -> dict:  # a fresh, empty reference cache per name
            return dict(env, ESMC_MLX_CACHE=str(work / f"cache-{name}"))

        def convert(q: str, validate: bool, name: str, cache_name: str) -> dict:
            out = work / name
            shutil.rmtree(out, ignore_errors=True)
            r = child(
                [
                    "convert",
                    source,
                    "-o",
                    str(out),
                    "--q",
                    q,
                    "--force",
                    "--validate" if validate else "--no-validate",
                    *device,
                ],
                cache(cache_name),
                work / f"{name}.log",
            )
            r.update(report_seconds(out))
            return r

        print(f"esmc-{args.shape} --q {q1}, reference on {args.device}; work in {work}")
        # MLX compiles its CUDA kernels (and ours) at first use, once per machine (kept in
        # MLX_PTX_CACHE_DIR): compile them here, on a 2-layer model of each precision, so that
        # the timed steps measure validation and not a fresh machine's compiler. The warm-up's
        # own time is reported (what a brand-new machine pays once).
        env["MLX_PTX_CACHE_DIR"] = str(work / "ptx")
        if args.device == "gpu" and "warmup" not in args.skip:
            from esmc_mlx.testing import tiny_config, write_random_checkpoint

            small = work / "small-source"
            write_random_checkpoint(small, tiny_config(), dtype="bfloat16")
            for q in (q1, q2):
                steps[f"jit_warmup_{q}"] = child(
                    ["convert", str(small), "-o", str(work / f"small-{q}"), "--q", q, "--force", "--validate", *device],
                    cache("warmup"),
                    work / f"warmup-{q}.log",
                )
        steps["convert"] = convert(q1, False, "q1", "none")
        steps["convert+validate"] = convert(q1, True, "q1v", "main")
        if "second" not in args.skip:
            steps["convert_second"] = convert(q2, False, "q2", "none")
            steps["convert+validate_second"] = convert(q2, True, "q2v", "main")  # warm cache
        ref = ["--reference", source, *device]
        if "quick" not in args.skip:
            steps["validate_quick"] = child(
                ["validate", str(work / "q1"), *ref, "--quick", "--report", str(work / "quick")],
                cache("quick"),
                work / "quick.log",
            )
        if "layered" not in args.skip:
            steps["validate_layered"] = child(
                ["validate", str(work / "q1"), *ref, "--mode", "layered", "--report", str(work / "layered")],
                cache("layered"),
                work / "layered.log",
            )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    def extra(a: str, b: str, key: str) -> float | None:
        return round(steps[a][key] - steps[b][key], 2) if a in steps and b in steps else None

    summary = {
        "conversion_s": steps["convert"]["wall_s"],
        "validation_s": extra("convert+validate", "convert", "wall_s"),
        "validation_cpu_s": extra("convert+validate", "convert", "cpu_s"),
        "second_validation_s": extra("convert+validate_second", "convert_second", "wall_s"),
        "quick_validation_s": steps.get("validate_quick", {}).get("wall_s"),
        "layered_validation_s": steps.get("validate_layered", {}).get("wall_s"),
        "layered_peak_rss_gib": round(steps["validate_layered"]["peak_rss_bytes"] / 2**30, 2)
        if "validate_layered" in steps
        else None,
        "convert+validate_peak_rss_gib": round(steps["convert+validate"]["peak_rss_bytes"] / 2**30, 2),
    }
    summary["ratio_validation_to_conversion"] = round(summary["validation_s"] / summary["conversion_s"], 1)
    summary["ratio_cpu"] = round(summary["validation_cpu_s"] / steps["convert"]["cpu_s"], 1)
    if summary["second_validation_s"]:
        summary["second_precision_speedup"] = round(summary["validation_s"] / summary["second_validation_s"], 2)
    summary["load_average_before_after"] = [round(results["load_average_before"][0], 1), round(os.getloadavg()[0], 1)]
    results["summary"] = summary
    print(json.dumps(summary, indent=1))
    failed = [k for k, v in steps.items() if v["exit"]]
    if failed:
        print(f"steps that exited non-zero: {', '.join(failed)} (see log_tail in the JSON)")
    save_json(args.json, results)


if __name__ == "__main__":
    main()
