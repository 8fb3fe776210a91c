"""The original checkpoint's outputs on the panel, kept on disk: validating a second precision of
the same source (``--q 4`` after ``--q mxfp4``) skips the torch pass on the original.

An entry is keyed by what its numbers depend on: the sha256 of every source file (config.json
included), the panel's digest (its inputs, whatever file or options produced them), the torch
and transformers versions, the device type the reference ran on, and ``CACHE_VERSION`` (bumped
when the reference computation changes). Hashing a 12 GB checkpoint takes seconds, so file
hashes are remembered by (path, size, mtime).

Where: ``$ESMC_MLX_CACHE/reference`` if set, else ``$XDG_CACHE_HOME/esmc-mlx/reference``, else
``~/.cache/esmc-mlx/reference`` (as huggingface_hub does with HF_HOME). ``ESMC_MLX_CACHE=off``
turns the cache off. Entries are ``.npz`` files written whole (temporary file, then rename), so a
crash never leaves a half entry; delete the directory to clear it.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..artifact import sha256
from .reference import Outputs

CACHE_VERSION = 1
ENV_VAR = "ESMC_MLX_CACHE"


def cache_root() -> Path | None:
    """The esmc-mlx cache directory, or None when ``ESMC_MLX_CACHE=off``."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return None if chosen.lower() in ("off", "0", "none") else Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "esmc-mlx"


def file_hashes(
    files: list[Path], known: dict[str, str] | None = None, known_at: float | None = None
) -> dict[str, str]:
    """sha256 of each file, remembered in ``<cache>/hashes.json`` by (path, size, mtime); the
    files are hashed in parallel threads (hashlib releases the GIL). ``known``: hashes the
    converter recorded (file name -> sha256) at time ``known_at``, taken for a file not modified
    since then (a 12 GB checkpoint is not hashed twice in one ``esmc-convert``)."""

    root = cache_root()
    memo_path = root / "hashes.json" if root else None
    try:
        memo = json.loads(memo_path.read_text()) if memo_path and memo_path.exists() else {}
    except (OSError, json.JSONDecodeError):
        memo = {}

    def stamp(f: Path) -> str:
        st = f.stat()
        return f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"

    stamps = {f: stamp(f) for f in files}
    old = set(memo)
    for f in files:
        if stamps[f] not in memo and known and known_at and f.name in known and f.stat().st_mtime < known_at:
            memo[stamps[f]] = known[f.name]
    todo = [f for f in files if stamps[f] not in memo]
    with ThreadPoolExecutor(max_workers=min(8, len(todo) or 1)) as pool:
        for f, digest in zip(todo, pool.map(sha256, todo)):
            memo[stamps[f]] = digest
    if memo_path and any(stamps[f] not in old for f in files):
        try:
            _write_atomic(memo_path, json.dumps(memo, indent=0).encode())
        except OSError:  # a read-only cache only costs the hashing next time
            pass
    return {f.name: memo[stamps[f]] for f in files}


def key(
    files: list[Path],
    config: dict,
    panel_digest: str,
    device: str,
    known: dict[str, str] | None = None,
    known_at: float | None = None,
) -> str:
    import torch
    import transformers

    facts = {
        "version": CACHE_VERSION,
        "files": file_hashes(files, known, known_at),
        "config": config,
        "panel": panel_digest,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def path_for(entry: str) -> Path | None:
    root = cache_root()
    return root / "reference" / f"{entry}.npz" if root else None


def load(entry: str, n_inputs: int) -> Outputs | None:
    """The cached outputs, or None (absent, cache off, or unreadable: then recomputed)."""
    path = path_for(entry)
    if path is None or not path.exists():
        return None
    try:
        with np.load(path) as data:
            lengths, logits, hidden = data["lengths"], data["logits"], data["hidden"]
    except (OSError, ValueError, KeyError):
        return None
    if len(lengths) != n_inputs:
        return None
    cuts = np.cumsum(lengths)[:-1]
    return Outputs(list(np.split(logits, cuts)), list(np.split(hidden, cuts)))


def store(entry: str, outputs: Outputs) -> Path | None:
    path = path_for(entry)
    if path is None:
        return None
    import io

    buffer = io.BytesIO()
    np.savez(
        buffer,
        lengths=np.array([len(x) for x in outputs.logits]),
        logits=np.concatenate(outputs.logits),
        hidden=np.concatenate(outputs.hidden),
    )
    try:
        _write_atomic(path, buffer.getvalue())
    except OSError:  # a read-only or full cache must not fail a validation
        return None
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
