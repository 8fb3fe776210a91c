"""Data parallelism over MLX's own distributed layer (``mlx.launch``, ``mx.distributed``).

Every rank reads the same input, takes a strided slice of the work and sends its results to
every rank with ``all_gather`` (padded to a common shape, the only collective that every MLX
backend has: ring, MPI, NCCL, JACCL); rank 0 alone writes. No shared file system is needed:
only the input and the model must exist on every host.

Under ``mlx.launch`` ``World.current()`` joins the launched group; in a plain process it is a
world of one, where every method is a no-op and costs nothing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class World:
    """The ranks taking part in one job."""

    def __init__(self, group=None):
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1

    @classmethod
    def current(cls) -> World:
        """The launched group when run under ``mlx.launch`` (size > 1), else a world of one."""
        if not mx.distributed.is_available():
            return cls(None)
        group = mx.distributed.init()
        return cls(group if group.size() > 1 else None)

    @classmethod
    def of(cls, group) -> World:
        """Wrap a ``mx.distributed.Group`` (or None, or a World)."""
        if isinstance(group, World):
            return group
        return cls(group if group is not None and group.size() > 1 else None)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def shard(self, items):
        """This rank's strided slice: items[rank::size]."""
        return items[self.rank :: self.size]

    def gather(self, x: np.ndarray) -> list[np.ndarray]:
        """Every rank's ``x`` (same dtype and trailing shape; first dimensions may differ),
        in rank order, on every rank."""
        x = np.ascontiguousarray(x)
        if self.size == 1:
            return [x]
        counts = self._all_gather(np.array([x.shape[0]], dtype=np.int32)).reshape(-1)
        top = int(counts.max())
        if top == 0:
            return [x[:0] for _ in range(self.size)]
        padded = np.zeros((top, *x.shape[1:]), dtype=x.dtype)
        padded[: x.shape[0]] = x
        stacked = self._all_gather(padded).reshape(self.size, top, *x.shape[1:])
        return [stacked[r, : counts[r]] for r in range(self.size)]

    def broadcast(self, x: np.ndarray) -> np.ndarray:
        """Rank 0's ``x`` on every rank (shape and dtype must agree on all ranks)."""
        if self.size == 1:
            return x
        x = np.ascontiguousarray(x)
        return self._all_gather(x[None]).reshape(self.size, *x.shape)[0]

    def max(self, value: int) -> int:
        if self.size == 1:
            return value
        return int(self._all_gather(np.array([value], dtype=np.int64)).max())

    def barrier(self) -> None:
        self.max(0)

    def _all_gather(self, x: np.ndarray) -> np.ndarray:
        dtype = x.dtype
        if dtype == np.float64:  # MLX has no float64 on every device: ship the bits as int64
            x = x.view(np.int64)
        out = mx.distributed.all_gather(mx.array(x), group=self.group)
        mx.eval(out)
        out = np.array(out)
        return out.view(np.float64) if dtype == np.float64 else out.astype(dtype, copy=False)
