"""Where the two commands take torch from: the Makefile's decision, read from `make -n` (the
commands it would run), with `uname`, `nvidia-smi` and the probe of PyTorch's CPU index played by
stand-ins on PATH. scripts/check_torch_index.py resolves those commands against the real indexes;
scripts/check_package.py (`make package`, CI) builds and installs the wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from esmc_mlx.errors import TORCH_CPU_INDEX

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="needs make")


def _stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def torch_install(tmp_path, system="Linux", gpu=None, index_answers=True, *make_args) -> tuple[str, str]:
    """The pip line `make install` would run for torch, and what make said on stderr. ``gpu``:
    None (no nvidia-smi), True (it lists a GPU), False (it fails: installed without a driver)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    _stand_in(folder, "uname", f"echo {system}")
    if gpu is not None:
        _stand_in(folder, "nvidia-smi", "echo 'GPU 0: NVIDIA H100'" if gpu else "exit 9")
    _stand_in(folder, "python3", "exit 0" if index_answers else "exit 1")  # the index probe
    env = {**os.environ, "PATH": str(folder)}  # only the stand-ins: no real nvidia-smi
    done = subprocess.run(
        [MAKE, "-n", "-B", "install", f"PYTHON={folder / 'python3'}", *make_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "torch==" in x]
    return line, done.stderr


def test_linux_without_an_nvidia_gpu_takes_torch_from_the_cpu_index(tmp_path):
    line, _ = torch_install(tmp_path)
    assert f"--extra-index-url {TORCH_CPU_INDEX} torch==2.13.0" in line
    line, _ = torch_install(tmp_path, "Linux", False)  # nvidia-smi without a driver or a GPU
    assert f"--extra-index-url {TORCH_CPU_INDEX}" in line


@pytest.mark.parametrize("system, gpu", [("Linux", True), ("Darwin", None)])
def test_a_gpu_machine_or_a_mac_takes_pypis_torch(tmp_path, system, gpu):
    line, _ = torch_install(tmp_path, system, gpu)
    assert "--extra-index-url" not in line and "torch==2.13.0" in line


def test_an_index_that_does_not_answer_is_left_out_with_a_note(tmp_path):
    line, said = torch_install(tmp_path, "Linux", None, False)
    assert "--extra-index-url" not in line
    assert f"{TORCH_CPU_INDEX} does not answer: torch from PyPI or a wheel at hand" in said


def test_torch_index_is_the_users_to_set(tmp_path):
    line, _ = torch_install(tmp_path, "Linux", None, True, "TORCH_INDEX=")
    assert "--extra-index-url" not in line
    line, _ = torch_install(tmp_path, "Linux", True, True, "TORCH_INDEX=file:///srv/wheels")
    assert "--extra-index-url file:///srv/wheels torch==2.13.0" in line
