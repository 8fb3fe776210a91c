"""Several precisions of one source from one read of it.

``convert_many("6B", "out", ["mxfp4", "4", "8"])`` writes ``out/mxfp4``, ``out/4bit`` and
``out/8bit``: each source tensor is read, renamed, cast and checked once, then handed to every
target (quantized by each target's plan, written by each target's shard writer). The outputs are
the files ``convert`` writes for each spec alone; each is staged and moved into place whole
(``esmc_mlx.outputs``), and on any error none of them is published.

Naming rule (``spec_label``): an affine bit width N is ``Nbit``, a mode or mixed recipe keeps
its name (``mxfp4``, ``nvfp4``, ``mixed_4_6``), no spec is the float dtype (``bfloat16``, or
``float`` for the source's own), and a ``group_size`` adds ``-g<size>`` (``4bit-g32``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..errors import ConvertError
from ..outputs import StagedDirectory, check_target, local_paths
from . import CONVERTED_KINDS, Conversion, prepare, write_artifacts
from .writer import DEFAULT_SHARD_BYTES, check_shard_bytes


def spec_label(q: str | None, dtype: str | None = None, group_size: int | None = None) -> str:
    """The sub-directory name of one spec (module docstring)."""
    if not q:
        return dtype or "float"
    label = f"{q}bit" if str(q).isdigit() else str(q)
    return f"{label}-g{group_size}" if group_size else label


def prepare_many(
    source: str,
    specs: list[str | None],
    dtype: str | None = None,
    group_size: int | None = None,
    quantize_head: bool = False,
    revision: str | None = None,
    command: str | None = None,
) -> dict[str, Conversion]:
    """``{label: Conversion}`` for every spec, each checked as ``prepare`` checks one (headers
    only: nothing is read yet). Raises ConvertError for a spec given twice."""
    labels = [spec_label(q, dtype, group_size) for q in specs]
    if not labels or len(set(labels)) != len(labels):
        raise ConvertError(f"give each precision once: {', '.join(labels) or 'none given'}")
    return {
        label: prepare(source, dtype, q, group_size if q else None, quantize_head if q else False, revision, command)
        for label, q in zip(labels, specs)
    }


def convert_many(
    source: str,
    out_dir: str | Path,
    specs: list[str | None],
    dtype: str | None = None,
    group_size: int | None = None,
    quantize_head: bool = False,
    revision: str | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    command: str | None = None,
) -> dict[str, Path]:
    """Convert ``source`` once into ``out_dir/<label>`` for every spec; returns ``{label:
    directory}`` in the order given (``None`` in ``specs``: the float conversion). Raises
    ConvertError / QuantizeError / OutputError as ``convert`` does, before reading any weight for
    a bad spec or an existing output (without ``force``)."""
    check_shard_bytes(shard_bytes)
    out_dir = Path(out_dir)
    labels = [spec_label(q, dtype, group_size) for q in specs]
    for label in labels:
        check_target(out_dir / label, force, local_paths(source), kind=CONVERTED_KINDS)
    jobs = prepare_many(source, specs, dtype, group_size, quantize_head, revision, command)
    with contextlib.ExitStack() as stack:
        stages = [
            stack.enter_context(StagedDirectory(out_dir / label, force, sources=job.inputs, kind=job.kind))
            for label, job in jobs.items()
        ]
        write_artifacts(list(jobs.values()), [s.path for s in stages], shard_bytes, progress)
        return {label: stage.publish() for label, stage in zip(jobs, stages)}
