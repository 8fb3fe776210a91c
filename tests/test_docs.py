"""What the docs promise: every Python call they cite as `esmc_mlx.module.function(args)` names a
function that exists and takes those arguments."""

from __future__ import annotations

import ast
import importlib
import importlib.util
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
    # e.g. esmc_mlx.quantize.quantize(mlx_dir, out, "mxfp4") would fail: that is the per-tensor
    # quantizer (w, group_size, bits, mode); the directory one is esmc_mlx.convert.quantize_directory
    items = [a.strip() for a in args.split(",") if a.strip()]
    positional = [a for a in items if "=" not in a and a != "..."]
    keywords = {a.split("=")[0].strip(): None for a in items if "=" in a}
    signature = inspect.signature(resolve(dotted))
    bind = signature.bind_partial if "..." in items else signature.bind
    try:
        bind(*positional, **keywords)
    except TypeError as e:
        pytest.fail(f"{doc}: {dotted}({args}) does not fit {dotted}{signature}: {e}")


def test_readme_command_table_lists_every_option():
    from esmc_mlx.cli import convert_main, main

    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `esmc-")]
    assert len(rows) == len(main.commands)  # one a command; esmc-convert's row stands for `esmc-mlx convert` too
    for row in rows:
        usage = row.split(" | ")[0]
        words = usage.strip("| `").split()
        command = convert_main if words[0] == "esmc-convert" else main.commands[words[1]]
        documented = set(re.findall(r"--[a-z][a-z-]*", usage))
        options = set()
        for p in command.params:
            opts = p.opts + p.secondary_opts
            if any(f"[{o} " in usage or f" {o} " in usage for o in opts if not o.startswith("--")):
                continue  # the short spelling (-o, -B) stands for the long one
            options |= {o for o in opts if o.startswith("--") and o not in ("--help", "--version")}
        assert documented == options, f"README, {' '.join(words[:2])}: {documented ^ options}"


BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_imports_what_exists(name):
    # a benchmark a doc runs must not stop at an import of a moved name. Read, not run: some
    # benchmarks are scripts that start timing when imported
    tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("esmc_mlx", "benchmarks"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"benchmarks/{name}.py: from {node.module} import {alias.name}"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("esmc_mlx", "benchmarks"):
                    importlib.import_module(alias.name)


def test_heatmap_size_the_docs_give_is_the_one_drawn():
    from esmc_mlx.tasks.heatmap import heatmap_size

    said = re.findall(r"([\d,]+) x ([\d,]+) px for ([\d,]+) residues", (ROOT / "docs" / "scoring.md").read_text())
    assert said
    for width, height, residues in said:
        number = [int(x.replace(",", "")) for x in (width, height, residues)]
        assert heatmap_size(number[2]) == (number[0], number[1]), f"docs/scoring.md: {width} x {height} px"
