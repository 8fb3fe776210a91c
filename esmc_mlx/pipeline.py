"""convert -> validate -> push as one library call: what ``esmc-convert`` runs.

The policy lives here, not in the CLI: check Hub access before any work, convert, validate when
asked (or by default when torch is installed), and publish only a validated artifact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from .convert import convert
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
                          log: Callable[[str], None] = print) -> PipelineResult:
    """Convert ``source`` to ``output`` (default ``default_output``), validate it, and publish it
    to ``upload_repo`` when given.

    ``validate_output``: True validates (ValidationError if torch is missing, before converting),
    False skips, None validates when torch and transformers are installed. Raises the library's
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
    result = PipelineResult(out)
    if validate_output is False:
        pass
    elif not validation_available():
        log("Note: not validated (torch/transformers not installed); run `esmc-mlx validate` later.")
    else:
        log(f"Validating {out} against {source} ...")
        result.report = validate(out, source, revision=revision, progress=True)
        log(result.report.summary())
        log(f"Report: {result.report.directory / 'report.md'}")
        if not result.report.passed:
            raise ValidationError(
                f"validation failed ({', '.join(c.name for c in result.report.failed)}). The artifact stays at "
                f"{out} with its failing report in {result.report.directory}; it will not be uploaded.")
    if upload_repo:  # last: after conversion and validation
        result.push = push_artifact(out, upload_repo, private=private)
        log(result.push.summary())
    return result
