#!/usr/bin/env python3
"""Carry MLX and the CUTLASS extension to the lent GPU machine (the tool library's ``device``).

That machine has Python 3.12, torch, transformers and nvcc, no registry and no MLX; a call
carries at most 64 MiB with the working tree (~25 MB). So MLX's CUDA wheel (90 MB) travels in
three parts, one call each, into ``~/stash``, while the machine stays warm (it is given back
30 s after a call ends: fire the calls back to back), and a fourth call installs it and runs
the measurements. The CUTLASS extension is built here, where the build costs no
device time (about 3 minutes), with ``cutlass_qmm.build_commands``' flags against the CUDA
wheel's headers and the machine's CPython 3.12 headers (pyenv's here).

Here, once a checkout (``.whl/`` is git-excluded: nothing of it is committed)::

    echo /.whl/ >> .git/info/exclude
    .venv/bin/python scripts/device_setup.py prepare

On the machine (``run`` calls; each line one call, its ``carry`` first)::

    [".whl/a"]   python3 scripts/device_setup.py stash
    [".whl/b"]   python3 scripts/device_setup.py stash
    [".whl/d"]   python3 scripts/device_setup.py stash
    [".whl/c", ".whl/cache", ...]
                 python3 scripts/device_setup.py install && export PYTHONPATH=~/site:$PWD \\
                     ESMC_MLX_CACHE=~/cache PYTHONUNBUFFERED=1 && <the measurements>

While the machine stays warm, later calls need only the ``export``. ``stash`` and ``install``
run on the machine's Python before MLX is there, so this script imports MLX and esmc_mlx only
inside ``prepare``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
PART_MB = 30  # three parts of the 90 MB wheel, each call's tree (~25 MB) beside it under 64 MiB
PARTS = {"a": "part_aa", "b": "part_ab", "d": "part_ac"}  # carried folder -> part, in order
PLATFORM = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_35_x86_64")
NANOBIND = "nanobind==3.1.0"  # MLX 0.32's binding ABI (pyproject's [cutlass] extra)
STASH = Path.home() / "stash"
SITE = Path.home() / "site"
CACHE = Path.home() / "cache"  # ESMC_MLX_CACHE there


def pip_install(python: str, target: Path, wheels) -> None:
    """``wheels`` unpacked into ``target`` by ``python``'s pip: no index, no dependencies."""
    run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), *map(str, wheels)])


def run(command: list[str]) -> None:
    print("+", " ".join(map(str, command)), flush=True)
    subprocess.run(command, check=True)


def python312() -> str:
    """A CPython 3.12 that runs here: its headers match the GPU machine's Python."""
    candidates = [
        shutil.which("python3.12"),
        *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
    ]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    sys.exit(
        "Error: no python3.12 runs here (its headers build the extension for the GPU machine): install one with pyenv"
    )


def prepare(build: bool) -> None:
    import mlx.core as mx  # here only: the GPU machine runs stash and install without MLX

    version = mx.__version__
    download = WHEELS / "download"
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM,
         "-d", str(download), f"mlx=={version}", f"mlx-cuda-13=={version}", NANOBIND])  # fmt: skip
    split(next(download.glob(f"mlx_cuda_13-{version}-*.whl")))
    (WHEELS / "c").mkdir(exist_ok=True)
    for old in (WHEELS / "c").glob("mlx-*.whl"):
        old.unlink()
    shutil.copy(next(download.glob(f"mlx-{version}-cp312-*.whl")), WHEELS / "c")
    print(f"MLX {version}'s CUDA wheel in {WHEELS}/{{a,b,d}}, the mlx wheel in {WHEELS}/c")
    if build:
        build_cutlass(download, version)


def split(wheel: Path, size: int = PART_MB << 20) -> None:
    """``wheel`` in parts of ``size`` bytes, one a folder of PARTS."""
    data = wheel.read_bytes()
    if len(data) > len(PARTS) * size:
        sys.exit(f"Error: {wheel.name} is over {len(PARTS)} parts of {size} bytes: add a part folder")
    for i, (folder, name) in enumerate(PARTS.items()):
        (WHEELS / folder).mkdir(parents=True, exist_ok=True)
        (WHEELS / folder / name).write_bytes(data[i * size : (i + 1) * size])


def joined(name: str) -> Path:
    """The stashed parts joined into ``~/name``."""
    parts = sorted(STASH.glob("part_*"))
    if [p.name for p in parts] != list(PARTS.values()):
        carry = ", ".join(f".whl/{folder}" for folder in PARTS)
        sys.exit(f"Error: {STASH} holds {[p.name for p in parts]}: run stash with each of {carry}")
    wheel = STASH.parent / name
    wheel.write_bytes(b"".join(p.read_bytes() for p in parts))
    return wheel


def build_cutlass(download: Path, version: str) -> None:
    python = python312()
    site = WHEELS / "site312"
    if not (site / "mlx" / "include" / "cutlass").is_dir() or not (site / "nanobind").is_dir():
        pip_install(python, site, download.glob("*.whl"))
    os.environ["ESMC_MLX_CACHE"] = str(WHEELS / "cache")
    from esmc_mlx.runtime.cuda import cutlass_qmm

    sys.path.append(str(site))  # nanobind (pure Python) for build_commands; MLX stays this venv's
    # That Python's headers and extension suffix, as cutlass_qmm.build reads its own.
    query = "import sysconfig; print(sysconfig.get_paths()['include']); print(sysconfig.get_config_var('EXT_SUFFIX'))"
    include, suffix = subprocess.run([python, "-c", query], check=True, capture_output=True, text=True).stdout.split()
    folder = cutlass_qmm.build_dir()
    target = folder / (cutlass_qmm.MODULE + suffix)
    if target.exists():
        print(f"{target} is built")
        return
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / ("partial-" + target.name)
    print(f"Building {target.name} for MLX {version} (CUTLASS, its compiles side by side) ...", flush=True)
    with tempfile.TemporaryDirectory() as work:  # the objects: not carried
        compiles, link = cutlass_qmm.build_commands(partial, Path(work), mlx_root=site / "mlx", python_include=include)
        cutlass_qmm.run_build(compiles, link)
    os.replace(partial, target)
    print(f"Built {target}: carry .whl/cache")


def stash() -> None:
    STASH.mkdir(exist_ok=True)
    parts = sorted(WHEELS.glob("*/part_*"))
    for part in parts:
        shutil.copy(part, STASH)
    print("stashed:", ", ".join(p.name for p in sorted(STASH.glob("part_*"))))


def install() -> None:
    mlx = sorted((WHEELS / "c").glob("mlx-*.whl"))
    if not mlx:
        sys.exit("Error: .whl/c holds no mlx wheel: carry .whl/c (scripts/device_setup.py prepare makes it)")
    version = mlx[-1].name.split("-")[1]
    if not (SITE / "mlx" / "lib").is_dir():
        wheel = joined(f"mlx_cuda_13-{version}-py3-none-manylinux_2_35_x86_64.whl")
        pip_install(sys.executable, SITE, [wheel, mlx[-1]])
    built = WHEELS / "cache" / "cutlass_qmm"
    if built.is_dir():
        shutil.copytree(built, CACHE / "cutlass_qmm", dirs_exist_ok=True)
    print(f"MLX {version} in {SITE}; now: export PYTHONPATH={SITE}:$PWD ESMC_MLX_CACHE={CACHE}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="step", required=True)
    prep = sub.add_parser("prepare", help="here: the wheels in parts under .whl/, and the CUTLASS build")
    prep.add_argument("--no-cutlass", action="store_true", help="skip the CUTLASS build")
    sub.add_parser("stash", help="on the machine: copy the carried wheel part to ~/stash")
    sub.add_parser("install", help="on the machine: join the parts, install MLX into ~/site, the build into ~/cache")
    a = p.parse_args()
    if a.step == "prepare":
        prepare(build=not a.no_cutlass)
    elif a.step == "stash":
        stash()
    else:
        install()


if __name__ == "__main__":
    main()
