"""Command line: parse, call the library, print. No work of its own happens here."""

from __future__ import annotations

import errno
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import click
from click.core import ParameterSource

from ._version import __version__
from .artifact import describe, human_size, model_facts, plural
from .bench import FLOAT_SPREAD, parse_shapes, parse_torch_modes, run
from .convert import quantize_directory, tiny_fold
from .errors import EsmcMlxError, EsmcMlxWarning
from .finetune import TASKS, finetune, fuse_adapter, predict_csv
from .finetune.model import HEADS, POOLS
from .finetune.train import DEFAULTS as FINETUNE_DEFAULTS
from .hub.push import push_artifact
from .outputs import shown_path, stopped_notes
from .pipeline import convert_validate_many, convert_validate_push, quantize_validate_sae
from .privacy import public_path
from .resolve import ALIASES, LOCAL_ALIASES
from .runtime.cuda import cutlass_qmm
from .runtime.load import plan as plan_model
from .tasks.attention import attention_job
from .tasks.distributed import World
from .tasks.fasta import SEQUENCE_OPTION
from .tasks.features import features_job
from .tasks.fold import fold_job
from .tasks.jobs import embed_fasta, scan_job, score_csv
from .tasks.scoring import DEFAULT_WINDOW
from .validate.fold import validate_any as run_validation

SOURCE_HELP = (
    f"SOURCE: an alias ({', '.join([*ALIASES, *LOCAL_ALIASES])}), a Hub repo id, a local directory or a legacy "
    ".pth file. An ESMFold2 checkpoint (config.json with model_type esmfold2) converts to a fold artifact: "
    "--dtype applies to its folding model and backbone, --q quantizes its ESMC backbone. "
    f"{tiny_fold.NAME}: a small ESMFold2 with RANDOM folding weights on esmc-tiny, built offline to try "
    "esmc-mlx fold; its structures are meaningless."
)


def _error_line(error: EsmcMlxError | OSError) -> click.ClickException:
    """The `Error: ...` line: the library's message, or for the system's errors (the disk,
    permissions, a path that vanished) what happened to which path. Anything else is a bug and
    keeps its traceback."""
    if isinstance(error, EsmcMlxError):
        return click.ClickException(str(error))
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return click.ClickException(
            f"the disk is full: could not write {error.filename or 'the output'}; free some space and run again"
        )
    where = f"{shown_path(error.filename)}: " if error.filename else ""
    return click.ClickException(f"{where}{error.strerror or error}")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit, `kill`): unwound like Ctrl-C, so that every writer
    removes its staging and releases its lock on the way out."""


def _terminate(signum, frame):
    raise Terminated()


def _run(invoke, ctx):
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    stopped_notes()  # (what an earlier call in this process left unsaid)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default", EsmcMlxWarning)  # once per message
            warnings.showwarning = _show_warning
            try:
                return invoke(ctx)
            except OSError as e:
                if e.errno == errno.EPIPE and e.filename is None:
                    raise  # stdout's reader has gone (`esmc-mlx info X | head`): click exits quietly
                raise _error_line(e) from None
            except EsmcMlxError as e:
                raise _error_line(e) from None
            except KeyboardInterrupt as e:
                _say_stopped("SIGTERM" if isinstance(e, Terminated) else "Ctrl-C")
                raise click.exceptions.Exit(1) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _say_stopped(how: str) -> None:
    """In place of click's bare ``Aborted!``: what the stopped run left at each output (the
    guards say: as it was, not written, or what it keeps and that the same command resumes)."""
    notes = stopped_notes()
    click.echo(f"Stopped ({how})" + (": " + "; ".join(notes) if notes else "") + ".", err=True)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Every warning, esmc-mlx's and its libraries', as one ``Warning:`` line (no source line)."""
    click.echo(f"Warning: {message}", err=True)


class FriendlyErrors(click.Group):
    """Turn the library's errors (and the system's: disk full, permissions) into `Error: message`
    and exit code 1, without a traceback; its warnings into `Warning: message` lines."""

    def invoke(self, ctx):
        return _run(super().invoke, ctx)


def _friendly(command):
    """Same as FriendlyErrors, for the stand-alone `esmc-convert` command."""
    original = command.invoke
    command.invoke = lambda ctx: _run(original, ctx)
    return command


def _command_line() -> str:
    """The command as provenance records it (config.json, the model card): the options given,
    rebuilt from what click parsed, every path the user typed (a path option or argument, a
    local SOURCE) by its basename, however it was spelt (``-o/abs/out``, ``--output=rel/out``)."""
    ctx = click.get_current_context()
    words = [Path(sys.argv[0]).name] + ([ctx.info_name] if ctx.parent is not None else [])
    arguments, options = [], []
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[param.name]
        for v in value if param.multiple else [value]:
            if isinstance(param, click.Argument):
                arguments.append(_public_value(param, v))
            elif param.is_flag:
                options.append(param.opts[-1] if v else param.secondary_opts[-1])
            else:
                options += [max(param.opts, key=len), _public_value(param, v)]
    return " ".join(shlex.quote(str(w)) for w in words + arguments + options)


def _public_value(param: click.Parameter, value) -> str:
    """A parameter's value as it may be published: a path by its basename (a SOURCE argument is
    one when it names something here; else it is an alias or a Hub repo id)."""
    if isinstance(param.type, click.Path):
        return public_path(value)
    if isinstance(param, click.Argument) and isinstance(value, str):
        try:
            return public_path(value) if os.path.lexists(os.path.expanduser(value)) else value
        except (OSError, ValueError):
            return value
    return str(value)


class OutputPath(click.Path):
    """An output path. `-`, stdout to many tools, is refused: it would make a file or folder named '-'."""

    def convert(self, value, param, ctx):
        if str(value) == "-":
            self.fail(
                "'-' would be a file or folder named '-': esmc-mlx writes files, not stdout; name a path", param, ctx
            )
        return super().convert(value, param, ctx)


class InputPath(click.Path):
    """An input that must exist. A link to nothing is named as one: click says only that the
    path does not exist, while `ls` shows it there."""

    def convert(self, value, param, ctx):
        if isinstance(value, (str, os.PathLike)) and os.path.islink(value) and not os.path.exists(value):
            self.fail(f"{os.fspath(value)} is a link to {os.readlink(value)}, which does not exist", param, ctx)
        return super().convert(value, param, ctx)


# Options shared by `esmc-convert` / `esmc-mlx convert` and `esmc-mlx quantize`.
group_size_option = click.option("--group-size", type=int, help="Affine group size: 32, 64 (default) or 128.")
quantize_head_option = click.option(
    "--quantize-head",
    is_flag=True,
    help="Also quantize the token embedding and the LM head (default: they stay in the float dtype; "
    "they are <1% of the weights and carry the output distribution).",
)
force_option = click.option(
    "--force",
    is_flag=True,
    help="Replace an existing output directory that esmc-mlx wrote (never anything else; see docs/reliability.md).",
)
keep_nonstandard_option = click.option(
    "--keep-nonstandard",
    is_flag=True,
    help="Also score (embed: also pool) the non-standard residues X B Z U O; by default they are skipped "
    "with a warning (the model still reads them as context).",
)
shard_size_option = click.option(
    "--shard-size",
    default="1GB",
    show_default=True,
    callback=lambda ctx, param, value: _parse_size(value),
    help="Largest safetensors shard; bounds the converter's memory.",
)
reference_device_option = click.option(
    "--reference-device",
    type=click.Choice(["auto", "cpu", "cuda", "mps"]),
    default="auto",
    show_default=True,
    help="Where the torch reference of validation runs (fp32; auto: CUDA, else MPS, else the CPU).",
)

convert_options = [
    click.argument("source"),
    click.option(
        "-o",
        "--output",
        "output",
        type=OutputPath(path_type=Path),
        help="Output directory (default: ESMC-<name>[-<spec>]-mlx in the current directory: ESMC-300M-4bit-mlx, ESMC-6B-mxfp4-mlx).",
    ),
    click.option(
        "--dtype",
        type=click.Choice(["float32", "bfloat16", "float16"]),
        help="Float dtype of the output (default: the source's).",
    ),
    click.option(
        "--q",
        "q",
        metavar="SPEC",
        multiple=True,
        help="Quantize: 8 6 5 4 3 2 (affine bits), mxfp4, mxfp8, nvfp4, or a mixed recipe "
        "(mixed_2_6 mixed_3_4 mixed_3_6 mixed_4_6 mixed_4_8). Repeat for several precisions "
        "from one read of the source: -o DIR then holds one sub-directory per spec "
        "(4bit, 8bit, mxfp4, mixed_4_6; -g<N> appended for --group-size N), all validated "
        "against one pass of the original.",
    ),
    group_size_option,
    quantize_head_option,
    click.option("--revision", help="Hub revision (branch, tag or commit) of the source."),
    force_option,
    shard_size_option,
    click.option(
        "--upload-repo",
        metavar="ORG/NAME",
        help="After converting (and validating), publish to this Hub model repo with a model card. "
        "Token and namespace are checked before converting.",
    ),
    click.option("--private", is_flag=True, help="With --upload-repo: create the repo private."),
    click.option(
        "--validate/--no-validate",
        "validate",
        default=None,
        help="Validate the output against SOURCE (report in OUT/validation/). Default: on when "
        "torch and transformers are installed.",
    ),
    reference_device_option,
]


def _apply(options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


MIN_SHARD_BYTES = 1 << 20  # smaller shards only multiply files; a model tensor can be larger anyway


def _parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}
    text = text.strip().upper()
    size = None
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            size = int(float(text[: -len(unit)]) * factor)
            break
    if size is None and text.isdigit():
        size = int(text)
    if size is None:
        raise click.BadParameter(f"{text!r}: use a size like 512MB or 2GB", param_hint="--shard-size")
    if size < MIN_SHARD_BYTES:
        raise click.BadParameter(
            f"{text!r}: a shard must hold at least 1MB (use e.g. 512MB or 2GB)", param_hint="--shard-size"
        )
    return size


def run_convert(
    source,
    output,
    dtype,
    q,
    group_size,
    revision,
    force,
    shard_size,
    upload_repo=None,
    private=False,
    quantize_head=False,
    validate=None,
    reference_device="auto",
):
    specs = list(q) if isinstance(q, (list, tuple)) else [q]
    if private and upload_repo is None:
        raise click.UsageError("--private applies to the repo that --upload-repo creates; give --upload-repo too")
    common = dict(
        dtype=dtype,
        group_size=group_size,
        quantize_head=quantize_head,
        revision=revision,
        force=force,
        shard_bytes=shard_size,
        validate_output=validate,
        command=_command_line(),
        reference_device=reference_device,
        log=click.echo,
    )
    if source == tiny_fold.NAME:  # built here (random folding weights on esmc-tiny), converted as any checkpoint
        if revision is not None:
            raise click.UsageError(f"--revision: {source} is built here, not a Hub repo")
        with tiny_fold.tiny_fold_checkpoint() as checkpoint:
            run_convert(str(checkpoint), output or tiny_fold.DEFAULT_OUTPUT, dtype, q, group_size, None, force,
                        shard_size, upload_repo, private, quantize_head, bool(validate), reference_device)  # fmt: skip
        click.echo(f"Note: {tiny_fold.NOTICE}")
        return
    if len(specs) > 1:  # one read of the source, one sub-directory per spec, one reference pass
        if upload_repo is not None:
            raise click.UsageError("--upload-repo takes one --q; publish each sub-directory with `esmc-mlx push`")
        convert_validate_many(source, output, specs, **common)
        return
    convert_validate_push(
        source, output, q=specs[0] if specs else None, upload_repo=upload_repo, private=private, **common
    )


EXAMPLES = """
\b
Examples:
  esmc-convert tiny -o esmc-tiny-mlx            # packaged model, works offline
  esmc-convert tiny-fold -o tiny-fold          # random folding weights: tries esmc-mlx fold offline
  esmc-convert 300M --dtype bfloat16            # biohub/ESMC-300M from the Hub
  esmc-convert 6B --q mxfp4 --upload-repo my-org/ESMC-6B-mxfp4
  esmc-convert ./esmc_300m_2024_12_v0.pth -o esmc-300m-mlx
  esmc-convert ESMFold2-Fast --q mxfp4 --no-validate
"""


@_friendly
@click.command(
    name="esmc-convert", help="Convert an ESMC or ESMFold2 checkpoint to MLX.\n\n" + SOURCE_HELP + "\n" + EXAMPLES
)
@_apply(convert_options)
@click.version_option(__version__)
def convert_main(**kwargs):
    run_convert(**kwargs)


@click.group(cls=FriendlyErrors, help="Convert, quantize, validate, publish and run ESMC models with MLX.")
@click.version_option(__version__)
def main():
    pass


@main.command(
    help="Convert an ESMC or ESMFold2 checkpoint to MLX (same as esmc-convert).\n\n" + SOURCE_HELP + "\n" + EXAMPLES
)
@_apply(convert_options)
def convert(**kwargs):
    run_convert(**kwargs)


QUANTIZE_HELP = """Quantize MODEL_DIR, a float MLX model directory (from esmc-convert), into the -o directory,
streaming one tensor at a time. SPEC: 8 6 5 4 3 2 (affine bits, --group-size 32|64|128, default 64), mxfp4,
mxfp8, nvfp4 (fixed group sizes 32, 32, 16), or a mixed recipe (mixed_2_6 mixed_3_4 mixed_3_6
mixed_4_6 mixed_4_8: v/down projections of the sensitive blocks get the high bits). The
embedding, norms and LM head stay in the float dtype unless --quantize-head.

\b
Examples:
  esmc-mlx quantize ESMC-6B-mlx -o ESMC-6B-mxfp4-mlx --q mxfp4
  esmc-mlx quantize ESMC-300M-mlx -o ESMC-300M-4bit-mlx --q 4 --group-size 32
"""


@main.command(help=QUANTIZE_HELP)
@click.argument("model_dir", type=InputPath(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", "output", type=OutputPath(path_type=Path), required=True, help="Output directory.")
@click.option("--q", "q", metavar="SPEC", required=True, multiple=True, help="Quantization spec (see above).")
@group_size_option
@quantize_head_option
@force_option
@shard_size_option
def quantize(model_dir, output, q, group_size, quantize_head, force, shard_size):
    if len(q) > 1:  # click kept the last one without a word; esmc-convert takes several
        raise click.BadParameter(
            f"give one spec here, got {len(q)} ({', '.join(q)}); for several precisions from one read "
            "use esmc-convert SOURCE -o DIR --q 4 --q 8",
            param_hint="--q",
        )
    quantize_directory(
        model_dir,
        output,
        q[0],
        group_size=group_size,
        quantize_head=quantize_head,
        force=force,
        shard_bytes=shard_size,
        command=_command_line(),
    )
    click.echo(f"Wrote {output}")


INFO_HELP = """Describe MODEL_DIR, an MLX model directory: architecture, parameters, dtype or
quantization, bits per weight, size on disk (of an ESMFold2 fold artifact: its folding model and
its ESMC backbone apart).

With --plan, say what runs for each kind of layer at each token count (--tokens) on this
machine's default device, or on another (--device cpu, metal or cuda:sm_XY, e.g. cuda:sm_80 for
an A100, cuda:sm_89 for an L40 or RTX 4090, cuda:sm_90a for an H100 or H200): the path, the
kernels it launches with the oldest GPU architecture each needs (none: MLX's own op), and why.
A device without a measured table runs MLX's own ops. For another device than this one,
CUTLASS counts as built.

\b
Examples:
  esmc-mlx info esmc-tiny-mlx
  esmc-mlx info ESMC-6B-mxfp4 --plan --tokens 1,256,1024
  esmc-mlx info ESMC-6B-mxfp4 --plan --device cuda:sm_80 --json
"""


def _token_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(
            f"{text!r}: give token counts >= 1, comma-separated (1,256,1024)", param_hint="--tokens"
        )
    return counts


@main.command(help=INFO_HELP)
@click.argument("model_dir", type=InputPath(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON instead of text: numbers as numbers (parameters, bits_per_weight, size_bytes, shards).",
)
@click.option("--plan", is_flag=True, help="Say what runs for each kind of layer, and why.")
@click.option("--tokens", default="1,256,1024", show_default=True, help="Token counts for --plan (batch x length).")
@click.option(
    "--device", "device_name", default=None, help="For --plan: cpu, metal or cuda:sm_XY [default: this machine's]."
)
def info(model_dir, as_json, plan, tokens, device_name):
    if not plan:
        if device_name is not None or tokens != "1,256,1024":
            raise click.UsageError("--tokens and --device go with --plan")
        if as_json:
            click.echo(json.dumps(model_facts(model_dir), indent=2))
            return
        facts = describe(model_dir)
        width = max(map(len, facts))
        for key, value in facts.items():
            click.echo(f"{key:<{width}}  {value}")
        return
    try:
        target, rows = plan_model(model_dir, _token_counts(tokens), device_name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    device = target.device
    if as_json:
        described = {"backend": device.backend, "arch": device.arch, "sms": device.sms}
        click.echo(json.dumps({"device": described, "plan": rows}, indent=2))
        return
    tuning = target.tuning
    click.echo(
        f"device: {device.backend}"
        + (f" {device.arch}" if device.arch else "")
        + (f", {device.sms} SMs" if device.sms else "")
    )
    click.echo(f"tables: {tuning.measured_on if tuning else 'none measured here: MLX own ops'}")
    for row in rows:
        kernels = ", ".join(f"{k['name']}" + (f" ({k['requires']})" if k["requires"] else "") for k in row["kernels"])
        extra = f" [{row['tile']}, {row['splits']} split{'s' if row['splits'] > 1 else ''}]" if "tile" in row else ""
        click.echo(f"{row['tokens']:>6}  {row['layer']:<38} {row['path']}{extra}: {kernels}")
        click.echo(f"{'':>8}{row['reason']}")


VALIDATE_HELP = """Validate an MLX model directory against the original checkpoint.

Runs a panel of real proteins (or --sequences FASTA) through the artifact with MLX and through
transformers' EsmcForMaskedLM in torch, then answers two questions: fidelity (MLX against torch
on the weights the artifact holds, dequantized if quantized) and quality (the artifact against
the original: KL, top-1, relative errors, embedding cosine, Spearman of variant scores). Writes
report.json, report.md and a plot to MLX_DIR/validation/ (or --report DIR). Exit code 0 only
when every enforced check passes. Needs the torch extra (torch, transformers).

An ESMFold2 fold artifact is folded, with its panel of proteins (one a complex; --sequences:
FASTA records of chains, A|B for a complex), by MLX and by transformers' EsmFold2Model on the
same random draws: fidelity (coordinates, distogram, pLDDT, PAE, pTM on the artifact's weights)
and quality (C-alpha RMSD, lDDT-CA, pLDDT/PAE/pTM errors against the original). --steps,
--loops and --samples (default: the config's steps and loops, one sample) apply to fold
artifacts only, --quick and --mode to ESMC models only.

\b
Examples:
  esmc-mlx validate esmc-tiny-mlx --reference tiny
  esmc-mlx validate ESMC-6B-mxfp4-mlx --reference 6B --quick
  esmc-mlx validate my-mlx --reference ./esmc_300m_2024_12_v0.pth --threshold kl_mean=0.02
  esmc-mlx validate ESMFold2-Fast-4bit-mlx --reference ESMFold2-Fast
  esmc-mlx validate ESMFold2-Fast-4bit-mlx --reference ESMFold2-Fast --steps 20 --max-length 64
"""


def _parse_thresholds(values: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for item in values:
        name, sep, number = item.partition("=")
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if not sep or math.isnan(value):  # no number, or NaN (no bound: every check against it fails)
            raise click.BadParameter(f"{item!r}: use NAME=VALUE, e.g. kl_mean=0.02", param_hint="--threshold")
        out[name.strip()] = value
    return out


@main.command(help=VALIDATE_HELP)
@click.argument("mlx_dir", type=InputPath(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--reference",
    required=True,
    metavar="SOURCE",
    help="The original checkpoint: alias (300M, 600M, 6B, tiny), Hub repo id, directory or legacy .pth.",
)
@click.option(
    "--sequences",
    type=InputPath(exists=True, dir_okay=False, path_type=Path),
    help="FASTA to use instead of the bundled panel (two-chain and <mask> inputs are derived from it).",
)
@click.option(
    "--report",
    "report_dir",
    type=OutputPath(file_okay=False, path_type=Path),
    help="Write the report here (default: MLX_DIR/validation).",
)
@click.option(
    "--max-length", type=click.IntRange(1), help="Crop sequences to this many residues (faster on big models)."
)
@click.option("--quick", is_flag=True, help="Crop to 256 residues and score 8 positions: a fast first look.")
@click.option(
    "--threshold",
    "threshold",
    multiple=True,
    metavar="NAME=VALUE",
    help="Override a bound (repeatable): weights, fidelity_logits, fidelity_hidden, kl_mean, kl_max, "
    "top1, logits_rel_err, hidden_rel_err, embedding_cosine, spearman; of a fold artifact: weights, ca_rmsd, "
    "lddt_ca, plddt_mae, pae_mae, ptm_error, fidelity_distogram, fidelity_ca, fidelity_atoms, fidelity_plddt, "
    "fidelity_pae, fidelity_ptm.",
)
@click.option(
    "--quality-gate",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Whether quality checks can fail the run; auto: only against a trained reference.",
)
@click.option(
    "--mode",
    type=click.Choice(["auto", "full", "layered"]),
    default="auto",
    show_default=True,
    help="Run whole models or one layer at a time (auto: layered when a model in fp32 "
    "would take more than 25% of RAM).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="MLX compute dtype (default: float32, with TF32 off on CUDA: the reference's own precision).",
)
@click.option("--revision", help="Hub revision of the reference.")
@click.option(
    "--steps",
    type=click.IntRange(1),
    help="Fold artifacts: diffusion sampling steps (default: the model config's inference_num_steps).",
)
@click.option(
    "--loops", type=click.IntRange(0), help="Fold artifacts: recycling loops (default: the model config's num_loops)."
)
@click.option("--samples", type=click.IntRange(1), help="Fold artifacts: diffusion samples per protein (default: 1).")
@reference_device_option
def validate(
    mlx_dir,
    reference,
    sequences,
    report_dir,
    max_length,
    quick,
    threshold,
    quality_gate,
    mode,
    dtype,
    revision,
    steps,
    loops,
    samples,
    reference_device,
):
    fold_options = {k: v for k, v in (("steps", steps), ("loops", loops), ("samples", samples)) if v is not None}
    report = run_validation(
        mlx_dir,
        reference,
        sequences=sequences,
        report_dir=report_dir,
        thresholds=_parse_thresholds(threshold),
        max_length=max_length or (256 if quick else None),
        marginal_positions=8 if quick else 24,
        mode=mode,
        quality_gate=quality_gate,
        compute_dtype=dtype,
        revision=revision,
        progress=True,
        reference_device=reference_device,
        **fold_options,
    )
    click.echo(report.summary())
    click.echo(f"Report: {report.directory / 'report.md'}")
    if not report.passed:
        sys.exit(1)


PUSH_HELP = """Publish MLX_DIR, an MLX model directory (or an SAE folder from quantize-sae, or an adapter
from finetune), to the Hugging Face Hub model repo ORG/NAME, in one commit, with a generated model
card (README.md) and the validation report. Only the artifact's own files are uploaded (plus what
--include names); a link leading out of MLX_DIR, or an access token in any file sent, is refused.

Checks everything before uploading: the artifact is complete, validation/report.json exists and
passed (else refused, unless --allow-unvalidated), a token with write access (HF_TOKEN or
`hf auth login`), and a namespace you can write to. On failure nothing is committed.
Honours HF_ENDPOINT, HF_TOKEN, HF_HOME and HF_HUB_OFFLINE.

\b
Examples:
  esmc-mlx push ESMC-6B-mxfp4-mlx my-org/ESMC-6B-mxfp4
  esmc-mlx push ESMC-6B-mxfp4-mlx my-org/ESMC-6B-mxfp4 --dry-run
  esmc-mlx push ESMC-6B-mxfp4-mlx my-org/ESMC-6B-mxfp4 --create-pr --commit-message "Re-quantize"
  esmc-mlx push ESMC-6B-mxfp4-mlx my-org/ESMC-6B-mxfp4 --include benchmarks.md
"""


@main.command(help=PUSH_HELP)
@click.argument("mlx_dir", type=InputPath(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id", metavar="ORG/NAME")
@click.option("--private", is_flag=True, help="Create the repo private (a repo that exists keeps its visibility).")
@click.option("--revision", metavar="BRANCH", help="Commit to this branch (created from main if new).")
@click.option("--commit-message", help="Commit title (default: names the model, precision and esmc-mlx version).")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to the branch.")
@click.option("--dry-run", is_flag=True, help="Make every check and show the files and model card; upload nothing.")
@click.option(
    "--allow-unvalidated",
    is_flag=True,
    help="Publish even without a passed validation report (the model card says so).",
)
@click.option(
    "--include",
    "include",
    multiple=True,
    metavar="PATH",
    help="Also publish this file (or folder) of MLX_DIR; repeatable. Without it only the artifact's own files go "
    "(a model's config, index, weights and tokenizer files; an SAE's config and layer files; an adapter's config, "
    "weights, head and metrics), its model card and validation report.",
)
def push(mlx_dir, repo_id, private, revision, commit_message, create_pr, dry_run, allow_unvalidated, include):
    result = push_artifact(
        mlx_dir,
        repo_id,
        private=private,
        revision=revision,
        commit_message=commit_message,
        create_pr=create_pr,
        dry_run=dry_run,
        allow_unvalidated=allow_unvalidated,
        include=include,
    )
    click.echo(result.summary())
    if dry_run:
        click.echo("\n--- README.md (model card) ---\n" + result.card)


MODEL_HELP = "MODEL: an MLX model directory (what esmc-convert writes) or a Hub repo id of one."


def echo_resumable(verb: str, s, fasta, stored: str, detail: str = "") -> None:
    """The closing lines of a resumable FASTA job (embed, features): what it computed, on how
    many ranks, and the stored records it dropped."""
    ranks = f" on {s.world_size} ranks" if s.world_size > 1 else ""
    click.echo(
        f"{verb} {plural(s.computed, 'sequence')}{ranks} ({s.skipped} already done, {s.total} in all{detail}) -> {s.out}"
    )
    if s.dropped:
        click.echo(f"Dropped {plural(s.dropped, stored)} of IDs not in {fasta}")


EMBED_HELP = """Embed every sequence of a FASTA file into the directory OUT: for each hidden state
of --layers, each pooling of --pool, all from one forward pass per batch (see docs/scoring.md).
Results are flushed as they come: rerun the same command to resume an interrupted run. The
FASTA is read as a stream (memory does not grow with the file beyond ~100 bytes per record);
sequences are batched by length.

\b
--layers  hidden states: 0 = token embeddings, i = after block i, -1 = final (after the
          last norm); a comma list (6,12,-1) or all. --layer N is the one-layer spelling.
--pool    mean, max (over the residues, <cls>/<eos>/padding excluded), cls (the <cls>
          token's row), per-residue (every residue's row); a comma list. --per-residue
          adds per-residue.
--format  npy: NAME.npy per array (memory-mappable); safetensors: sharded
          embeddings-*.safetensors + index; h5: embeddings.h5 (needs h5py, the h5 extra).
          NAME is the pool for one layer, layer{i}_{pool} for several.

Runs data-parallel under MLX's launcher, each rank taking a slice, rank 0 writing:

\b
  mlx.launch --hosts IP1,IP2 -- esmc-mlx embed ...

\b
Examples:
  esmc-mlx embed esmc-300m-mlx proteome.fasta -o proteome-emb
  esmc-mlx embed esmc-300m-mlx designs.fasta -o designs-emb --layer 20 --per-residue
  esmc-mlx embed esmc-300m-mlx designs.fasta -o designs-emb --layers 6,12,-1 --pool mean,max,cls --format h5
"""


@main.command(help=EMBED_HELP + "\n" + MODEL_HELP)
@click.argument("model")
@click.argument("fasta", type=InputPath(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    required=True,
    type=OutputPath(file_okay=False, path_type=Path),
    help="Output directory (created; an existing one is resumed).",
)
@click.option("--layers", metavar="LIST", help="Hidden states, e.g. 6,12,-1 or all (default: --layer).")
@click.option(
    "--layer",
    type=int,
    default=None,
    help="One hidden state: 0 = token embeddings, i = after block i, -1 = final (after the last norm). [default: -1]",
)
@click.option("--pool", "pools", metavar="LIST", help="Poolings: mean,max,cls,per-residue (default: mean).")
@click.option(
    "--per-residue", is_flag=True, help="Also store every residue's embedding (= adding per-residue to --pool)."
)
@click.option(
    "--format",
    "storage",
    type=click.Choice(["npy", "safetensors", "h5"]),
    default="npy",
    show_default=True,
    help="How the arrays are stored.",
)
@click.option(
    "--batch-tokens",
    type=click.IntRange(1),
    help="Padded tokens per forward pass (rows x longest row). [default: 16384 on a CUDA GPU, "
    "where it gave 1.3-1.6x the sequences per second of 4096 on an H200; 4096 elsewhere]",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16"]),
    default="float32",
    show_default=True,
    help="Storage dtype of the embeddings.",
)
@click.option("--force", is_flag=True, help="Discard what OUT holds and start over.")
@click.option(
    "--drop-missing",
    is_flag=True,
    help="Drop the stored embeddings of IDs that FASTA no longer holds (without it such a rerun is refused).",
)
@keep_nonstandard_option
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def embed(
    model,
    fasta,
    output,
    layers,
    layer,
    pools,
    per_residue,
    storage,
    batch_tokens,
    dtype,
    force,
    drop_missing,
    keep_nonstandard,
    no_progress,
):
    if layer is not None and layers is not None:  # one of them would be ignored: say so instead
        raise click.BadParameter(f"give --layer {layer} or --layers {layers}, not both", param_hint="--layer")
    pool_list = pools.split(",") if pools is not None else ["mean"]  # --pool "": an error, not the default
    if per_residue:
        pool_list.append("per_residue")
    started = time.perf_counter()
    s = embed_fasta(
        model,
        fasta,
        output,
        layers=layers if layers is not None else -1 if layer is None else layer,
        pools=pool_list,
        storage=storage,
        batch_tokens=batch_tokens,
        dtype=dtype,
        force=force,
        drop_missing=drop_missing,
        keep_nonstandard=keep_nonstandard,
        group=World.current(),
        progress=not no_progress,
    )
    if s.rank == 0:
        seconds = f"; {time.perf_counter() - started:.1f} s, the model's loading included"
        echo_resumable("Embedded", s, fasta, "stored embedding", seconds)


SCORE_HELP = """Score mutants against a wild-type sequence and write the CSV back with one column per
method. Mutants are ProteinGym strings in column --mutant-column: A23G (1-based), multi-mutants
A23G:L40P, WT for the wild type. With a --dms-column present, prints Spearman's rho.

\b
Methods (log-probabilities: log_softmax over the full logits row; docs/scoring.md):
  masked-marginal  sum of log p(mut) - log p(wt), each site masked alone (batched)
                   (Meier et al. 2021, ESM-1v)
  wt-marginal      the same read from one unmasked pass over the wild type (Meier et al. 2021)
  pppl             pseudo-perplexity of each mutated sequence (L masked copies each;
                   Salazar et al. 2020)
\b
Multi-mutants (--multi, masked-marginal):
  sum    add the single-site masked marginals (one site masked at a time, as esm's
         variant-prediction predict.py and ProteinGym's ESM scoring do)
  joint  mask all mutated sites together in one copy, sum their log-ratios from it
         (the masked-marginal formula of Meier et al. 2021, conditioned on x_-M)
\b
Long sequences (--window, residues): a wild type longer than the window is scored through
windows of that width: for masked copies, centred on each site (ProteinGym's
scoring_window="optimal"); for wt-marginal, windows every width/2 residues, each site read
from the one whose centre is nearest. Default 2046 = ESMC's 2048-token training length
minus <cls>/<eos>. A warning is printed for sequences longer than that.

Rows are all checked before the model loads; every bad row is reported (file, line,
reason). --skip-invalid scores the others and writes the bad ones to OUT.rejected.csv.
Mutants at X B Z U O (non-standard residues) get empty scores unless --keep-nonstandard.

Time: masked-marginal and wt-marginal cost about (sites + 1) / --batch-size passes; pppl
costs L / --batch-size passes for each distinct mutated sequence (the command prints its time).

Runs data-parallel under MLX's launcher, each rank taking a slice, rank 0 writing:

\b
  mlx.launch --hosts IP1,IP2 -- esmc-mlx score ...

\b
Examples:
  esmc-mlx score esmc-300m-mlx --sequence MKTAYIAKQR... --mutations BLAT_ECOLX.csv
  esmc-mlx score esmc-300m-mlx --sequence wt.fasta --mutations dms.csv -o scored.csv --method pppl
  esmc-mlx score esmc-300m-mlx --sequence wt.fasta --mutations multi.csv --multi joint
"""

window_option = click.option(
    "--window",
    default=DEFAULT_WINDOW,
    show_default=True,
    type=click.IntRange(0),
    help="Score sequences longer than this many residues through windows of this width: centred on each "
    "masked site (ProteinGym's scoring_window), overlapping by half for wt-marginal; 0: never window.",
)


@main.command(help=SCORE_HELP + "\n" + MODEL_HELP)
@click.argument("model")
@click.option("--sequence", required=True, help="The wild type. " + SEQUENCE_OPTION)
@click.option(
    "--mutations",
    required=True,
    type=InputPath(exists=True, dir_okay=False, path_type=Path),
    help="CSV with a column of mutant strings.",
)
@click.option(
    "-o",
    "--output",
    type=OutputPath(dir_okay=False, path_type=Path),
    help="Scored CSV (default: <mutations>.scored.csv beside the input; needed when --mutations is a pipe). "
    "An existing file is replaced only if esmc-mlx wrote it and it is unchanged since, else with --force.",
)
@click.option(
    "--method",
    "methods",
    multiple=True,
    type=click.Choice(["masked-marginal", "wt-marginal", "pppl"]),
    help="Repeat for several (default: masked-marginal and wt-marginal).",
)
@click.option(
    "--multi",
    type=click.Choice(["sum", "joint"]),
    default="sum",
    show_default=True,
    help="Multi-mutants under masked-marginal: sum of single-site marginals, or joint masking of all sites.",
)
@window_option
@click.option(
    "-B", "--batch-size", default=32, show_default=True, type=click.IntRange(1), help="Masked copies per forward pass."
)
@click.option(
    "--offset", default=1, show_default=True, help="Number of the sequence's first residue in the mutant strings."
)
@click.option("--mutant-column", default="mutant", show_default=True, help="CSV column of the mutant strings.")
@click.option("--dms-column", default="DMS_score", show_default=True, help="Measured scores, for Spearman's rho.")
@click.option(
    "--skip-invalid",
    is_flag=True,
    help="Score the valid rows and write the invalid ones, with line and reason, to OUT.rejected.csv "
    "(default: report every invalid row and score nothing).",
)
@keep_nonstandard_option
@click.option(
    "--force", is_flag=True, help="Replace an existing output CSV that esmc-mlx did not write (yours, or edited since)."
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def score(
    model,
    sequence,
    mutations,
    output,
    methods,
    multi,
    window,
    batch_size,
    offset,
    mutant_column,
    dms_column,
    skip_invalid,
    keep_nonstandard,
    force,
    no_progress,
):
    if output is None and not mutations.is_file():  # a pipe (<(...), /dev/stdin) has no folder to write beside
        raise click.BadParameter(
            f"{mutations} is not a regular file, so there is no folder beside it for <mutations>.scored.csv; "
            "name the output with -o FILE",
            param_hint="--mutations",
        )
    output = output or mutations.with_name(mutations.name.removesuffix(".csv") + ".scored.csv")
    methods = [m.replace("-", "_") for m in methods] or ["masked_marginal", "wt_marginal"]
    s = score_csv(
        model,
        sequence,
        mutations,
        output,
        methods=methods,
        batch_size=batch_size,
        offset=offset,
        multi=multi,
        window=window or None,
        mutant_column=mutant_column,
        dms_column=dms_column,
        skip_invalid=skip_invalid,
        keep_nonstandard=keep_nonstandard,
        force=force,
        group=World.current(),
        progress=not no_progress,
    )
    if s.rank == 0:
        ranks = f" on {s.world_size} ranks" if s.world_size > 1 else ""
        click.echo(
            f"Scored {plural(s.count, 'mutant')} ({', '.join(s.methods)}; {plural(s.passes, 'forward pass')}{ranks}, "
            f"{s.seconds:.1f} s) -> {s.out}"
        )
        if s.skipped:
            click.echo(f"Left {plural(s.skipped, 'mutant')} at non-standard residues unscored (empty cells)")
        if s.rejects_out is not None:
            click.echo(f"Rejected {plural(len(s.rejected), 'invalid row')} -> {s.rejects_out}")
        elif s.rejected:  # the output is a stream (-o /dev/stdout): nowhere beside it, so on stderr
            click.echo(f"Rejected {plural(len(s.rejected), 'invalid row')}:", err=True)
            for r in s.rejected:
                click.echo(f"  {r}", err=True)
        if s.wt_pppl is not None:
            click.echo(f"Wild-type pseudo-perplexity: {s.wt_pppl:.4f}")
        for method, (rho, n) in s.spearman.items():
            click.echo(f"Spearman {method} vs {s.dms_column}: {rho:.4f} (n={n})")


SCAN_HELP = """Saturation scan: score every single substitution of a protein (19 per residue) and
write, per protein, into OUT:

\b
  NAME_scan.csv      one row per variant: mutant, position, wt, mut, the score (a column
                     named by --method: masked_marginal or wt_marginal), entropy
  NAME_matrix.npy    n x 20 float32 scores, one row per position scanned (n = L, less the
                     gaps, chain breaks and, unless --keep-nonstandard, X B Z U O positions),
                     columns ACDEFGHIKLMNPQRSTVWY, wild type = 0
  NAME_matrix.csv    the same rows with position, wt and entropy columns (which rows they are)
  NAME_heatmap.png   positions x amino acids, wild type dotted, 100 positions per row

Scores are log p(mut) - log p(wt): masked-marginal (default; one masked copy per residue,
--batch-size copies a pass, each giving all 19 substitutions) or wt-marginal (one unmasked
passes over overlapping windows when longer than --window). Entropy: of the predicted
distribution over the 20 amino acids (renormalised), in nats, at each position. NAME is the
FASTA ID (--fasta, or --sequence naming a FASTA file), else --name, else "sequence", made
file-safe. Positions at X B Z U O are left out unless --keep-nonstandard. See docs/scoring.md.

OUT/scan-manifest.json records what each protein was scanned from: a rerun skips the proteins
already there with the same sequence, settings and model, so a stopped --fasta run resumes.

Runs data-parallel under MLX's launcher (ranks split the passes, rank 0 writes):

\b
  mlx.launch --hosts IP1,IP2 -- esmc-mlx scan ...

\b
Examples:
  esmc-mlx scan esmc-300m-mlx --sequence MKTAYIAKQRQISFVKSHFSRQ -o scan
  esmc-mlx scan esmc-300m-mlx --fasta designs.fasta -o scans --method wt-marginal
"""


@main.command(help=SCAN_HELP + "\n" + MODEL_HELP)
@click.argument("model")
@click.option("--sequence", help=SEQUENCE_OPTION)
@click.option(
    "--fasta",
    type=InputPath(exists=True, dir_okay=False, path_type=Path),
    help="Scan every record of this FASTA file.",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=OutputPath(file_okay=False, path_type=Path),
    help="Output directory (created).",
)
@click.option(
    "--method",
    type=click.Choice(["masked-marginal", "wt-marginal"]),
    default="masked-marginal",
    show_default=True,
    help="masked-marginal: one masked copy per residue; wt-marginal: unmasked passes (see above).",
)
@click.option(
    "--name",
    default=None,
    help="File name stem for --sequence (default: the FASTA ID of --sequence FILE, else sequence; not with --fasta).",
)
@window_option
@click.option(
    "-B", "--batch-size", default=32, show_default=True, type=click.IntRange(1), help="Masked copies per forward pass."
)
@click.option("--offset", default=1, show_default=True, help="Number of the first residue (axis labels, CSV).")
@click.option(
    "--per-row",
    default=100,
    show_default=True,
    type=click.IntRange(10),
    help="Heatmap positions per row before wrapping.",
)
@click.option("--no-plot", is_flag=True, help="No heatmap (needs no matplotlib).")
@keep_nonstandard_option
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--force",
    is_flag=True,
    help="Scan again the proteins that OUT already holds from the same sequence, settings and model "
    "(by default they are skipped: a stopped run resumes).",
)
def scan(
    model,
    sequence,
    fasta,
    output,
    method,
    name,
    window,
    batch_size,
    offset,
    per_row,
    no_plot,
    keep_nonstandard,
    no_progress,
    force,
):
    s = scan_job(
        model,
        output,
        sequence=sequence,
        fasta=fasta,
        name=name,
        method=method.replace("-", "_"),
        batch_size=batch_size,
        window=window or None,
        offset=offset,
        plot=not no_plot,
        per_row=per_row,
        keep_nonstandard=keep_nonstandard,
        group=World.current(),
        progress=not no_progress,
        force=force,
    )
    if s.rank == 0:
        ranks = f" on {s.world_size} ranks" if s.world_size > 1 else ""
        for ident in s.skipped:
            click.echo(f"Skipped {ident}: already scanned into {s.out} with these settings (--force scans again)")
        for ident, n, passes, seconds in s.scanned:
            click.echo(
                f"Scanned {ident}: {plural(n, 'residue')} x 19 substitutions "
                f"({plural(passes, 'forward pass')}{ranks}, {seconds:.1f} s)"
            )
        click.echo(f"Wrote {s.out}")


FEATURES_HELP = """Sparse autoencoder (SAE) features of every residue: the k active features of
each residue's hidden state at --layer, from an SAE in the published ESMC format (a folder or a
Hub repo such as biohub/esmc-6b-2024-12-sae-k64-codebook16384; only the layers used are
downloaded). One forward pass per batch serves every --layer and stops at the deepest one.

\b
OUT holds (rerun the same command to resume; see docs/interpretability.md):
  layer{N}_indices.npy, layer{N}_values.npy   (residues, k) int32 / float32, one row per
                                              residue (offsets.npy, index.tsv: which record)
  summary.csv        per protein and layer: its --top features, residues active, mean and
                     max activation, where the maximum is, every residue it fires at
  heatmap_<id>.png   the top features along the sequence (default: with --sequence only)

Runs data-parallel under MLX's launcher, each rank taking a slice, rank 0 writing:

\b
  mlx.launch --hosts IP1,IP2 -- esmc-mlx features ...

\b
Examples:
  esmc-mlx features esmc-6b-mlx --sae biohub/esmc-6b-2024-12-sae-k64-codebook16384 --layer 60 \\
      --sequence MKTAYIAKQRQISFVKSHFSRQ -o feats
  esmc-mlx features esmc-6b-mlx --sae my-sae --layer 36 --layer 60 --fasta proteome.fasta -o feats --normalize
"""


@main.command(help=FEATURES_HELP + "\n" + MODEL_HELP)
@click.argument("model")
@click.option(
    "--sae", required=True, help="The SAE: a folder, a Hub repo id, or tiny (the packaged SAE on esmc-tiny's layer 4)."
)
@click.option("--sequence", help=SEQUENCE_OPTION)
@click.option(
    "--fasta", type=InputPath(exists=True, dir_okay=False, path_type=Path), help="Every record of this FASTA file."
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=OutputPath(file_okay=False, path_type=Path),
    help="Output directory (created; an existing one is resumed).",
)
@click.option(
    "--layer",
    "layers",
    type=int,
    multiple=True,
    help="Backbone hidden state the SAE reads (repeat for several). [default: the SAE's only layer]",
)
@click.option("--normalize", is_flag=True, help="Scale each feature by idf / max (esm's normalize_sae).")
@click.option(
    "--top", default=10, show_default=True, type=click.IntRange(1), help="Features per protein in summary and heatmap."
)
@click.option("--name", default=None, help="Record name for --sequence (default: sequence; not with --fasta).")
@click.option("--plot/--no-plot", default=None, help="Draw heatmaps. [default: with --sequence only]")
@click.option("--batch-tokens", type=click.IntRange(1), help="Padded tokens per forward pass (as embed's).")
@click.option("--force", is_flag=True, help="Discard what OUT holds and start over.")
@click.option("--drop-missing", is_flag=True, help="Drop the stored features of IDs that FASTA no longer holds.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def features(
    model,
    sae,
    sequence,
    fasta,
    output,
    layers,
    normalize,
    top,
    name,
    plot,
    batch_tokens,
    force,
    drop_missing,
    no_progress,
):
    s = features_job(
        model,
        sae,
        output,
        sequence=sequence,
        fasta=fasta,
        name=name,
        layers=list(layers) or None,
        normalize=normalize,
        top=top,
        plot=plot,
        batch_tokens=batch_tokens,
        force=force,
        drop_missing=drop_missing,
        group=World.current(),
        progress=not no_progress,
    )
    if s.rank == 0:
        echo_resumable("Encoded", s, fasta, "stored record")
        if s.heatmaps:
            click.echo(f"Drew {plural(s.heatmaps, 'heatmap')}")


ATTENTION_HELP = """Attention maps of a protein: every head of every --layers block, as
model(..., output_attentions=True) gives them, and their mean made symmetric and APC-corrected
over the residues (an unsupervised contact map). Blocks run one at a time and each block's maps
are written a few heads at a time, so memory stays bounded for long proteins.

\b
OUT holds, per protein (<name> is its FASTA ID or --name; see docs/interpretability.md):
  <name>_layer{N}.npy     (heads, T, T) float32 over every token (<cls>, residues, <eos>)
  <name>_contacts.npy     (L, L) float32 over the residues; <name>_contacts.png
A protein already in OUT with the same sequence, settings and model is skipped.
The maps of one block take 4 x heads x (L + 2)^2 bytes: 240 MB for 2,000 residues on the 300M.

\b
Examples:
  esmc-mlx attention esmc-300m-mlx --sequence MKTAYIAKQRQISFVKSHFSRQ -o attn
  esmc-mlx attention esmc-300m-mlx --fasta designs.fasta -o attn --layers 20,25,-1 --heads 0,3
"""


@main.command(help=ATTENTION_HELP + "\n" + MODEL_HELP)
@click.argument("model")
@click.option("--sequence", help=SEQUENCE_OPTION)
@click.option(
    "--fasta", type=InputPath(exists=True, dir_okay=False, path_type=Path), help="Every record of this FASTA file."
)
@click.option(
    "-o", "--output", required=True, type=OutputPath(file_okay=False, path_type=Path), help="Output directory."
)
@click.option("--layers", metavar="LIST", help="Blocks 1..n, e.g. 1,15,-1 (-1 = the last). [default: all]")
@click.option("--heads", metavar="LIST", help="Heads 0..H-1, e.g. 0,3,7. [default: all]")
@click.option("--apc/--no-apc", default=True, show_default=True, help="APC-correct the mean map.")
@click.option("--name", default=None, help="File name stem for --sequence (default: sequence; not with --fasta).")
@click.option("--no-plot", is_flag=True, help="No PNG (needs no matplotlib).")
@click.option("--force", is_flag=True, help="Write again the proteins OUT already holds.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def attention(model, sequence, fasta, output, layers, heads, apc, name, no_plot, force, no_progress):
    s = attention_job(
        model,
        output,
        sequence=sequence,
        fasta=fasta,
        name=name,
        layers=layers,
        heads=heads,
        use_apc=apc,
        plot=not no_plot,
        force=force,
        progress=not no_progress,
    )
    for ident in s.skipped:
        click.echo(f"Skipped {ident}: already in {s.out} with these settings (--force writes it again)")
    for maps in s.written:
        blocks = sum(kind.startswith("layer") for kind in maps.files)
        click.echo(
            f"Wrote {maps.name}: {plural(maps.residues, 'residue')}, {plural(blocks, 'layer')} of maps "
            f"({human_size(maps.nbytes)})"
        )
    click.echo(f"Wrote {s.out}")


FOLD_HELP = """Predict the structure of each protein or complex of [FASTA], a FASTA file (or of one
--sequence instead), with an ESMFold2 model, into the folder OUT. Chains of a complex are separated by | in a record or in
--sequence (MKTAYIAKQR|GSHMSLFDKLG). The 20 amino acids and X fold; B Z U O fold as X.

\b
OUT holds, per record (ID: its FASTA ID, or --name, made file-safe):
  ID.pdb             the best-ranked sample (highest pTM), pLDDT (0-100) as B-factors;
                     ID.cif with --format cif (mmCIF)
  ID_sample{k}.pdb   with --samples N > 1, every sample k = 0..N-1 (the best also as ID.pdb)
  ID_pae.npy         (L, L) float32: the best sample's predicted aligned error (angstrom)
  ID_pae.png         that matrix drawn (with matplotlib installed: the plot extra)
  summary.csv        id, length, chains, mean_plddt (0-100), ptm, iptm (complexes), seconds,
                     sample (the best's k)
Rerun the same command to resume: records already folded with the same model and settings
are skipped. A record that cannot fit in this machine's memory is refused before any fold.

\b
Examples:
  esmc-mlx fold esmfold2-fast-mlx --sequence MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ -o folds
  esmc-mlx fold esmfold2-fast-mlx complexes.fasta -o folds --samples 5 --format cif
  esmc-mlx fold esmfold2-fast-mlx designs.fasta -o folds --steps 20 --loops 3 --seed 1
"""
FOLD_MODEL_HELP = (
    "MODEL: a fold artifact (what esmc-convert writes from an ESMFold2 checkpoint), as a directory or a Hub repo id. "
    "esmc-convert tiny-fold -o tiny-fold makes one with random folding weights, to try the command offline (its "
    "structures are meaningless)."
)


@main.command(help=FOLD_HELP + "\n" + FOLD_MODEL_HELP)
@click.argument("model")
@click.argument("fasta", required=False, type=InputPath(exists=True, dir_okay=False, path_type=Path))
@click.option("--sequence", help="One protein or complex (chains separated by |), or a FASTA file holding one record.")
@click.option(
    "-o",
    "--output",
    required=True,
    type=OutputPath(file_okay=False, path_type=Path),
    help="Output directory (created; an existing one is resumed).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["pdb", "cif"]),
    default="pdb",
    show_default=True,
    help="Structure files: PDB or mmCIF (mmCIF has no limit on chains, atoms or residues).",
)
@click.option(
    "--samples",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Diffusion samples per record; the best (highest pTM) is ID.pdb, all are kept when more than 1.",
)
@click.option("--steps", type=click.IntRange(1), help="Diffusion sampling steps. [default: the model's]")
@click.option("--loops", type=click.IntRange(0), help="Trunk recycling loops. [default: the model's]")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Seeds every random draw of each record's fold.",
)
@click.option(
    "--name",
    default=None,
    help="File name stem for --sequence (default: the FASTA ID of --sequence FILE, else sequence).",
)
@click.option("--force", is_flag=True, help="Discard what OUT holds and start over.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def fold(model, fasta, sequence, output, fmt, samples, steps, loops, seed, name, force, no_progress):
    started = time.perf_counter()
    s = fold_job(
        model,
        output,
        sequence=sequence,
        fasta=fasta,
        name=name,
        samples=samples,
        steps=steps,
        loops=loops,
        seed=seed,
        fmt=fmt,
        force=force,
        progress=not no_progress,
    )
    if len(s.folded) <= 10:
        for record in s.folded:
            click.echo(f"Folded {record.text}")
    if s.skipped:
        click.echo(f"Skipped {plural(s.skipped, 'record')}: already folded in {s.out} with this model and settings")
    seconds = f"; {time.perf_counter() - started:.1f} s, the model's loading included"
    echo_resumable("Folded", s, fasta, "structure", seconds)
    if s.folded or s.skipped:
        click.echo(f"Scores of every structure: {s.summary}")


QUANTIZE_SAE_HELP = """Store a sparse autoencoder's matrices in bfloat16 / float16 (--q bf16, fp16) or
8-bit (--q 8), one layer at a time, and validate the result against the original on the
validation panel through the backbone (--model): top-k agreement and value error per layer,
bounded as docs/validation.md says. The report goes to OUT/validation/; OUT is put in place only
when it passed. Publish it with `esmc-mlx push OUT ORG/NAME`.

\b
SAE: a folder in the published ESMC SAE format, or a Hub repo id.

\b
Examples:
  esmc-mlx quantize-sae biohub/esmc-6b-2024-12-sae-k64-codebook16384 -o sae-6b-8bit --q 8 \\
      --model esmc-6b-mlx --layers 60
  esmc-mlx quantize-sae my-sae -o my-sae-bf16 --q bf16 --model esmc-300m-mlx
"""


@main.command(name="quantize-sae", help=QUANTIZE_SAE_HELP)
@click.argument("sae")
@click.option("-o", "--output", required=True, type=OutputPath(file_okay=False, path_type=Path), help="Output folder.")
@click.option("--q", "q", metavar="SPEC", required=True, help="bf16, fp16 or 8.")
@click.option("--model", help="The backbone (MLX model folder or Hub id) whose hidden states the SAE reads.")
@click.option("--layers", metavar="LIST", help="Layers to keep, e.g. 36,60. [default: all]")
@click.option("--group-size", type=int, help="Group size of --q 8: 32, 64 (default) or 128.")
@click.option("--revision", help="Hub revision of SAE.")
@click.option(
    "--validate/--no-validate", "validate_output", default=True, show_default=True, help="Validate the result."
)
@force_option
def quantize_sae(sae, output, q, model, layers, group_size, revision, validate_output, force):
    try:
        chosen = None if layers is None else [int(x) for x in layers.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{layers!r}: give comma-separated layer numbers like 36,60", param_hint="--layers"
        ) from None
    quantize_validate_sae(
        sae,
        output,
        q=q,
        model=model,
        group_size=group_size,
        layers=chosen,
        revision=revision,
        force=force,
        validate_output=validate_output,
        log=click.echo,
    )


BENCH_HELP = """Time the MLX runtime against transformers on this machine: the same random weights,
the same inputs, each side in its own process. The torch side runs eager and with each block
compiled by torch.compile (--torch; compiled by default on a GPU only: on a CPU inductor's C++
builds take minutes); its compile time is printed apart from its timings. Prints each side's
milliseconds and TFLOP/s and torch time / MLX time against each torch mode, and writes
OUT/bench.json (with the source commit and the device: `python -m benchmarks.compare` reads
two of them) and OUT/bench.png (the plot needs matplotlib). Needs the torch extra for the torch
side (without it, or with --no-torch, MLX alone: its times are plotted).

\b
Examples:
  esmc-mlx bench                                  # 300M; CPU: 1x256,8x256 fp32; GPU: 4 shapes bf16
  esmc-mlx bench --model 6B --shapes 16x256 --quant mxfp4 --quant affine4
  esmc-mlx bench --torch eager,compiled           # on a CPU too
"""


@main.command(help=BENCH_HELP)
@click.option(
    "--model",
    "models",
    multiple=True,
    type=click.Choice(["tiny", "300M", "600M", "6B"]),
    help="Model shape(s), random weights (default: 300M).",
)
@click.option("--shapes", help="BATCHxLENGTH list, e.g. 1x256,8x256 (default: per backend).")
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "gpu"]),
    default="auto",
    show_default=True,
    help="Where MLX runs (auto: the GPU when MLX has one, else the CPU).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="Compute dtype (default: float32 on the CPU, bfloat16 on a GPU).",
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(["mlx", "mlx+fuse", "mlx+compile", "mlx+fuse+compile"]),
    help="MLX runtime variant(s) (default: what load() gives on the device).",
)
@click.option(
    "--quant",
    multiple=True,
    type=click.Choice(["affine8", "affine4", "mxfp4"]),
    help="Also time a quantized twin against the float model, interleaved with it; prints quantized time / float "
    f"time, and a note at shapes where the float model's own time moved by more than {FLOAT_SPREAD - 1:.0%} during the run "
    "(host-bound shapes, such as batch 1 on a GPU: their ratios move with the machine).",
)
@click.option(
    "--torch",
    "torch_modes",
    metavar="eager,compiled",
    help="How the torch side runs: eager, compiled (each transformer block through torch.compile), or "
    "both (default: both on a GPU, eager on a CPU).",
)
@click.option("--no-torch", is_flag=True, help="Time MLX only.")
@click.option(
    "-o",
    "--out",
    "out_dir",
    default="bench-results",
    show_default=True,
    type=OutputPath(file_okay=False, path_type=Path),
    help="Folder for bench.json and bench.png.",
)
def bench(models, shapes, device, dtype, variants, quant, torch_modes, no_torch, out_dir):
    try:
        parsed = parse_shapes(shapes) if shapes is not None else None  # --shapes "": an error, not the default
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shapes") from None
    try:
        modes = parse_torch_modes(torch_modes) if torch_modes is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--torch") from None
    run(
        models=models or ("300M",),
        shapes=parsed,
        device=device,
        dtype=dtype,
        variants=variants or None,
        quant=quant,
        out_dir=out_dir,
        with_torch=not no_torch,
        log=click.echo,
        torch_modes=modes,
    )


FINETUNE_HELP = """Fine-tune MODEL on the labeled sequences of a CSV: LoRA adapters (mlx-lm's layers)
and a task head, written to the adapter directory OUT (docs/finetune.md). MODEL may be float or
quantized: a quantized base stays packed (QLoRA), adapters and head train in float32.

\b
--task classification  one label per sequence (any text); accuracy
       regression      a number per sequence; Spearman's rho
       per-residue     a label string as long as the sequence ("HHHEEC..."), or 1-based
                       positions of class 1 ("3,17,18"; the others class 0); accuracy
                       over residues

OUT holds adapters.safetensors, head.safetensors, adapter_config.json (the base named by
repo id, revision and sha256 of its weights; the settings), metrics.json and metrics.png
(loss and metric per epoch) and a card. With --valid, the kept weights are those of the epoch
with the lowest validation loss and training stops after --patience epochs without
improvement. A checkpoint is written every epoch and every --save-every steps: run the same
command again to resume a killed run.

\b
Examples:
  esmc-mlx finetune 300M --train train.csv --valid valid.csv -o my-adapter
  esmc-mlx finetune esmc-6b-4bit --train tm.csv --task regression --label-column tm -o tm-adapter
  esmc-mlx finetune 300M --train ss.csv --task per-residue --lora-layers 8 --gradient-checkpointing -o ss
  esmc-mlx predict my-adapter --fasta proteins.fasta -o predictions.csv
"""


@main.command(name="finetune", help=FINETUNE_HELP + "\n" + MODEL_HELP)
@click.argument("model")
@click.option(
    "--train",
    "train_csv",
    required=True,
    type=InputPath(exists=True, dir_okay=False, path_type=Path),
    help="Training CSV.",
)
@click.option(
    "--valid",
    "valid_csv",
    type=InputPath(exists=True, dir_okay=False, path_type=Path),
    help="Validation CSV (early stopping, the kept epoch).",
)
@click.option(
    "-o", "--output", type=OutputPath(file_okay=False, path_type=Path), required=True, help="Adapter directory."
)
@click.option(
    "--task", type=click.Choice(TASKS), default="classification", show_default=True, help="What the labels are."
)
@click.option("--sequence-column", default="sequence", show_default=True, help="CSV column of the sequences.")
@click.option("--label-column", default="label", show_default=True, help="CSV column of the labels.")
@click.option(
    "--lora-rank",
    type=click.IntRange(1),
    default=FINETUNE_DEFAULTS["lora_rank"],
    show_default=True,
    help="Rank of the low-rank update of each adapted projection.",
)
@click.option("--lora-layers", default="all", show_default=True, help="Adapt this many blocks from the top, or all.")
@click.option(
    "--lora-scale",
    type=float,
    default=FINETUNE_DEFAULTS["lora_scale"],
    show_default=True,
    help="Multiplier of the low-rank update (peft's alpha / rank).",
)
@click.option(
    "--head",
    type=click.Choice(HEADS),
    default="linear",
    show_default=True,
    help="The task head: one linear layer, or linear-GELU-linear.",
)
@click.option(
    "--pool",
    type=click.Choice(POOLS),
    default="mean",
    show_default=True,
    help="Sequence tasks: mean over the residues, or the <cls> token.",
)
@click.option(
    "--epochs",
    type=click.IntRange(1),
    default=FINETUNE_DEFAULTS["epochs"],
    show_default=True,
    help="Passes over the training CSV (at most: --patience may stop earlier).",
)
@click.option(
    "--learning-rate",
    type=float,
    default=FINETUNE_DEFAULTS["learning_rate"],
    show_default=True,
    help="AdamW's learning rate, for the adapters and the head.",
)
@click.option(
    "--batch-tokens",
    type=click.IntRange(1),
    default=FINETUNE_DEFAULTS["batch_tokens"],
    show_default=True,
    help="Padded tokens per training step (rows x longest row).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Adapter initialisation and batch order.")
@click.option(
    "--patience",
    type=click.IntRange(0),
    default=FINETUNE_DEFAULTS["patience"],
    show_default=True,
    help="With --valid: stop after this many epochs without a lower validation loss (0: never).",
)
@click.option(
    "--gradient-checkpointing",
    is_flag=True,
    help="Recompute each block's activations in the backward pass: less memory for long inputs.",
)
@click.option(
    "--grad-accumulation-steps",
    type=click.IntRange(1),
    default=FINETUNE_DEFAULTS["grad_accumulation_steps"],
    show_default=True,
    help="Batches whose gradients are averaged into one update: N x --batch-tokens tokens an update "
    "at the memory of one batch.",
)
@click.option(
    "--save-every",
    type=click.IntRange(0),
    default=FINETUNE_DEFAULTS["save_every"],
    show_default=True,
    help="Also checkpoint every N steps within an epoch (0: at epoch ends only).",
)
@click.option(
    "--memory-limit",
    type=click.FloatRange(0, min_open=True),
    metavar="GB",
    help="Memory MLX may hold before it waits for queued GPU work. Default: 0.7 x the GPU's memory "
    "(12 GB on a 16 GB Mac); on the CPU, MLX's own.",
)
@click.option("--revision", help="Hub revision of MODEL.")
@click.option("--force", is_flag=True, help="Discard what OUT holds (a run with other settings) and start over.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def finetune_command(model, train_csv, valid_csv, output, lora_layers, no_progress, **options):
    layers = lora_layers if lora_layers == "all" else _int_option(lora_layers, "--lora-layers", "a number or all")
    s = finetune(model, train_csv, output, valid=valid_csv, lora_layers=layers, progress=not no_progress, **options)
    if s.already_done:
        click.echo(f"{s.out} already holds this finished run; nothing to train (--force starts over)")
        return
    resumed = f" (resumed at {s.resumed_from})" if s.resumed_from else ""
    last = s.history[-1] if s.history else {}
    shown = ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k != "epoch" and v is not None)
    click.echo(
        f"Trained {plural(len(s.history), 'epoch')}{resumed} -> {s.out}" + (f"; last epoch: {shown}" if shown else "")
    )
    if s.best_epoch is not None:
        click.echo(
            f"Kept the weights of epoch {s.best_epoch} (lowest validation loss)"
            + (", stopped early" if s.stopped_early else "")
        )


def _int_option(text: str, option: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: give {what}", param_hint=option) from None


PREDICT_HELP = """Predict with ADAPTER (a directory esmc-mlx finetune wrote, or its Hub repo) for
one sequence, every record of a FASTA file, or every row of a CSV, and write PRED.csv: the
input's rows with a prediction column (classification: also p_CLASS, each class's
probability; per-residue: a label per residue). The base model is the one the adapter names,
checked by sha256 (--base: a local copy of it).

--fuse DIR writes the adapters merged into the base as a float MLX model directory (a
quantized base is dequantized) that every other command loads; the task head stays in the
adapter.

\b
Examples:
  esmc-mlx predict my-adapter --sequence MKTAYIAKQRQISFVKSHFSRQ -o pred.csv
  esmc-mlx predict my-org/esmc-300m-solubility --csv designs.csv -o designs-pred.csv
  esmc-mlx predict my-adapter --fuse esmc-300m-adapted
"""


@main.command(help=PREDICT_HELP)
@click.argument("adapter")
@click.option("--sequence", help=SEQUENCE_OPTION)
@click.option("--fasta", type=InputPath(exists=True, dir_okay=False, path_type=Path), help="A FASTA file.")
@click.option("--csv", "csv_path", type=InputPath(exists=True, dir_okay=False, path_type=Path), help="A CSV file.")
@click.option("--sequence-column", default="sequence", show_default=True, help="--csv's column of the sequences.")
@click.option(
    "-o",
    "--output",
    type=OutputPath(dir_okay=False, path_type=Path),
    help="The predictions CSV. An existing file is replaced only if esmc-mlx wrote it and it is unchanged "
    "since, else with --force.",
)
@click.option(
    "--batch-tokens", type=click.IntRange(1), default=4096, show_default=True, help="Padded tokens per forward pass."
)
@click.option("--base", help="The base model (a local directory or repo id) instead of the one the adapter names.")
@click.option(
    "--fuse", "fuse_dir", type=OutputPath(file_okay=False, path_type=Path), help="Write the merged model here."
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing -o CSV that esmc-mlx did not write (yours, or edited since); with --fuse, an "
    "existing directory esmc-mlx wrote.",
)
def predict(adapter, sequence, fasta, csv_path, sequence_column, output, batch_tokens, base, fuse_dir, force):
    inputs = [x for x in (sequence, fasta, csv_path) if x is not None]
    if fuse_dir is None and output is None:
        raise click.UsageError("give -o PRED.csv (with --sequence, --fasta or --csv), or --fuse DIR")
    if output is not None or inputs:
        if output is None:
            raise click.UsageError("give -o PRED.csv for the predictions")
        s = predict_csv(
            adapter,
            output,
            sequence=sequence,
            fasta=fasta,
            csv_path=csv_path,
            sequence_column=sequence_column,
            batch_tokens=batch_tokens,
            base=base,
            force=force,
        )
        click.echo(f"Predicted {plural(s.count, 'sequence')} ({s.task}) -> {s.out}")
    if fuse_dir is not None:
        path = fuse_adapter(adapter, fuse_dir, base=base, force=force)
        click.echo(f"Wrote the adapted model (adapters merged into the base) -> {path}")


BUILD_CUTLASS_HELP = """Build CUTLASS's Hopper mixed-input GEMM (an MLX extension) for this MLX and Python
into esmc-mlx's cache (a few minutes: docs/quantization.md gives the measured time). On a Hopper
GPU (H100, H200) affine 4/8-bit and mxfp4 models then run it where it was measured faster
(esmc-mlx info MODEL --plan shows where); ESMC_MLX_KERNELS=0 turns every custom kernel off.
Needs nvcc (CUDA 13), nanobind 3.0/3.1 (the `cutlass` extra) and fmt's headers
(torch's copy, libfmt-dev or $FMT_INCLUDE).
"""


@main.command(name="build-cutlass", help=BUILD_CUTLASS_HELP)
@click.option("--nvcc", default="nvcc", show_default=True, help="The CUDA compiler to run.")
def build_cutlass(nvcc):
    path = cutlass_qmm.build(nvcc, log=click.echo)
    click.echo(f"Built {path}. Quantized models use it from now on (esmc-mlx info MODEL --plan shows where).")


if __name__ == "__main__":
    main()
