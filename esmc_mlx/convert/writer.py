"""Output side of conversion: bounded safetensors shards, written into the staging directory
that ``esmc_mlx.outputs.StagedDirectory`` puts in place whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from ..errors import ConvertError
from ..outputs import disk_full, disk_full_error

DEFAULT_SHARD_BYTES = 1 << 30  # a shard is held in memory until written: this bounds peak RSS
INDEX_NAME = "model.safetensors.index.json"


def check_shard_bytes(shard_bytes: int) -> None:
    """Refuse a shard limit that is not a positive int, naming ``shard_bytes`` (0 wrote one
    shard per tensor; the CLI's ``--shard-size`` asks for at least 1MB, the API allows the
    small shards that tests of sharding use)."""
    if type(shard_bytes) is not int or shard_bytes < 1:
        raise ConvertError(f"shard_bytes={shard_bytes!r}: give the largest shard as a positive number of bytes")


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
        path = self.directory / f"shard-{len(self.shards)}.tmp.safetensors"
        try:
            mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        except (OSError, RuntimeError) as e:  # MLX says only "[write] Unable to write N bytes"
            if disk_full(e, path):
                raise disk_full_error(path) from None
            raise
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
