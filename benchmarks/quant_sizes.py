"""Size on disk, bits per weight, peak RSS and wall time of real quantized conversions.

Converts random-weight bf16 checkpoints of the published shapes (300M, 600M, 6B; see
esmc_mlx.testing.write_random_checkpoint) in every mode, each in a child process
(``esmc_mlx.convert.convert(SRC, TMP, q=SPEC)``) whose peak RSS comes from os.wait4, measures the
output, deletes it, and rewrites the table in docs/quantization.md between its markers.
Results accumulate in benchmarks/results/quant_sizes.json, so shapes can run separately:

    python -m benchmarks.quant_sizes --shapes 300M 600M
    nohup python -m benchmarks.quant_sizes --shapes 6B --modes 8 4 mxfp4 mxfp8 nvfp4 mixed_4_6 &

Random weights give the same sizes as trained ones: the formats are fixed-rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from esmc_mlx.artifact import describe  # noqa: E402
from esmc_mlx.quantize import SPECS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "quant_sizes.json"
DOC = ROOT / "docs" / "quantization.md"
BEGIN, END = "<!-- quant_sizes:begin -->", "<!-- quant_sizes:end -->"
SHAPES = ("300M", "600M", "6B")


def measure(source: Path, spec: str, work: Path) -> dict:
    """One conversion in a child process: size, bits per weight, peak RSS, seconds."""
    out = Path(tempfile.mkdtemp(prefix=f"qsize-{source.name}-{spec}-", dir=work)) / "out"
    # The library call, not the CLI: `esmc-convert` also validates by default, which is not what is measured.
    code = f"from esmc_mlx.convert import convert; convert({str(source)!r}, {str(out)!r}, q={spec!r}, progress=False)"
    command = [sys.executable, "-c", code]
    log = out.parent / "stderr.txt"
    started = time.perf_counter()
    with open(log, "wb") as stderr:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS, not the max over children
    seconds = time.perf_counter() - started
    try:
        if os.waitstatus_to_exitcode(status):
            raise RuntimeError(f"{' '.join(command)} failed:\n{log.read_text()[-2000:]}")
        facts = describe(out)
        size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
        return {
            "spec": spec,
            "size_bytes": size,
            "bits_per_weight": facts["bits per weight"],
            "storage": facts["storage"],
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            "seconds": round(seconds, 1),
            "parameters": facts["parameters"],
        }
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def source_row(source: Path) -> dict:
    facts = describe(source)
    size = sum(f.stat().st_size for f in source.glob("model*.safetensors"))
    return {
        "spec": "bf16 (source)",
        "size_bytes": size,
        "bits_per_weight": facts["bits per weight"],
        "storage": "bfloat16",
        "peak_rss_bytes": None,
        "seconds": None,
        "parameters": facts["parameters"],
    }


def _rows(results: dict, shapes: list[str], specs, cells) -> list[str]:
    """One markdown row per spec measured for any shape; ``cells(result)`` gives a shape's two cells."""
    rows = []
    for spec in specs:
        if any(spec in results[s] for s in shapes):
            row = [c for s in shapes for c in (cells(results[s][spec]) if spec in results[s] else ["not run", ""])]
            rows.append(f"| {spec} | " + " | ".join(row) + " |")
    return rows


def table(results: dict) -> str:
    shapes = [s for s in SHAPES if s in results]
    specs = ["bf16 (source)", *SPECS]
    lines = [
        "| spec | " + " | ".join(f"{s} size | {s} bpw" for s in shapes) + " |",
        "|---|" + "---:|---:|" * len(shapes),
    ]
    lines += _rows(results, shapes, specs, lambda r: [f"{r['size_bytes'] / 1e9:.3f} GB", f"{r['bits_per_weight']:.3f}"])
    lines += [
        "",
        "Peak RSS and wall time of each conversion (child process, 2 shared x86 cores, "
        "source read from local disk, includes hashing the source):",
        "",
        "| spec | " + " | ".join(f"{s} peak RSS | {s} time" for s in shapes) + " |",
        "|---|" + "---:|---:|" * len(shapes),
    ]
    lines += _rows(
        results, shapes, SPECS, lambda r: [f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", f"{r['seconds']:.0f} s"]
    )
    return "\n".join(lines)


def write_doc(results: dict) -> None:
    text = DOC.read_text() if DOC.exists() else f"# Quantization\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--ckpts",
        type=Path,
        default=Path("/work/ckpts"),
        help="Directory holding the random checkpoints 300M/, 600M/, 6B/.",
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--modes", nargs="+", default=list(SPECS), choices=SPECS)
    parser.add_argument(
        "--work", type=Path, default=Path("/work/tmp"), help="Where outputs are written (then deleted)."
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        source = args.ckpts / shape
        record(shape, source_row(source))
        for spec in args.modes:
            r = measure(source, spec, args.work)
            record(shape, r)
            print(
                f"{shape:5} {spec:10} {r['size_bytes'] / 1e9:7.3f} GB  {r['bits_per_weight']:6.3f} bpw  "
                f"peak RSS {r['peak_rss_bytes'] / 2**30:5.2f} GiB  {r['seconds']:6.1f} s",
                flush=True,
            )


def record(shape: str, row: dict) -> None:
    """Merge one row into the results file (re-read each time: several runs may share it) and
    rewrite the doc's table."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.setdefault(shape, {})[row["spec"]] = row
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    write_doc(results)


if __name__ == "__main__":
    main()
