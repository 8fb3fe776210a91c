"""convert -> validate -> push as one library call: what ``esmc-convert`` runs.

The policy lives here, not in the CLI: check Hub access before any work, convert, validate when
asked (or by default when torch is installed), and publish only a validated artifact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from .artifact import REPORT_DIR
from .convert import CONVERTED_KINDS, prepare, write_artifact, write_artifacts
from .convert.many import prepare_many, spec_label
from .convert.sae import parse_sae_spec, spec_config, write_sae
from .convert.writer import DEFAULT_SHARD_BYTES, check_shard_bytes
from .errors import HubError, ValidationError, install_hint
from .fold_artifact import FOLD
from .hub.push import PushResult, check_push_access, push_artifact
from .outputs import StagedDirectory, check_target, guard, local_paths
from .privacy import public_source_id
from .runtime.load import load
from .runtime.sae import load_sae
from .validate import Report, pick_device, prefetch_torch, validate, validation_available
from .validate.fold import validate_fold_artifact
from .validate.sae import SAEReport, validate_sae, write_sae_report


@dataclasses.dataclass
class PipelineResult:
    out: Path
    report: Report | None = None  # None when not validated
    push: PushResult | None = None


def default_output(source: str, q: str | None, dtype: str | None, group_size: int | None = None) -> Path:
    """ESMC-<name>[-<label> | -<dtype>]-mlx in the current directory (an ESMFold2 source keeps its
    name: ESMFold2-Fast-mxfp4-mlx); the label is the one of ``--q``'s sub-directories
    (``spec_label``: 4bit, 4bit-g32, mxfp4)."""
    stem = Path(source.rstrip("/")).name.removesuffix(".pth") or "model"
    if not stem.lower().startswith(("esmc", "esmfold")):
        stem = f"ESMC-{stem}"
    if q:
        return Path(f"{stem}-{spec_label(q, None, group_size)}-mlx")
    return Path(f"{stem}-{dtype}-mlx" if dtype else f"{stem}-mlx")


def convert_validate_push(
    source: str,
    output: str | Path | None = None,
    *,
    dtype: str | None = None,
    q: str | None = None,
    group_size: int | None = None,
    quantize_head: bool = False,
    revision: str | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    validate_output: bool | None = None,
    upload_repo: str | None = None,
    private: bool = False,
    command: str | None = None,
    reference_device: str = "auto",
    log: Callable[[str], None] = print,
) -> PipelineResult:
    """Convert ``source`` to ``output`` (default ``default_output``), validate it, and publish it
    to ``upload_repo`` when given.

    ``validate_output``: True validates (ValidationError if torch is missing, before converting),
    False skips, None validates when torch and transformers are installed; ``reference_device``:
    where validation's torch reference runs (auto, cpu, cuda, mps). Raises the library's
    errors; a failed validation raises ValidationError naming where the failed artifact and its
    report are kept: beside an existing ``output``, which stays as it was, as ``OUT.failed-<time>``;
    at ``output`` when there was none. Nothing is uploaded.
    """
    check_shard_bytes(shard_bytes)
    if private and upload_repo is None:  # nothing would be made private: say so instead
        raise HubError("private=True (--private) applies to the repo that upload_repo creates; give upload_repo too")
    out = Path(output) if output else default_output(source, q, dtype, group_size)
    if validate_output and not validation_available():  # fail before an hour of converting
        raise ValidationError(f"--validate needs torch and transformers: {install_hint('torch')}")
    check_target(out, force, local_paths(source), kind=CONVERTED_KINDS)  # before downloading anything
    _check_reference_device(validate_output, reference_device)
    if upload_repo is not None:  # an empty or bad id, no token, a foreign namespace: fail before converting
        check_push_access(upload_repo)
    job = prepare(source, dtype, q, group_size, quantize_head, revision, command)
    validator = _validator(job.kind)
    _prefetch_if_validating(validate_output)  # after the source is found and read, before converting
    # The old output stays in place until the new one is proven: convert and validate in the
    # staging directory, swap in only after validation passed (or was skipped).
    with StagedDirectory(out, force, sources=job.inputs, kind=job.kind) as stage:
        write_artifact(job, stage.path, shard_bytes)
        where, report = _prove_and_place(
            stage, out, source, validate_output, revision, reference_device, log, validator
        )
        result = PipelineResult(where, report)
        if report is not None and not report.passed:
            failed = ", ".join(c.name for c in report.failed)
            if where == out:  # there was no old output to keep
                raise ValidationError(
                    f"validation failed ({failed}). The artifact stays at {out} with its failing report in "
                    f"{out / REPORT_DIR}; it will not be uploaded."
                )
            raise ValidationError(
                f"validation failed ({failed}). The old {out} is unchanged; the new artifact is kept at "
                f"{where} with its failing report in {where / REPORT_DIR}; it will not be uploaded."
            )
        if upload_repo is not None:  # last, and still under the lock: no other run replaces OUT mid-upload
            result.push = push_artifact(out, upload_repo, private=private, hold_lock=False)  # ours already
            log(result.push.summary())
    return result


def convert_validate_many(
    source: str,
    output: str | Path | None,
    specs: list[str | None],
    *,
    dtype: str | None = None,
    group_size: int | None = None,
    quantize_head: bool = False,
    revision: str | None = None,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    validate_output: bool | None = None,
    command: str | None = None,
    reference_device: str = "auto",
    log: Callable[[str], None] = print,
) -> list[PipelineResult]:
    """Several precisions of ``source`` from one read of it (``esmc_mlx.convert.many``):
    ``output``/<label> per spec (``4bit``, ``mxfp4``, ...; ``spec_label``), each validated in its
    staging directory before it goes into place, as ``convert_validate_push`` does for one; the
    original's outputs on the panel are computed for the first and taken from validation's
    reference cache by the others. Raises ValidationError, once every artifact is validated,
    naming those that failed and where each is kept."""
    check_shard_bytes(shard_bytes)
    out = Path(output) if output else default_output(source, None, dtype)
    if validate_output and not validation_available():  # fail before an hour of converting
        raise ValidationError(f"--validate needs torch and transformers: {install_hint('torch')}")
    labels = [spec_label(q, dtype, group_size) for q in specs]
    for label in labels:
        check_target(out / label, force, local_paths(source), kind=CONVERTED_KINDS)  # before downloading anything
    _check_reference_device(validate_output, reference_device)
    jobs = prepare_many(source, specs, dtype, group_size, quantize_head, revision, command)
    validator = _validator(next(iter(jobs.values())).kind)  # one source: one kind
    _prefetch_if_validating(validate_output)
    results, failures = [], []
    with contextlib.ExitStack() as stack:
        stages = [
            stack.enter_context(StagedDirectory(out / label, force, sources=job.inputs, kind=job.kind))
            for label, job in jobs.items()
        ]
        write_artifacts(list(jobs.values()), [s.path for s in stages], shard_bytes)
        for label, stage in zip(jobs, stages):
            where, report = _prove_and_place(
                stage, out / label, source, validate_output, revision, reference_device, log, validator
            )
            if report is not None and not report.passed:
                failures.append(f"{label} ({', '.join(c.name for c in report.failed)}; kept at {where})")
            results.append(PipelineResult(where, report))
    if failures:
        raise ValidationError("validation failed for " + "; ".join(failures) + ". Nothing is uploaded.")
    return results


def _validating(validate_output: bool | None) -> bool:
    """Whether the conversion will be validated: asked for, or by default with torch installed."""
    return validate_output is not False and validation_available()


def _check_reference_device(validate_output: bool | None, reference_device: str) -> None:
    """A named --reference-device that torch does not see (cuda, mps) fails before the
    conversion, not after it (torch is imported for that, only when a device is named)."""
    if reference_device not in ("auto", "cpu") and _validating(validate_output):
        pick_device(reference_device)


def _prefetch_if_validating(validate_output: bool | None) -> None:
    """Import torch while the source is read and converted, not after (``prefetch_torch``)."""
    if _validating(validate_output):
        prefetch_torch()


def _validator(kind: str) -> Callable[..., Report]:
    """The validation of a conversion that writes ``kind`` (``Conversion.kind``), called as
    ``validate`` is: ESMC's for a model, ``validate_fold_artifact`` for an ESMFold2 (its panel of
    proteins folded on both sides under the same random draws)."""
    return validate_fold_artifact if kind == FOLD.name else validate


def _prove_and_place(
    stage: StagedDirectory,
    target: Path,
    source: str,
    validate_output: bool | None,
    revision: str | None,
    reference_device: str,
    log: Callable[[str], None],
    validator: Callable[..., Report] = validate,
) -> tuple[Path, Report | None]:
    """Validate the staged artifact with ``validator`` (unless ``validate_output`` is False or
    torch is missing) and put it in place: at ``target`` when it passed, was not validated, or
    there is no old output to keep; else beside the old one as ``target.failed-<time>``. Returns
    (where it is, the report)."""
    report = None
    if _validating(validate_output):
        log(f"Validating the conversion against {source} before it goes to {target} ...")
        report = validator(
            stage.path,
            source,
            revision=revision,
            progress=True,
            artifact_path=target,
            reference_device=reference_device,
        )
        log(report.summary())
    elif validate_output is None:
        log("Note: not validated (torch/transformers not installed); run `esmc-mlx validate` later.")
    failed_beside_old = report is not None and not report.passed and os.path.lexists(target)
    where = stage.keep_failed() if failed_beside_old else stage.publish()
    log(f"Wrote {where}")
    if report is not None:
        report.directory = where / REPORT_DIR
        log(f"Report: {report.directory / 'report.md'}")
    return where, report


@dataclasses.dataclass
class SAEResult:
    out: Path
    report: SAEReport | None = None  # None when not validated


def quantize_validate_sae(
    source: str,
    output: str | Path,
    *,
    q: str,
    model: str | Path | None = None,
    group_size: int | None = None,
    layers=None,
    revision: str | None = None,
    force: bool = False,
    validate_output: bool = True,
    log: Callable[[str], None] = print,
) -> SAEResult:
    """An SAE (``source``: a folder or Hub repo id) with its matrices as ``q`` makes them (bf16,
    fp16 or 8-bit), written to ``output`` one layer at a time, validated against ``source``
    through ``model`` (the backbone whose hidden states the SAE reads; needs no torch) and put in
    place only when it passed: a failing one is kept beside an existing ``output`` as
    ``OUT.failed-<time>`` (or at ``output`` when there was none) and raises ValidationError.
    ``layers``: the layers to keep (default all). Raises QuantizeError, ConfigError, HubError,
    OutputError before any work for a bad spec, source or output."""
    spec = parse_sae_spec(q, group_size)
    out = Path(output)
    inputs = local_paths(source, model)
    check_target(out, force, inputs, kind="sae")  # before anything is read
    if validate_output and model is None:
        raise ValidationError(
            "validating an SAE needs the backbone it reads: give --model (or --no-validate to skip the check)"
        )
    reference = load_sae(source, revision)
    layers = [reference.check_layer(i) for i in (reference.config.available_layers if layers is None else layers)]
    spec_config(reference.config, spec, layers)  # a group size that does not divide: before any work
    backbone = load(model)[0] if validate_output else None
    local = Path(source).expanduser()
    provenance = {"id": public_source_id(reference.name if not local.exists() else str(local.resolve()))}
    if reference.revision:
        provenance["revision"] = reference.revision
    with guard(out, "sae", "directory", force=force, inputs=inputs) as stage:
        write_sae(reference.config, reference.file, stage.path, spec, layers, provenance, lambda i: log(f"layer {i}"))
        report = None
        if backbone is not None:
            log(f"Validating against {reference.name} through {model} ...")
            report = validate_sae(load_sae(stage.path), reference, backbone, layers=layers, name=out.name)
            write_sae_report(report, stage.path / REPORT_DIR)
            log(report.summary())
        failed_beside_old = report is not None and not report.passed and os.path.lexists(out)
        where = stage.keep_failed() if failed_beside_old else stage.publish()
        log(f"Wrote {where}")
    if report is not None:
        report.directory = where / REPORT_DIR
        if not report.passed:
            kept = f"kept at {where}" + (f"; the old {out} is unchanged" if where != out else "")
            raise ValidationError(
                f"SAE validation failed ({', '.join(f'{c.name} {c.detail}' for c in report.failed)}); {kept}"
            )
    return SAEResult(where, report)
