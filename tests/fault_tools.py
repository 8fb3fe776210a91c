"""What the fault tests share: running a command, the state of the disk before and after
(digests of every file, debris), the one `Error:` line, leftovers of a killed run, a disk that
really fills up."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from esmc_mlx import outputs
from esmc_mlx.cli import convert_main, main


def cli(*args, command=main):
    return CliRunner().invoke(command, [str(a) for a in args])


def convert_cli(*args):
    return cli(*args, command=convert_main)


def snapshot(path: Path) -> dict:
    """Every file under ``path`` (or the file itself) -> (sha256, mode): "byte-identical"."""
    path = Path(path)
    if path.is_file():
        return {"": (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mode)}
    return {
        str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


DEBRIS = (".partial-", ".old-", ".tmp", ".lock", ".merge")


def debris(*folders: Path) -> list[str]:
    """Hidden leftovers of a run (staging, swapped-out, temporary, lock files) in ``folders``."""
    found = []
    for folder in folders:
        if Path(folder).is_dir():
            found += [
                p.name for p in Path(folder).iterdir() if p.name.startswith(".") and any(d in p.name for d in DEBRIS)
            ]
    return found


def visible(folder: Path) -> list[str]:
    """What ``folder`` holds that is not hidden (the marker and any debris are)."""
    return sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))


def one_error_line(result, *fragments, code=1):
    """Exit code, exactly one `Error:` line and no traceback; the line holds every fragment."""
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), (result.exception, result.output)  # no traceback
    assert "Traceback" not in result.output, result.output
    assert result.output.count("Error:") == 1, result.output
    lines = [line for line in re.split(r"[\r\n]", result.output) if line.startswith("Error:")]
    assert len(lines) == 1, result.output  # on a line of its own, after any progress bar
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def rewrite_header(path: Path, edit) -> None:
    """Edit the safetensors header of ``path`` in place (``edit(header)``), the data left as is."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


DEAD = 999999999  # no such process


def dead_staging(parent: Path, target: str, stage: str) -> Path:
    """A staging folder as a run that was killed leaves it: made by outputs.make_staging, its
    marker naming a process that is gone."""
    path = outputs.make_staging(parent, target, stage)
    dead = path.rename(path.with_name(path.name.replace(f"-{os.getpid()}-", f"-{DEAD}-")))
    marker = json.loads((dead / outputs.MARKER).read_text())
    (dead / outputs.MARKER).write_text(json.dumps(dict(marker, pid=DEAD, staged_as=dead.name)))
    return dead


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only): a disk that really fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
