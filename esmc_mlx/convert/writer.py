"""Output side of conversion: bounded safetensors shards and an all-or-nothing directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from ..errors import ConvertError

DEFAULT_SHARD_BYTES = 1 << 30  # a shard is held in memory until written: this bounds peak RSS
INDEX_NAME = "model.safetensors.index.json"


class ShardWriter:
    """Collects evaluated tensors and writes a shard whenever the next would pass the limit.

    Shards get their final ``model-0000i-of-0000N`` names (mlx-lm's and transformers' pattern)
    in ``close()``, once N is known.
    """

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: mx.array) -> None:
        mx.eval(tensor)
        if self.pending and self.pending_bytes + tensor.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def _flush(self) -> None:
        index = len(self.shards)
        mx.save_safetensors(str(self.directory / f"shard-{index}.tmp.safetensors"), self.pending,
                            metadata={"format": "mlx"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict:
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / f"shard-{i}.tmp.safetensors", self.directory / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return index


def check_output(out_dir: Path, force: bool) -> None:
    """Fail early, before any work, if the output exists (without force) or cannot be written."""
    if out_dir.exists() and not force:
        raise ConvertError(f"{out_dir} already exists; pass --force to replace it")
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"cannot create {parent}: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise ConvertError(f"{parent} is not writable")


@contextlib.contextmanager
def staged_directory(out_dir: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of out_dir; move it into place only if the block succeeds.

    On any error the temporary directory is removed and an existing out_dir is untouched.
    """
    check_output(out_dir, force)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    except OSError as e:
        raise ConvertError(f"cannot write in {out_dir.parent}: {e.strerror}") from None
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():  # force: swap, then delete the old one
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "x")
        os.replace(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out_dir)
