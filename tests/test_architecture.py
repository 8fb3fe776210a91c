"""The package's structure: dependencies point one way (README, Architecture).

Every import is read from the source, function-level ones included, so a cycle cannot hide
behind a late import.
"""

import ast
import re
from pathlib import Path

import click
import mlx.core as mx
from mlx.utils import tree_flatten

from esmc_mlx.artifact import expected_shapes
from esmc_mlx.cli import convert_main, main
from esmc_mlx.config import ESMCConfig
from esmc_mlx.runtime.model import ESMC

PACKAGE = Path(__file__).resolve().parent.parent / "esmc_mlx"
# Lowest first. A unit may import units of its own layer or below, never above.
LAYERS = [
    {
        "_version",
        "errors",
        "settings",
        "config",
        "fold_config",
        "vocab",
        "artifact",
        "sae_artifact",
        "fold_artifact",
        "hashes",
        "resolve",
        "privacy",
        "outputs",
        "readers",
        "_blas",
    },
    {"quantize"},
    {"convert"},
    {"runtime"},
    {"tasks", "finetune"},
    {"validate", "hub"},
    {"pipeline", "testing", "bench"},
    {"cli"},
]
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _module_name(path: Path, package: Path = PACKAGE) -> list[str]:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path, package_dir: Path = PACKAGE) -> set[str]:
    """Absolute esmc_mlx module names that ``path`` imports, anywhere in the file."""
    name = _module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from .. import _blas` names a submodule, not the package
            found |= {f"{module}.{a.name}" for a in node.names} if not node.module else {module}
    return {m for m in found if m.split(".")[0] == "esmc_mlx"}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's facade (__init__)


def _edges(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        source = _unit(".".join(_module_name(path, package_dir)))
        for target in map(_unit, _imports(path, package_dir)):
            if source != target:
                edges.setdefault(source, set()).add(target)
    return edges


def test_every_unit_has_a_layer():
    units = {_unit(".".join(_module_name(p))) for p in PACKAGE.rglob("*.py")} - {None}
    assert units <= set(LAYER_OF), f"add these to LAYERS: {sorted(units - set(LAYER_OF))}"


def test_no_unit_imports_upward_or_the_facade():
    upward = []
    for source, targets in _edges().items():
        if source is None:
            continue  # the facade re-exports what users need
        for target in targets:
            if target is None or LAYER_OF[target] > LAYER_OF[source]:
                upward.append(f"{source} -> {target or 'esmc_mlx (facade)'}")
    assert not upward, "imports against the layering: " + ", ".join(sorted(upward))


def test_no_import_cycles():
    edges = _edges()

    def reaches(a, b, seen=frozenset()):
        return any(x == b or (x not in seen and reaches(x, b, seen | {x})) for x in edges.get(a, ()))

    cycles = sorted({tuple(sorted((a, b), key=str)) for a in edges for b in edges[a] if reaches(b, a)})
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    # a package of two units whose only link hides in a function, read by the same parser
    (tmp_path / "esmc_mlx" / "convert").mkdir(parents=True)
    (tmp_path / "esmc_mlx" / "convert" / "m.py").write_text("def f():\n    from ..runtime import load\n")
    assert _edges(tmp_path / "esmc_mlx") == {"convert": {"runtime"}}


def test_expected_shapes_are_the_models_parameters():
    config = ESMCConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=3, intermediate_size=384)
    model_shapes = {k: tuple(v.shape) for k, v in tree_flatten(ESMC(config).parameters())}
    assert expected_shapes(config) == model_shapes
    assert all(isinstance(v, mx.array) for _, v in tree_flatten(ESMC(config).parameters()))


def test_package_modules_are_imported_at_the_top():
    """A function-level import is for an optional heavy dependency (torch, matplotlib, h5py),
    never for one of our own modules (that is how cycles hide)."""
    late = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for sub in ast.walk(node):
                    own = isinstance(sub, ast.ImportFrom) and (sub.level or (sub.module or "").startswith("esmc_mlx"))
                    own |= isinstance(sub, ast.Import) and any(a.name.startswith("esmc_mlx") for a in sub.names)
                    if own:
                        late.append(f"{path.relative_to(PACKAGE.parent)}:{sub.lineno}")
    assert not late, "move these imports to the top of their module: " + ", ".join(sorted(late))


RUNTIME = PACKAGE / "runtime"
CUDA_WORDS = re.compile(r"__global__|__device__|__shared__|threadIdx|blockIdx|\basm\s*\(|#pragma|#define|template\s*<")


def test_the_model_file_is_the_math():
    """runtime/model.py holds the model's math (at most 350 lines) and imports nothing of the CUDA
    side: the fused steps reach a model on a CUDA GPU through load() (cuda/fusions.py)."""
    assert len((RUNTIME / "model.py").read_text().splitlines()) <= 350
    assert not {m for m in _imports(RUNTIME / "model.py") if ".cuda" in m or m.endswith(".dispatch")}


def test_no_cuda_in_python_strings():
    """CUDA source lives in runtime/cuda's .cu and .cuh files; Python only reads and splices them."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and CUDA_WORDS.search(node.value):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, found
    assert CUDA_WORDS.search((RUNTIME / "cuda" / "qmm.cu").read_text())  # the pattern sees CUDA


def test_every_command_explains_its_options_and_arguments():
    """`--help` of every command says what each option and argument is."""
    commands = [("esmc-convert", convert_main)] + [(f"esmc-mlx {n}", c) for n, c in main.commands.items()]
    missing = []
    for name, command in commands:
        text = command.help or ""
        for param in command.params:
            if isinstance(param, click.Argument):
                if param.make_metavar(click.Context(command)).rstrip(".") not in text:
                    missing.append(f"{name} {param.name}")
            elif not (param.help or "").strip() and param.name not in ("help", "version"):
                missing.append(f"{name} {param.opts[-1]}")
    assert missing == []
