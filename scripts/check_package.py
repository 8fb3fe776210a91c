"""What `make package` runs (and CI, .ci/run): build the sdist and the wheel, check them with twine,
and prove the wheel works where the clone is not.

1. ``python -m build`` into dist/ from a copy of the files git tracks, as a fresh clone holds
   them (a file the build needs that git lacks fails here, whatever lies around in the working
   tree; tracked files are copied as they are now, uncommitted edits included): the sdist, then
   a wheel built from that sdist, so a file missing from the sdist fails here too;
2. ``twine check --strict`` on both;
3. the LICENSE, the packaged esmc-tiny and the CUDA sources are in the wheel;
4. a fresh venv in a temporary directory, the wheel installed into it with the pinned versions
   (.ci/constraints.txt; no torch: the base install needs none), then, from a temporary working
   directory: ``esmc-convert tiny -o t --q 4 --no-validate`` and ``esmc-mlx info t``.

Needs the `release` extra (build, twine) and the network for PyPI (build's isolated environment,
the wheel's dependencies). Exits non-zero, naming the step, when anything fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"
# what the wheel must carry besides the code
MUST_HAVE = ("LICENSE", "esmc_mlx/data/esmc-tiny/model.safetensors", "esmc_mlx/data/panel.fasta")


def step(name: str, command: list, **kwargs) -> subprocess.CompletedProcess:
    print(f"--- {name}: {' '.join(map(str, command))}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, text=True, capture_output=True, **kwargs)
    if done.returncode:
        sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    print(f"    ok ({time.perf_counter() - started:.1f} s)", flush=True)
    return done


def clean_copy(dest: Path) -> Path:
    """The files git tracks, copied into ``dest`` (what a clone holds); ROOT itself outside a git
    checkout (an unpacked sdist holds only what it ships)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True)
    if listed.returncode:
        return ROOT
    for rel in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / rel
        if source.is_file():  # a tracked file deleted in the working tree is left out, as a commit would
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    return dest


def main() -> None:
    shutil.rmtree(DIST, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="esmc-mlx-clone-") as clone:
        source = clean_copy(Path(clone))
        step("build", [sys.executable, "-m", "build", "--outdir", str(DIST), str(source)])
    sdists, wheels = sorted(DIST.glob("*.tar.gz")), sorted(DIST.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        sys.exit(f"build: expected one sdist and one wheel in {DIST}, found {[p.name for p in DIST.iterdir()]}")
    step("twine check", [sys.executable, "-m", "twine", "check", "--strict", *map(str, sdists + wheels)])
    names = zipfile.ZipFile(wheels[0]).namelist()
    missing = [m for m in MUST_HAVE if not any(n == m or n.endswith("/licenses/" + m) for n in names)]
    if missing or not any(n.endswith(".cu") for n in names):
        sys.exit(f"wheel {wheels[0].name} lacks {missing or 'the .cu sources'}")
    print(f"--- wheel contents: {len(names)} files, LICENSE and esmc-tiny included", flush=True)

    with tempfile.TemporaryDirectory(prefix="esmc-mlx-package-") as tmp:
        env_dir, work = Path(tmp) / "venv", Path(tmp) / "work"
        work.mkdir()
        venv.create(env_dir, with_pip=True)
        bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
        python = bin_dir / "python"
        step(
            "install the wheel in a fresh venv",
            [python, "-m", "pip", "install", "-q", "-c", str(ROOT / ".ci" / "constraints.txt"), str(wheels[0])],
        )
        # outside the clone: nothing may come from the working tree
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        where = step(
            "import location", [python, "-c", "import esmc_mlx; print(esmc_mlx.__file__)"], cwd=work, env=env
        ).stdout.strip()
        if Path(where).resolve().is_relative_to(ROOT):
            sys.exit(f"the fresh venv imported esmc_mlx from the clone ({where}), not from the wheel")
        step("esmc-convert", ["esmc-convert", "tiny", "-o", "t", "--q", "4", "--no-validate"], cwd=work, env=env)
        info = step("esmc-mlx info", ["esmc-mlx", "info", "t"], cwd=work, env=env).stdout
        if "affine 4-bit" not in info or "bits per weight" not in info:
            sys.exit(f"esmc-mlx info t printed something else:\n{info}")
        print(info, end="")
    print(f"Package check passed: {sdists[0].name}, {wheels[0].name}")


if __name__ == "__main__":
    main()
