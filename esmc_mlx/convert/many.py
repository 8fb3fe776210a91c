"""Several precisions of one source from one read of it.

``convert_many("6B", "out", ["mxfp4", "4", "8"])`` writes ``out/mxfp4``, ``out/4bit`` and
``out/8bit``: each source tensor is read, renamed and cast once, then handed to every target
(quantized by each target's plan, written by each target's shard writer). The outputs are the
same files ``convert`` writes for each spec alone; each is staged and moved into place whole,
and on any error none of them is left behind.

Naming rule (``spec_label``): an affine bit width N is ``Nbit``, a mode or mixed recipe keeps
its name (``mxfp4``, ``nvfp4``, ``mixed_4_6``), no spec is the float dtype (``bfloat16``, or
``float`` for the source's own), and a non-default ``group_size`` adds ``-g<size>``
(``4bit-g32``).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import mlx.core as mx

from .._version import __version__
from ..artifact import FLOAT_DTYPES
from ..errors import ConvertError, QuantizeError
from ..quantize import (
    QuantParams,
    QuantPlan,
    parse_spec,
    quantize_tensor,
    refuse_quantized,
)
from ..resolve import resolve
from . import check_tensors, copy_tokenizer, mapping, source_record, write_config
from .sources import open_checkpoint
from .writer import DEFAULT_SHARD_BYTES, ShardWriter, staged_directory


def spec_label(q: str | None, dtype: str | None = None, group_size: int | None = None) -> str:
    """The sub-directory name of one spec (module docstring)."""
    if not q:
        return dtype or "float"
    label = f"{q}bit" if str(q).isdigit() else str(q)
    return f"{label}-g{group_size}" if group_size else label


def convert_many(source: str, out_dir: str | Path, specs: list[str | None], dtype: str | None = None,
                 group_size: int | None = None, quantize_head: bool = False, revision: str | None = None,
                 force: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
                 command: str | None = None) -> dict[str, Path]:
    """Convert ``source`` once into one directory per spec under ``out_dir``; returns
    ``{spec label: directory}`` in the order given. ``None`` in ``specs`` is the float
    conversion. Raises ConvertError / QuantizeError as ``convert`` does, before reading any
    weight for a bad spec or an existing output (without ``force``)."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {', '.join(FLOAT_DTYPES)}")
    labels = [spec_label(q, dtype, group_size) for q in specs]
    if not labels or len(set(labels)) != len(labels):
        raise ConvertError(f"give each precision once: {', '.join(labels) or 'none given'}")
    targets = {label: out_dir / label for label in labels}
    existing = [str(p) for p in targets.values() if p.exists()]
    if existing and not force:
        raise ConvertError(f"{', '.join(existing)} already exist(s); pass --force to replace")
    for q in specs:
        if q:
            parse_spec(q, group_size)
    if (group_size is not None or quantize_head) and not any(specs):
        raise QuantizeError("--group-size and --quantize-head need --q SPEC")
    src = resolve(source, revision)
    try:
        ckpt = open_checkpoint(src)
    except ValueError as e:
        raise ConvertError(f"{src.path}: {e}") from None
    refuse_quantized(ckpt.shapes, str(src.path))
    origin = f"{src.path / 'config.json'}" if (src.path / "config.json").exists() else "the inferred config"
    check_tensors(ckpt, origin)
    out_dtype = FLOAT_DTYPES[dtype] if dtype else ckpt.dtype
    plans = [QuantPlan.parse(q, group_size, ckpt.config, quantize_head) if q else None for q in specs]
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        stagings = [stack.enter_context(staged_directory(targets[label], force)) for label in labels]
        started = time.perf_counter()
        writers = [ShardWriter(staging, shard_bytes) for staging in stagings]
        quantized: list[dict[str, QuantParams]] = [{} for _ in labels]
        bar = tqdm(total=len(ckpt.shapes), unit="tensor", desc=f"converting to {', '.join(labels)}",
                   disable=not progress)
        for source_name, tensor in ckpt.tensors():
            if not mapping.IGNORED.match(source_name):
                for name, t in mapping.rename(source_name, tensor):
                    t = t.astype(out_dtype)
                    mx.eval(t)  # read and cast once, whatever the number of targets
                    for writer, plan, record in zip(writers, plans, quantized):
                        params = plan.params_for(name, t.shape) if plan else None
                        if params is None:
                            writer.add(name, t)
                            continue
                        for qname, qt in quantize_tensor(name, t, params).items():
                            writer.add(qname, qt)
                        record[name[: -len(".weight")]] = params
            bar.update()
        bar.close()
        for writer in writers:
            writer.close()
        provenance = source_record(src, ckpt, progress)  # hashed once for all
        seconds = round(time.perf_counter() - started, 2)
        for staging, q, plan, record in zip(stagings, specs, plans, quantized):
            extra = {"source": provenance, "converter": {"name": "esmc-mlx", "version": __version__},
                     "command": command,
                     "quantization": {"spec": plan.spec, "quantize_head": plan.quantize_head} if plan else None,
                     "seconds": seconds}
            write_config(staging, ckpt.config, out_dtype, plan.record(record) if plan else None, extra,
                         license=ckpt.license)
            copy_tokenizer(src, staging)
    return targets
