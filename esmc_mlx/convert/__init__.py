"""Convert an ESMC or ESMFold2 checkpoint to an MLX directory, one tensor at a time.

source -> resolve -> open (headers only) -> check names and shapes against the config ->
stream: read tensor, rename/split, cast or quantize, hand to the shard writer -> config.json,
tokenizer files -> move the finished directory into place.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx

from .._version import __version__
from ..artifact import FLOAT_DTYPES, TOKENIZER_FILES, check_finite, dtype_name, expected_shapes, read_config
from ..config import ESMCConfig
from ..errors import ConvertError, QuantizeError
from ..fold_artifact import FOLD, expected_fold_shapes, keeps_float32
from ..fold_config import FoldConfig
from ..hashes import file_hashes
from ..outputs import StagedDirectory, check_target, local_paths
from ..privacy import public_command, public_source_id, scrub
from ..quantize import QuantParams, QuantPlan, parse_spec, quantize_tensor, refuse_quantized
from ..resolve import Source, resolve
from ..vocab import write_tokenizer_files
from . import mapping
from .sources import Checkpoint, open_checkpoint
from .writer import DEFAULT_SHARD_BYTES, ShardWriter, check_shard_bytes

# The artifact kinds a conversion writes: an existing output of either may be replaced (--force)
# before the source is opened; once it is, the output takes the kind of the source.
CONVERTED_KINDS = ("model", FOLD.name)


def check_tensors(ckpt: Checkpoint, config_origin: str, where: str = "checkpoint") -> None:
    """Names, dtypes and shapes, from headers alone, before any weight is read: every tensor the
    config's model has (an ESMC's ``expected_shapes``, an ESMFold2's ``expected_fold_shapes``) and
    no other; ``where`` names the checkpoint in the one error listing what is wrong."""
    expected = expected_fold_shapes(ckpt.config) if ckpt.is_fold else expected_shapes(ckpt.config)
    produced: dict[str, tuple[int, ...]] = {}
    unknown, odd = [], []
    for name, shape in ckpt.shapes.items():
        targets = ckpt.target_names(name)
        if targets is None:
            if not mapping.IGNORED.match(name):
                unknown.append(name)
            continue
        if name in ckpt.odd_dtypes:
            odd.append(f"{name} ({ckpt.odd_dtypes[name]})")
        for target in targets:
            produced[target] = (shape[0] // len(targets), *shape[1:]) if shape else shape
    extra = sorted(set(produced) - set(expected)) + unknown
    missing = sorted(set(expected) - set(produced))
    problems = []
    if odd:
        problems.append(
            f"tensors that are not float32, bfloat16 or float16 weights (save them as one): {_listing(odd)}"
        )
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listing(extra)}")
    for name in sorted(set(produced) & set(expected)):
        if produced[name] != expected[name]:
            problems.append(
                f"{name}: shape {produced[name]} in the checkpoint, {expected[name]} expected from {config_origin}"
            )
    if problems:
        listing = problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems[:20])
        raise ConvertError(f"{where} does not match an {'ESMFold2' if ckpt.is_fold else 'ESMC'} model: {listing}")


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


@dataclasses.dataclass
class Conversion:
    """A checked conversion, ready to write: the opened source and the options that apply."""

    src: Source
    ckpt: Checkpoint
    dtype: mx.Dtype
    plan: QuantPlan | None
    command: str | None = None
    derived_from: dict | None = None

    @property
    def inputs(self) -> list[Path]:
        """The paths the conversion reads; an output may be none of them nor hold one."""
        return [self.src.path, *self.ckpt.files]

    @property
    def kind(self) -> str:
        """The artifact kind it writes (``artifact.ARTIFACT_KINDS``): ``fold`` for an ESMFold2."""
        return FOLD.name if self.ckpt.is_fold else "model"


def prepare(
    source: str,
    dtype: str | None = None,
    q: str | None = None,
    group_size: int | None = None,
    quantize_head: bool = False,
    revision: str | None = None,
    command: str | None = None,
    derived_from: dict | None = None,
) -> Conversion:
    """Resolve and open ``source`` and check everything that can be checked before writing:
    options, tensor names and shapes against the config, quantization widths."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {', '.join(FLOAT_DTYPES)}")
    if q is not None:  # an empty --q "" is a bad spec, not "no quantization"
        parse_spec(q, group_size)
    elif group_size is not None or quantize_head:
        raise QuantizeError("--group-size and --quantize-head need --q SPEC")
    src = resolve(source, revision)
    try:
        ckpt = open_checkpoint(src)
    except ValueError as e:  # shape inference on a checkpoint that is not ESMC
        raise ConvertError(f"{src.path}: {e}") from None
    refuse_quantized(ckpt.shapes, str(src.path))
    origin = f"{src.path / 'config.json'}" if (src.path / "config.json").exists() else "the inferred config"
    check_tensors(ckpt, origin, str(src.path))
    out_dtype = FLOAT_DTYPES[dtype] if dtype else ckpt.dtype
    # an ESMFold2's backbone is quantized as an ESMC is; its folding model is never quantized
    plan = QuantPlan.parse(q, group_size, ckpt.esmc_config, quantize_head) if q else None  # checks widths
    return Conversion(src, ckpt, out_dtype, plan, command, derived_from)


def write_artifact(
    job: Conversion, directory: Path, shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True
) -> None:
    """Write the MLX artifact of ``job`` into the (empty, staging) ``directory``."""
    write_artifacts([job], [directory], shard_bytes, progress)


def write_artifacts(
    jobs: list[Conversion], directories: list[Path], shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True
) -> None:
    """Write the artifact of every job (all of one source and dtype) into its (empty, staging)
    directory, reading the source once: each tensor is read, renamed, cast and checked once,
    then quantized by each job's plan and handed to each job's shard writer."""
    first = jobs[0]
    started = time.perf_counter()
    quantized = write_tensors(first.ckpt, directories, first.dtype, [j.plan for j in jobs], shard_bytes, progress)
    provenance = source_record(first.src, first.ckpt)  # hashed once for all
    for job, directory, overrides in zip(jobs, directories, quantized):
        plan = job.plan
        extra = {
            # an older parent's record may hold local paths: scrub keeps only their basenames
            "source": dict(provenance, **({"derived_from": scrub(job.derived_from)} if job.derived_from else {})),
            "converter": {"name": "esmc-mlx", "version": __version__},
            "command": public_command(job.command),  # typed paths cut to basenames (privacy.py)
            "quantization": {"spec": plan.spec, "quantize_head": plan.quantize_head} if plan else None,
            "seconds": round(time.perf_counter() - started, 2),
        }
        write_config(
            directory,
            job.ckpt.config,
            job.dtype,
            plan.record(overrides) if plan else None,
            extra,
            license=job.ckpt.license,
        )
        copy_tokenizer(job.src, directory)


def convert(
    source: str,
    out_dir: str | Path,
    dtype: str | None = None,
    q: str | None = None,
    group_size: int | None = None,
    quantize_head: bool = False,
    revision: str | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    command: str | None = None,
    derived_from: dict | None = None,
) -> Path:
    """Convert ``source`` (alias, repo id, directory or .pth) to an MLX directory ``out_dir``.

    ``dtype``: float32, bfloat16 or float16 (default: the source's). ``q``: a quantization spec
    (see ``esmc_mlx.quantize``); ``quantize_head`` also quantizes the embedding and LM head.
    Raises ConvertError / QuantizeError / HubError with a message naming the file, tensor or
    option; on error nothing is left at ``out_dir`` (an existing one, replaced with ``force``,
    stays as it was). ``force`` replaces only a directory esmc-mlx wrote (``esmc_mlx.outputs``).
    ``derived_from``: the provenance of the checkpoint ``source`` was converted from
    (``quantize_directory`` keeps it for the model card).
    """
    check_shard_bytes(shard_bytes)
    check_target(out_dir, force, local_paths(source), kind=CONVERTED_KINDS)  # fail before downloading anything
    job = prepare(source, dtype, q, group_size, quantize_head, revision, command, derived_from)
    with StagedDirectory(out_dir, force, sources=job.inputs, kind=job.kind) as stage:
        write_artifact(job, stage.path, shard_bytes, progress)
        stage.publish()
    return Path(out_dir)


def write_tensors(
    ckpt: Checkpoint,
    directories: list[Path],
    dtype: mx.Dtype,
    plans: list[QuantPlan | None],
    shard_bytes: int,
    progress: bool,
) -> list[dict[str, QuantParams]]:
    """Stream every tensor through rename -> cast -> check -> (per target) quantize -> shard
    writer; returns each target's quantized layers."""
    from tqdm.auto import tqdm

    writers = [ShardWriter(d, shard_bytes) for d in directories]
    quantized: list[dict[str, QuantParams]] = [{} for _ in plans]
    desc = "converting" if len(plans) == 1 else f"converting to {len(plans)} precisions"
    # a context: on an error the bar ends its line, so the Error line starts on its own
    with tqdm(total=len(ckpt.shapes), unit="tensor", desc=desc, disable=not progress) as bar:
        for source_name, tensor in ckpt.tensors():
            if not mapping.IGNORED.match(source_name):
                for name, t in mapping.rename(source_name, tensor, ckpt.target_names):
                    t, source = t.astype(mx.float32 if ckpt.is_fold and keeps_float32(name) else dtype), t
                    check_finite(source_name, source, t)  # evaluates the cast once for every target
                    for writer, plan, record in zip(writers, plans, quantized):
                        params = plan.params_for(name, t.shape) if plan else None
                        if params is None:
                            writer.add(name, t)
                            continue
                        for qname, qt in quantize_tensor(name, t, params).items():
                            writer.add(qname, qt)
                        record[name[: -len(".weight")]] = params
            bar.update()
            bar.set_postfix_str(f"{sum(w.total_bytes for w in writers) / 2**20:,.0f} MiB written")
    for writer in writers:
        writer.close()
    return quantized


def source_record(src: Source, ckpt: Checkpoint) -> dict:
    # remembered by (path, size, mtime): validating against this source later hashes nothing
    return {"id": public_source_id(src.id), "revision": src.revision, "files": file_hashes(ckpt.files)}


def write_config(
    directory: Path,
    config: ESMCConfig | FoldConfig,
    dtype: mx.Dtype,
    quantization: dict | None,
    provenance: dict,
    license: str | None = None,
) -> dict:
    payload = config.to_dict()
    payload["dtype"] = dtype_name(dtype)
    if quantization:
        # mlx-lm writes both spellings; readers look for either
        payload["quantization"] = quantization
        payload["quantization_config"] = quantization
    payload["esmc_mlx"] = dict(provenance, license=license)
    (directory / "config.json").write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def copy_tokenizer(src: Source, directory: Path) -> None:
    """Keep the source's tokenizer files when it has them; otherwise write ESMC's."""
    source_dir = src.path if src.path.is_dir() else src.path.parent
    found = [source_dir / f for f in TOKENIZER_FILES if (source_dir / f).exists()]
    if "tokenizer.json" in {f.name for f in found}:
        for f in found:
            shutil.copyfile(f, directory / f.name)  # not copy2: the output takes the umask, not the source's mode
    else:
        write_tokenizer_files(directory)


def quantize_directory(
    model_dir: str | Path,
    out_dir: str | Path,
    q: str,
    group_size: int | None = None,
    quantize_head: bool = False,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
    command: str | None = None,
    **convert_kwargs,
) -> Path:
    """Quantize an existing float MLX directory (``esmc-mlx quantize``) into ``out_dir``.

    An MLX directory has the published layout's tensor names, so this is the converter's
    streaming path with the directory as source: one tensor at a time, bounded shards.
    Raises QuantizeError (bad spec, group size, already quantized) or ConvertError (missing or
    damaged directory, existing output).
    """
    model_dir = Path(model_dir)
    parse_spec(q, group_size)
    parent = read_config(model_dir).get("esmc_mlx", {}).get("source")
    return convert(
        str(model_dir),
        out_dir,
        dtype=dtype,
        q=q,
        group_size=group_size,
        quantize_head=quantize_head,
        force=force,
        progress=progress,
        command=command,
        derived_from=parent,
        **convert_kwargs,
    )
