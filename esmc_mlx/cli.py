"""Command line: parse, call the library, print. No work of its own happens here."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from . import __version__
from .errors import EsmcMlxError

SOURCE_HELP = "SOURCE: an alias (300M, 600M, 6B, tiny), a Hub repo id, a local directory or a legacy .pth file."


class FriendlyErrors(click.Group):
    """Turn the library's errors into `Error: message` and exit code 1, without a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EsmcMlxError as e:
            raise click.ClickException(str(e)) from None


def _friendly(command):
    """Same as FriendlyErrors, for the stand-alone `esmc-convert` command."""
    original = command.invoke

    def invoke(ctx):
        try:
            return original(ctx)
        except EsmcMlxError as e:
            raise click.ClickException(str(e)) from None

    command.invoke = invoke
    return command


def _command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])


def _default_out(source: str, q: str | None, dtype: str | None) -> Path:
    stem = Path(source.rstrip("/")).name.removesuffix(".pth") or "model"
    if not stem.lower().startswith("esmc"):
        stem = f"ESMC-{stem}"
    return Path(f"{stem}-{q}-mlx" if q else f"{stem}-{dtype}-mlx" if dtype else f"{stem}-mlx")


convert_options = [
    click.argument("source"),
    click.option("-o", "--output", "output", type=click.Path(path_type=Path),
                 help="Output directory (default: ESMC-<name>[-<q>]-mlx in the current directory)."),
    click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
                 help="Float dtype of the output (default: the source's)."),
    click.option("--q", "q", metavar="SPEC",
                 help="Quantize: 8 6 5 4 3 2 (affine bits), mxfp4, mxfp8, nvfp4, or a mixed recipe "
                      "(mixed_2_6 mixed_3_4 mixed_3_6 mixed_4_6 mixed_4_8)."),
    click.option("--group-size", type=int, help="Affine group size: 32, 64 (default) or 128."),
    click.option("--revision", help="Hub revision (branch, tag or commit) of the source."),
    click.option("--force", is_flag=True, help="Replace an existing output directory."),
    click.option("--shard-size", default="1GB", show_default=True,
                 help="Largest safetensors shard; bounds the converter's memory."),
]


def _apply(options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def _parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}
    text = text.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * factor)
    if text.isdigit():
        return int(text)
    raise click.BadParameter(f"{text!r}: use a size like 512MB or 2GB", param_hint="--shard-size")


def run_convert(source, output, dtype, q, group_size, revision, force, shard_size, **_):
    from .convert import convert

    out = output or _default_out(source, q, dtype)
    convert(source, out, dtype=dtype, q=q, group_size=group_size, revision=revision, force=force,
            shard_bytes=_parse_size(shard_size), command=_command_line())
    click.echo(f"Wrote {out}")
    return out


EXAMPLES = """
\b
Examples:
  esmc-convert tiny -o esmc-tiny-mlx            # packaged model, works offline
  esmc-convert 300M --dtype bfloat16            # biohub/ESMC-300M from the Hub
  esmc-convert 6B --q mxfp4 --upload-repo my-org/ESMC-6B-mxfp4
  esmc-convert ./esmc_300m_2024_12_v0.pth -o esmc-300m-mlx
"""


@_friendly
@click.command(name="esmc-convert", help="Convert an ESMC checkpoint to MLX.\n\n" + SOURCE_HELP + "\n" + EXAMPLES)
@_apply(convert_options)
@click.version_option(__version__)
def convert_main(**kwargs):
    run_convert(**kwargs)


@click.group(cls=FriendlyErrors, help="Convert, quantize, validate, publish and run ESMC models with MLX.")
@click.version_option(__version__)
def main():
    pass


@main.command(help="Convert an ESMC checkpoint to MLX (same as esmc-convert).\n\n" + SOURCE_HELP + "\n" + EXAMPLES)
@_apply(convert_options)
def convert(**kwargs):
    run_convert(**kwargs)


@main.command(help="Describe an MLX model directory: architecture, parameters, dtype or "
                   "quantization, bits per weight, size on disk.\n\n\b\nExample:\n  esmc-mlx info esmc-tiny-mlx")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def info(model_dir, as_json):
    import json

    from .info import describe

    facts = describe(model_dir)
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    width = max(map(len, facts))
    for key, value in facts.items():
        click.echo(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
