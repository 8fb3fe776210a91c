"""What the docs promise: every Python call they cite as `esmc_mlx.module.function(args)` names a
function that exists and takes those arguments."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CALL = re.compile(r"`(esmc_mlx(?:\.\w+)+)\(([^`()]*)\)`")


def cited_calls() -> list[tuple[str, str, str]]:
    return [(doc.name, m[1], m[2]) for doc in DOCS for m in CALL.finditer(doc.read_text())]


def resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_docs_cite_calls():
    assert len(cited_calls()) >= 4  # the pattern still finds them


@pytest.mark.parametrize("doc, dotted, args", cited_calls())
def test_cited_call_exists_and_takes_its_arguments(doc, dotted, args):
    # before round 11 docs/quantization.md cited esmc_mlx.quantize.quantize(mlx_dir, out, "mxfp4"):
    # that is the per-tensor quantizer (w, group_size, bits, mode); the directory one is
    # esmc_mlx.convert.quantize_directory
    items = [a.strip() for a in args.split(",") if a.strip()]
    positional = [a for a in items if "=" not in a and a != "..."]
    keywords = {a.split("=")[0].strip(): None for a in items if "=" in a}
    signature = inspect.signature(resolve(dotted))
    bind = signature.bind_partial if "..." in items else signature.bind
    try:
        bind(*positional, **keywords)
    except TypeError as e:
        pytest.fail(f"{doc}: {dotted}({args}) does not fit {dotted}{signature}: {e}")
