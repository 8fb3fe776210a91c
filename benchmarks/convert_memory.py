"""Conversion in bounded memory: peak RSS and wall time of ``esmc-convert``, against the disk floor.

    python -m benchmarks.convert_memory /work/ckpts/6B --q mxfp4 --work /work/tmp6b

Steps, in one run on one disk:
  1. floor: read every source file once (to /dev/null) and write as many bytes as the
     converted output has (from the source, to a scratch file): "read the source and write
     the output once"; also a plain ``cp -r`` of the source, for reference;
  2. ``esmc-convert SOURCE -o WORK/out --q ... --no-validate`` under ``/usr/bin/time -v``:
     wall time and peak RSS (maximum resident set size) of the converter process.
Before each step the source files are evicted from the page cache (posix_fadvise DONTNEED),
so each reads from the disk. Everything written under WORK is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import save_json


def convert_timed(source: Path, out: Path, extra: list[str]) -> dict:
    """Run esmc-convert in a child under /usr/bin/time -v: wall seconds, its peak RSS, output
    size and time's full report."""
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "esmc_mlx.cli",
        "convert",
        str(source),
        "-o",
        str(out),
        "--force",
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"conversion failed:\n{proc.stderr[-4000:]}")
    peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    time_v = {
        k.strip(): v.strip()
        for k, v in (line.split(": ", 1) for line in proc.stderr.splitlines()[-23:] if ": " in line)
    }
    return {
        "command": " ".join(cmd[4:]),
        "wall_s": wall,
        "peak_rss_bytes": peak_kib * 1024,
        "output_bytes": size,
        "time_v": time_v,
    }


def drop_from_page_cache(paths: list[Path]) -> None:
    """Evict these files' pages (only theirs), so that every step reads from the disk."""
    subprocess.run(["sync"], check=False)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(cmd: list[str] | str, shell: bool = False) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, shell=shell)
    return time.perf_counter() - start


def read_all(paths: list[Path], block: int = 64 << 20) -> float:
    start = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(block):
                pass
    return time.perf_counter() - start


def write_bytes(source: list[Path], target: Path, count: int, block: int = 64 << 20) -> float:
    start = time.perf_counter()
    with open(target, "wb") as out:
        left = count
        for p in source:
            with open(p, "rb", buffering=0) as f:
                while left > 0 and (chunk := f.read(min(block, left))):
                    out.write(chunk)
                    left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path)
    p.add_argument("--q", default="mxfp4")
    p.add_argument("--work", type=Path, required=True, help="scratch directory on the same disk (deleted after)")
    p.add_argument("--json", type=Path)
    p.add_argument("--skip-copy", action="store_true", help="skip the cp -r reference")
    args = p.parse_args()

    files = sorted(f for f in args.source.iterdir() if f.is_file())
    source_bytes = sum(f.stat().st_size for f in files)
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / "out"
    results = {"source": str(args.source), "source_bytes": source_bytes, "q": args.q}
    try:
        drop_from_page_cache(files)
        results["convert"] = convert_timed(args.source, out, ["--q", args.q, "--no-validate"])
        wall, rss_kib, out_bytes = (results["convert"][k] for k in ("wall_s", "peak_rss_bytes", "output_bytes"))
        rss_kib //= 1024
        print(
            f"convert: {wall:.1f} s, peak RSS {rss_kib / 2**20:.2f} GiB, output {out_bytes / 2**30:.2f} GiB", flush=True
        )
        shutil.rmtree(out)

        drop_from_page_cache(files)
        read_s = read_all(files)
        write_s = write_bytes(files, args.work / "floor.bin", out_bytes)
        (args.work / "floor.bin").unlink()
        results["floor"] = {"read_source_s": read_s, "write_output_s": write_s, "total_s": read_s + write_s}
        print(
            f"floor: read {source_bytes / 2**30:.1f} GiB in {read_s:.1f} s + write {out_bytes / 2**30:.2f} GiB in "
            f"{write_s:.1f} s = {read_s + write_s:.1f} s",
            flush=True,
        )
        if not args.skip_copy:
            drop_from_page_cache(files)
            copy_s = timed(f"cp -r '{args.source}' '{args.work / 'copy'}' && sync", shell=True)
            results["copy_s"] = copy_s
            shutil.rmtree(args.work / "copy")
            print(f"cp -r of the source: {copy_s:.1f} s", flush=True)
        results["ratio_to_floor"] = wall / results["floor"]["total_s"]
        print(f"conversion / floor = {results['ratio_to_floor']:.2f}x", flush=True)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    save_json(args.json, results)


if __name__ == "__main__":
    main()
