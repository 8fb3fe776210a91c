"""The original checkpoint's outputs on the panel, kept on disk: validating a second precision of
the same source (``--q 4`` after ``--q mxfp4``) skips the torch pass on the original.

An entry is keyed by what its numbers depend on: the sha256 of every source file (config.json
included), the panel's digest (its inputs, whatever file or options produced them), the torch
and transformers versions, the device type the reference ran on, and ``CACHE_VERSION`` (bumped
when the reference computation changes). File hashes come from ``esmc_mlx.hashes``, which
remembers them by (path, size, mtime): the converter's hashing of its source serves here too.

Where: ``<cache>/reference`` (``hashes.cache_root``: ``$ESMC_MLX_CACHE``, else
``$XDG_CACHE_HOME/esmc-mlx``, else ``~/.cache/esmc-mlx``); ``ESMC_MLX_CACHE=off`` turns it off.
Entries are ``.npz`` files written whole (temporary file, then rename), so a crash never leaves a
half entry; delete the directory to clear it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..errors import OutputError
from ..hashes import cache_root
from ..outputs import atomic_file
from .reference import Outputs

CACHE_VERSION = 1


def key(hashes: dict[str, str], config: dict, panel_digest: str, device: str) -> str:
    """The entry of a reference pass: ``hashes`` are the source files' sha256 by name
    (``hashes.file_hashes``, computed by the caller while torch imports)."""
    import torch
    import transformers

    facts = {
        "version": CACHE_VERSION,
        "files": hashes,
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, "wb") as f:  # whole or not at all: a crash leaves no half entry
            np.savez(
                f,
                lengths=np.array([len(x) for x in outputs.logits]),
                logits=np.concatenate(outputs.logits),
                hidden=np.concatenate(outputs.hidden),
            )
    except (OSError, OutputError):  # a read-only or full cache must not fail a validation
        return None
    return path
