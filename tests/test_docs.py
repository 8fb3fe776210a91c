"""What the docs promise: every Python call they cite as `esmc_mlx.module.function(args)` names a
function that exists and takes those arguments; every repository path, `python -m` module, command
option and `ESMC_MLX_*` variable that README.md and docs/*.md name exists."""

from __future__ import annotations

import ast
import glob
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


# --- what the docs name exists: paths, command options, environment variables ----------------------
# Paths a script writes and the repository does not hold (scripts/tiny_data.py's DATA_DIR).
GENERATED = ("scripts/data",)
REPO_PATH = re.compile(r"(?<![\w./-])((?:esmc_mlx|scripts|benchmarks|tests|docs|\.ci)/[\w.*/-]*[\w*])")
# esmc_mlx's folders, named as docs/architecture.md's tables name them (runtime/quantized.py)
PACKAGE_PATH = re.compile(r"(?<![\w./-])((?:runtime|tasks|convert|validate|hub|finetune|quantize)/[\w.*/-]*[\w*])")
MODULE = re.compile(r"python -m ((?:esmc_mlx|benchmarks|scripts)(?:\.\w+)+)")
VARIABLE = re.compile(r"ESMC_MLX_[A-Z0-9_]*[A-Z0-9]")


def _exists(path: str) -> bool:
    """A file or folder of the repository (a glob matches one), or ``folder/module.name``: a
    function, class or constant ``name`` of ``folder/module.py``."""
    path = path.split("::")[0]  # tests/test_x.py::test_name
    if path.startswith(GENERATED) or glob.glob(str(ROOT / path), recursive=True):
        return True
    module, _, name = path.rpartition(".")
    source = ROOT / f"{module}.py"
    pattern = rf"^(?:\s*(?:def|class)\s+{re.escape(name)}\b|{re.escape(name)}\s*[:=])"
    return bool(name) and source.is_file() and re.search(pattern, source.read_text(), re.M) is not None


def named_paths() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        found += [(doc.name, m[1]) for m in REPO_PATH.finditer(text)]
        found += [(doc.name, f"esmc_mlx/{m[1]}") for m in PACKAGE_PATH.finditer(text)]
    return found


def test_every_path_a_doc_names_exists():
    # docs/architecture.md named runtime/kernels.py for months after the kernels moved
    assert len(named_paths()) > 100  # the patterns still find them
    missing = sorted({f"{doc}: {path}" for doc, path in named_paths() if not _exists(path)})
    assert missing == [], "paths the docs name that the repository does not hold:\n" + "\n".join(missing)


def test_every_module_a_doc_runs_exists():
    named = {(doc.name, m[1]) for doc in DOCS for m in MODULE.finditer(doc.read_text())}
    assert len(named) > 5
    missing = sorted(f"{doc}: python -m {name}" for doc, name in named if importlib.util.find_spec(name) is None)
    assert missing == [], missing


def test_every_environment_variable_a_doc_names_exists():
    from esmc_mlx.settings import VARIABLES

    # ESMC_MLX_FUSED_QKV, _FUSED_NORM, _KERNEL_CACHE stayed in the docs after they were gone
    named = {(doc.name, m[0]) for doc in DOCS for m in VARIABLE.finditer(doc.read_text())}
    assert len(named) > 5
    unknown = sorted(f"{doc}: {name}" for doc, name in named if name not in VARIABLES)
    assert unknown == [], f"variables esmc_mlx/settings.py does not read: {unknown}"


def _code(text: str):
    """The code a doc shows: every line of a fenced block, every inline code span."""
    fenced = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif fenced:
            yield line
        else:
            yield from re.findall(r"`([^`\n]+)`", line)


def _option_names(command) -> set[str]:
    names = {"--help"}
    for p in command.params:
        names |= {o for o in p.opts + p.secondary_opts if o.startswith("-")}
    return names


def test_every_command_option_a_doc_names_exists():
    """Each option given to `esmc-convert` or an `esmc-mlx` command in a doc's code (a command line,
    or a span that starts with a command's name: `scan --fasta`) is one that command takes."""
    from esmc_mlx.cli import convert_main, main

    commands = {name: _option_names(c) for name, c in main.commands.items()}
    commands["esmc-convert"] = _option_names(convert_main)
    invocation = re.compile(r"(?:esmc-mlx\s+([a-z][a-z-]*)|(esmc-convert))\b([^|;&#]*)")
    checked, wrong = 0, []
    for doc in DOCS:
        for code in _code(doc.read_text()):
            calls = [(m[1] or m[2], m[3]) for m in invocation.finditer(code)]
            first, _, rest = code.strip().partition(" ")
            if first in main.commands and not calls:
                calls = [(first, re.split(r"[|;&#]", rest)[0])]
            for name, words in calls:
                if name not in commands:
                    continue  # prose: "esmc-mlx did not write it"
                for option in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", words):
                    checked += 1
                    if option not in commands[name]:
                        wrong.append(f"{doc.name}: `{code.strip()[:80]}`: {name} takes no {option}")
    assert checked > 100  # the patterns still find them
    assert wrong == [], "\n".join(wrong)
