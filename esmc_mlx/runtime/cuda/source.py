"""The CUDA text of this folder's .cu and .cuh files, as ``mx.fast.cuda_kernel`` takes it.

A kernel's ``header`` is a whole .cuh file. Its ``source`` (the body MLX wraps in a generated
signature) comes from a .cu file of bodies: each body starts at a line ``//@ NAME`` and runs
to the next such line (the newline before it is the marker's). Bodies name their inputs as
MLX passes them; a few hold placeholders (``%K``, ``DEQUANT`` ...) that the Python beside them
fills per instantiation.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = re.compile(r"^//@ (\S+)\n", re.M)


@functools.cache
def text(name: str) -> str:
    """A whole file of this folder."""
    return (HERE / name).read_text()


@functools.cache
def bodies(name: str) -> dict[str, str]:
    """The bodies of a .cu file of this folder, by name."""
    whole = text(name)
    found = list(MARKER.finditer(whole))
    out = {}
    for m, following in zip(found, [*found[1:], None]):
        end = following.start() if following else len(whole)
        out[m.group(1)] = whole[m.end() : end][:-1]  # the newline before the next marker is its
    return out
