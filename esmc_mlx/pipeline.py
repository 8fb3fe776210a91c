"""convert -> validate -> push as one library call: what ``esmc-convert`` runs.

The policy lives here, not in the CLI: check Hub access before any work, convert, validate when
asked (or by default when torch is installed), and publish only a validated artifact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from .convert import convert
from .convert.many import convert_many
from .convert.writer import DEFAULT_SHARD_BYTES
from .errors import ValidationError
from .hub.push import PushResult, check_push_access, push_artifact
from .validate import Report, validate, validation_available


@dataclasses.dataclass
class PipelineResult:
    out: Path
    report: Report | None = None  # None when not validated
    push: PushResult | None = None


def default_output(source: str, q: str | None, dtype: str | None) -> Path:
    """ESMC-<name>[-<q> | -<dtype>]-mlx in the current directory."""
    stem = Path(source.rstrip("/")).name.removesuffix(".pth") or "model"
    if not stem.lower().startswith("esmc"):
        stem = f"ESMC-{stem}"
    return Path(f"{stem}-{q}-mlx" if q else f"{stem}-{dtype}-mlx" if dtype else f"{stem}-mlx")


def convert_validate_push(source: str, output: str | Path | None = None, *, dtype: str | None = None,
                          q: str | None = None, group_size: int | None = None, quantize_head: bool = False,
                          revision: str | None = None, force: bool = False,
                          shard_bytes: int = DEFAULT_SHARD_BYTES, validate_output: bool | None = None,
                          upload_repo: str | None = None, private: bool = False, command: str | None = None,
                          reference_device: str = "auto", log: Callable[[str], None] = print) -> PipelineResult:
    """Convert ``source`` to ``output`` (default ``default_output``), validate it, and publish it
    to ``upload_repo`` when given.

    ``validate_output``: True validates (ValidationError if torch is missing, before converting),
    False skips, None validates when torch and transformers are installed; ``reference_device``:
    where validation's torch reference runs (auto, cpu, cuda, mps). Raises the library's
    errors; a failed validation raises ValidationError after keeping the artifact and its report,
    and nothing is uploaded.
    """
    out = Path(output) if output else default_output(source, q, dtype)
    if validate_output and not validation_available():  # fail before an hour of converting
        raise ValidationError("--validate needs torch and transformers: pip install 'esmc-mlx[torch]'")
    if upload_repo:  # a missing token or a foreign namespace fails now, not after converting
        check_push_access(upload_repo)
    convert(source, out, dtype=dtype, q=q, group_size=group_size, quantize_head=quantize_head, revision=revision,
            force=force, shard_bytes=shard_bytes, command=command)
    log(f"Wrote {out}")
    result = PipelineResult(out, _validate(out, source, revision, validate_output, reference_device, log))
    if result.report is not None and not result.report.passed:
        raise ValidationError(
            f"validation failed ({', '.join(c.name for c in result.report.failed)}). The artifact stays at "
            f"{out} with its failing report in {result.report.directory}; it will not be uploaded.")
    if upload_repo:  # last: after conversion and validation
        result.push = push_artifact(out, upload_repo, private=private)
        log(result.push.summary())
    return result


def _validate(out: Path, source: str, revision: str | None, wanted: bool | None, reference_device: str,
              log: Callable[[str], None]) -> Report | None:
    if wanted is False:
        return None
    if not validation_available():
        log("Note: not validated (torch/transformers not installed); run `esmc-mlx validate` later.")
        return None
    log(f"Validating {out} against {source} ...")
    report = validate(out, source, revision=revision, progress=True, reference_device=reference_device)
    log(report.summary())
    log(f"Report: {report.directory / 'report.md'}")
    return report


def convert_validate_many(source: str, output: str | Path | None, specs: list[str | None], *,
                          dtype: str | None = None, group_size: int | None = None, quantize_head: bool = False,
                          revision: str | None = None, force: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES,
                          validate_output: bool | None = None, command: str | None = None,
                          reference_device: str = "auto", log: Callable[[str], None] = print) -> list[PipelineResult]:
    """Several precisions of ``source`` from one read of it (``convert.many.convert_many``):
    ``output``/<label> per spec (``4bit``, ``mxfp4``, ...), each validated; the original's
    outputs on the panel are computed once (validation's reference cache) and reused by the
    others. Raises ValidationError after every artifact is validated when any fails (all stay
    on disk with their reports)."""
    out = Path(output) if output else default_output(source, None, dtype)
    if validate_output and not validation_available():
        raise ValidationError("--validate needs torch and transformers: pip install 'esmc-mlx[torch]'")
    dirs = convert_many(source, out, specs, dtype=dtype, group_size=group_size, quantize_head=quantize_head,
                        revision=revision, force=force, shard_bytes=shard_bytes, command=command)
    results = []
    for directory in dirs.values():
        log(f"Wrote {directory}")
        results.append(PipelineResult(directory, _validate(directory, source, revision, validate_output,
                                                           reference_device, log)))
    failed = [r for r in results if r.report is not None and not r.report.passed]
    if failed:
        raise ValidationError("validation failed for " + ", ".join(
            f"{r.out} ({', '.join(c.name for c in r.report.failed)})" for r in failed)
            + "; the artifacts stay on disk with their failing reports.")
    return results
