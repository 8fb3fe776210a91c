"""The adapter artifact ``esmc-mlx finetune`` writes, and what reads it back.

    OUT/adapter_config.json   mlx-lm's adapter config (fine_tune_type, num_layers,
                              lora_parameters), and under "esmc_mlx": the base model named by
                              repo id, revision and the sha256 of its weight files (never a
                              local path), the task and its labels, the head, the training
                              settings, the data's sha256, and whether training finished
    OUT/adapters.safetensors  the LoRA weights (mlx-lm's names and format)
    OUT/head.safetensors      the task head
    OUT/metrics.json, .png    train / valid loss and metric per epoch, and their curves
    OUT/README.md             the card (also what ``esmc-mlx push`` publishes)
    OUT/checkpoint.safetensors  while training: adapters, head, optimizer state and progress

``load_adapter`` builds a model that predicts from it; ``fuse_adapter`` writes the adapters
merged into the base as a float MLX model directory that ``esmc_mlx.load`` reads.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .._version import __version__
from ..artifact import (
    GENERATED_CARD_LINE,
    ArtifactKind,
    load_safetensors,
    precision_label,
    read_config,
    read_model_config,
    register_artifact_kind,
    safetensors_header,
    weight_files,
)
from ..config import ESMCConfig
from ..convert import write_config
from ..convert.writer import ShardWriter
from ..errors import ConfigError, ConvertError, EsmcMlxError, HubError, JobError
from ..hashes import file_hashes
from ..outputs import Found, atomic_file, check_target, guard, local_paths
from ..privacy import public_path
from ..readers import read_json
from ..resolve import LOCAL_ALIASES, Source, local_copy, resolve
from ..runtime.load import load
from ..runtime.quantized import dequantize_model
from ..vocab import write_tokenizer_files
from .data import TASKS, Labels
from .model import HEADS, LORA_KEYS, METRIC_NAMES, POOLS, AdaptedModel, lora_module

FORMAT = "esmc-mlx-adapter"
CONFIG = "adapter_config.json"
ADAPTERS = "adapters.safetensors"
HEAD = "head.safetensors"
METRICS = "metrics.json"
CURVES = "metrics.png"
CARD = "README.md"
CHECKPOINT = "checkpoint.safetensors"
# Where a base given as a local directory lies on this machine: never in the config, never
# pushed; it lets load_adapter(OUT) find that base here without being told (sha256 checked).
LOCAL_BASE = ".base-model"
# What a finished adapter holds, in the order a push lists them (the checkpoint is gone by then).
ADAPTER_FILES = (CARD, CONFIG, ADAPTERS, HEAD, METRICS, CURVES)


# --- the base model ---------------------------------------------------------------------------
def base_identity(source: Source) -> dict:
    """How the adapter names its base: the Hub repo id (or esmc-mlx's packaged alias) and the
    resolved revision, or for a local directory its name only (``repo_id`` None: nobody else can
    load it by that); always the sha256 of every weight file, which ``load_adapter`` checks."""
    packaged = any(source.path == path for path in LOCAL_ALIASES.values())
    local = not packaged and Path(source.id).is_absolute()
    raw = read_config(source.path)
    return {
        "repo_id": None if local else source.id,
        "revision": source.revision,
        "name": public_path(source.path) if local else source.id,
        "precision": precision_label(raw),
        "files": file_hashes(weight_files(source.path)),
    }


def check_base(base: dict, directory: Path, origin: str) -> None:
    """JobError unless ``directory``'s weight files are the ones the adapter was trained on."""
    found = file_hashes(weight_files(directory))
    if found != base.get("files"):
        raise JobError(
            f"{origin}: the base model's weights ({public_path(directory)}) are not those the adapter was trained "
            f"on ({base.get('name')}: sha256 of {', '.join(sorted(base.get('files') or {}))} differ)"
        )


def recorded_local_base(directory: Path) -> Path | None:
    """Where the local base of the adapter ``directory`` lies (its LOCAL_BASE file: one path,
    read bounded), or None."""
    path = Path(directory) / LOCAL_BASE
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        text = f.read(PATH_BYTES + 1).decode("utf-8", errors="replace").strip()
    if len(text) > PATH_BYTES or not text or "\n" in text or "\0" in text:
        raise ConfigError(f"{path}: not the path of a model directory; remove it and pass the base with --base")
    return Path(text)


PATH_BYTES = 4096  # PATH_MAX on Linux


def base_source(config: dict, base: str | Path | None, directory: Path, origin: str) -> Path:
    """The base model's directory: ``base`` when given, else resolved from the recorded repo id
    and revision (a local base: where LOCAL_BASE says it was); checked against the sha256."""
    recorded = config["esmc_mlx"]["base"]
    if base is None and recorded.get("repo_id") is None:
        base = recorded_local_base(directory)
    if base is None and recorded.get("repo_id") is None:
        raise JobError(
            f"{origin}: the adapter was trained on a local model ({recorded.get('name')}), which it cannot name "
            "for others; pass that model's directory (base=... in Python, --base on the command line)"
        )
    if base is None:
        directory = resolve(recorded["repo_id"], recorded.get("revision")).path
    else:
        directory = resolve(str(base)).path
    check_base(recorded, directory, origin)
    return directory


# --- reading ----------------------------------------------------------------------------------
CONFIG_BYTES = 1 << 20  # an adapter's config holds settings and a few hashes: a few KB
_SHA256 = re.compile(r"[0-9a-f]{64}")


def read_adapter_config(directory: str | Path, complete: bool = True) -> dict:
    """``adapter_config.json`` of an adapter directory through the bounded reader, every field
    esmc-mlx reads checked (``adapter_config_problem``). ConfigError naming the file and the
    field when it is damaged, JobError when it is missing, not esmc-mlx's, or (``complete``) its
    training has not finished."""
    directory = Path(directory)
    path = directory / CONFIG
    if not path.is_file():
        raise JobError(f"{directory}: no {CONFIG}; not an esmc-mlx adapter directory")
    config = read_json(path, ConfigError, max_bytes=CONFIG_BYTES)
    meta = config.get("esmc_mlx") if isinstance(config, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise JobError(f"{path}: not an esmc-mlx adapter config")
    problem = adapter_config_problem(config)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    if complete and not meta.get("complete"):
        raise JobError(
            f"{directory}: training has not finished; run the same esmc-mlx finetune command again to resume it"
        )
    return config


def _count(value, low: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _optional_str(value) -> bool:
    return value is None or isinstance(value, str)


def adapter_config_problem(config: dict) -> str | None:
    """What is wrong with the fields of an adapter config that esmc-mlx reads (mlx-lm's LoRA
    settings, the base, the labels, the head), as ``FIELD: problem``; None when they hold. The
    sizes are checked against the weights' headers when they load (``check_adapter_weights``)."""
    if config.get("fine_tune_type", "lora") != "lora":
        return f"fine_tune_type {config['fine_tune_type']!r}: esmc-mlx adapters are lora"
    if not _count(config.get("num_layers")):
        return f"num_layers must be a positive integer, got {config.get('num_layers')!r}"
    lora = config.get("lora_parameters")
    if not isinstance(lora, dict):
        return f"lora_parameters must be an object, got {lora!r}"
    if not _count(lora.get("rank")):
        return f"lora_parameters.rank must be a positive integer, got {lora.get('rank')!r}"
    if not _number(lora.get("scale")):
        return f"lora_parameters.scale must be a finite number, got {lora.get('scale')!r}"
    if not (_number(lora.get("dropout", 0.0)) and 0 <= lora.get("dropout", 0.0) < 1):
        return f"lora_parameters.dropout must be a number in [0, 1), got {lora.get('dropout')!r}"
    keys = lora.get("keys")
    if not (isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys)) or len(set(keys)) != len(keys):
        return f"lora_parameters.keys must be a list of distinct module names, got {keys!r}"
    unknown = sorted(set(keys) - set(LORA_KEYS))
    if unknown:
        return f"lora_parameters.keys: {unknown[0]!r} is not a block projection ({', '.join(LORA_KEYS)})"
    meta = config["esmc_mlx"]
    if not isinstance(meta.get("complete", False), bool):
        return f"esmc_mlx.complete must be true or false, got {meta.get('complete')!r}"
    for name, choices in (("head", HEADS), ("pool", POOLS)):
        if meta.get(name) not in choices:
            return f"esmc_mlx.{name} {meta.get(name)!r} is not one of {', '.join(choices)}"
    if not isinstance(meta.get("training", {}), dict):
        return f"esmc_mlx.training must be an object of settings, got {meta.get('training')!r:.60}"
    if meta.get("best_epoch") is not None and not _count(meta["best_epoch"]):
        return f"esmc_mlx.best_epoch must be an epoch number, got {meta['best_epoch']!r}"
    return _base_problem(meta.get("base")) or _labels_problem(meta.get("labels"))


def _base_problem(base) -> str | None:
    if not isinstance(base, dict):
        return f"esmc_mlx.base must be an object naming the base model, got {base!r}"
    files = base.get("files")
    if not (isinstance(files, dict) and files):
        return f"esmc_mlx.base.files must name the base's weight files and their sha256, got {files!r}"
    for name, digest in files.items():
        if Path(name).name != name or not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            return f"esmc_mlx.base.files: {name!r}: {digest!r} is not a file name and its sha256"
    for key in ("repo_id", "revision", "name", "precision"):
        if not _optional_str(base.get(key)):
            return f"esmc_mlx.base.{key} must be a string, got {base.get(key)!r}"
    if base.get("repo_id") is None and not base.get("name"):
        return "esmc_mlx.base names no model (neither repo_id nor name)"
    return None


def _labels_problem(labels) -> str | None:
    if not isinstance(labels, dict):
        return f"esmc_mlx.labels must be an object, got {labels!r}"
    task = labels.get("task")
    if task not in TASKS:
        return f"esmc_mlx.labels.task {task!r} is not one of {', '.join(TASKS)}"
    if task == "regression":
        for key in ("mean", "std"):
            if not _number(labels.get(key)):
                return f"esmc_mlx.labels.{key} must be a finite number (regression scales its targets), got {labels.get(key)!r}"
        if not labels["std"] > 0:
            return f"esmc_mlx.labels.std must be positive, got {labels['std']!r}"
        return None
    classes = labels.get("classes")
    if not (isinstance(classes, list) and all(isinstance(c, str) for c in classes) and len(set(classes)) >= 2):
        return f"esmc_mlx.labels.classes must be a list of at least two distinct labels, got {classes!r}"
    if len(set(classes)) != len(classes):
        return "esmc_mlx.labels.classes lists a label twice"
    if task == "per-residue" and not all(len(c) == 1 for c in classes):
        return f"esmc_mlx.labels.classes: a per-residue label is one character, got {classes!r}"
    if not isinstance(labels.get("positions", False) or False, bool):
        return f"esmc_mlx.labels.positions must be true or false, got {labels.get('positions')!r}"
    return None


def is_adapter(directory: str | Path) -> bool:
    """Whether ``directory`` holds an esmc-mlx adapter config (finished or not, damaged fields
    or not: reading it says what is wrong)."""
    try:
        read_adapter_config(directory, complete=False)
    except ConfigError:
        return True  # esmc-mlx's format, a field damaged
    except EsmcMlxError:
        return False
    return True


def adapter_files(directory: str | Path) -> list[str]:
    """What a finished adapter directory is made of (the ``adapter`` artifact kind): its config,
    adapters, head and metrics (ADAPTER_FILES present; the card goes with it as every kind's).
    JobError for an unfinished adapter or a missing weight file."""
    directory = Path(directory)
    read_adapter_config(directory)
    missing = [n for n in (ADAPTERS, HEAD) if not (directory / n).is_file()]
    if missing:
        raise JobError(f"{directory}: {', '.join(missing)} missing")
    return [n for n in ADAPTER_FILES if n != CARD and (directory / n).is_file()]


register_artifact_kind(ArtifactKind("adapter", CONFIG, adapter_files, is_adapter))


def check_adapter_base(directory: str | Path) -> None:
    """HubError, before a push, for an adapter whose base model is a local directory: nobody
    else could load it."""
    base = read_adapter_config(directory, complete=False)["esmc_mlx"]["base"]
    if base.get("repo_id") is None:
        raise HubError(
            f"refusing to push {directory}: its base model is a local directory ({base.get('name')}), which nobody "
            "can load from the Hub. Publish the base first (esmc-mlx push BASE ORG/NAME) and fine-tune from ORG/NAME"
        )


def load_adapter(
    path_or_repo_id: str | Path, base: str | Path | None = None, revision: str | None = None
) -> AdaptedModel:
    """An adapted model that predicts: ``model.predict(sequences)``. ``path_or_repo_id``: an
    adapter directory or its Hub repo (``revision``). The base model is loaded from the repo id
    and revision the adapter names (``base``: a local directory or repo id instead) and must
    have the sha256 it was trained on. Raises JobError (not a finished adapter, another base,
    mlx-lm missing), HubError, ConvertError."""
    directory = resolve(str(path_or_repo_id), revision).path
    config = read_adapter_config(directory)
    return _load(directory, config, base_source(config, base, directory, str(path_or_repo_id)))


def found_inputs(adapter, base=None) -> list[Found]:
    """What the adapter ``adapter`` leads to that the user did not name (``outputs.Found``): the
    base model its config records, when no ``base`` is given (the local directory it was trained
    on, or the base repo's copy in the HF cache). For the output guard: an output is none of its
    inputs, however they were found. Nothing when the adapter is not a local folder or cannot be
    read (loading it then says why)."""
    if base is not None or not isinstance(adapter, (str, os.PathLike)):
        return []
    directory = Path(adapter).expanduser()
    try:
        recorded = read_adapter_config(directory, complete=False)["esmc_mlx"]["base"]
        path = recorded_local_base(directory) if recorded.get("repo_id") is None else local_copy(recorded["repo_id"])
    except (EsmcMlxError, OSError):
        return []
    return [] if path is None else [Found(Path(path), f"the base model {adapter} records")]


def _load(directory: Path, config: dict, base_dir: Path) -> AdaptedModel:
    meta = config["esmc_mlx"]
    base_config = read_model_config(base_dir)[1]
    adapters, head = adapter_weights(directory, config, base_config)  # checked before anything is built
    model, _ = load(base_dir, fuse=False)
    adapted = AdaptedModel(model, Labels.from_dict(meta["labels"]), meta["head"], meta["pool"])
    _, utils = lora_module()
    model.freeze()
    utils.linear_to_lora_layers(model.esmc, config["num_layers"], config["lora_parameters"])
    model.esmc.load_weights(list(adapters.items()), strict=False)  # every LoRA weight, named and shaped
    adapted.head.load_weights(list(head.items()), strict=True)
    model.reset_compiled()  # traces made before the adapters went in
    mx.eval(adapted.parameters())
    return adapted.eval()


def _projection_dims(config: ESMCConfig) -> dict[str, tuple[int, int]]:
    """(input, output) width of every block projection LoRA may adapt."""
    d, f = config.hidden_size, config.intermediate_size
    square = {f"self_attn.{x}_proj": (d, d) for x in "qkvo"}
    return {**square, "mlp.gate_proj": (d, f), "mlp.up_proj": (d, f), "mlp.down_proj": (f, d)}


def expected_adapter_shapes(config: dict, base: ESMCConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of ``adapters.safetensors`` (mlx-lm's LoRA names on the encoder):
    ``lora_a`` (input, rank) and ``lora_b`` (rank, output) of each adapted projection of the top
    ``num_layers`` blocks."""
    lora, n = config["lora_parameters"], base.num_hidden_layers
    dims, rank = _projection_dims(base), lora["rank"]
    shapes = {}
    for i in range(n - config["num_layers"], n):
        for key in lora["keys"]:
            shapes[f"layers.{i}.{key}.lora_a"] = (dims[key][0], rank)
            shapes[f"layers.{i}.{key}.lora_b"] = (rank, dims[key][1])
    return shapes


def expected_head_shapes(meta: dict, base: ESMCConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of ``head.safetensors`` (``model.Head``)."""
    d, labels = base.hidden_size, meta["labels"]
    outputs = 1 if labels["task"] == "regression" else len(labels["classes"])
    widths = [(d, outputs)] if meta["head"] == "linear" else [(d, d), (d, outputs)]
    shapes = {}
    for i, (inputs, out) in enumerate(widths):
        shapes[f"layers.{i}.weight"], shapes[f"layers.{i}.bias"] = (out, inputs), (out,)
    return shapes


def adapter_weights(directory: Path, config: dict, base: ESMCConfig) -> tuple[dict, dict]:
    """(the LoRA weights, the head's weights) of an adapter directory, read the way every
    artifact kind is read: each file's header checked (cut files, overlapping offsets), its
    names, shapes and dtypes checked against the config and the base model ``base``, before MLX
    reads it; then every value checked finite. ConfigError naming the file and the tensor (or
    config.json's field)."""
    config_path = directory / CONFIG
    layers = config["num_layers"]
    if layers > base.num_hidden_layers:
        raise ConfigError(
            f"{config_path}: num_layers is {layers:,}, but the base model has {base.num_hidden_layers} blocks"
        )
    ranks = {
        t["shape"][1]
        for n, t in _header(directory / ADAPTERS).items()
        if n.endswith(".lora_a") and len(t["shape"]) == 2
    }
    if len(ranks) == 1 and config["lora_parameters"]["rank"] not in ranks:
        raise ConfigError(
            f"{config_path}: lora_parameters.rank is {config['lora_parameters']['rank']:,}, but {ADAPTERS} holds "
            f"adapters of rank {ranks.pop()}"
        )
    found = []
    for name, expected in (
        (ADAPTERS, expected_adapter_shapes(config, base)),
        (HEAD, expected_head_shapes(config["esmc_mlx"], base)),
    ):
        path = directory / name
        _check_header(path, expected, config_path)
        found.append(load_safetensors(path, ConfigError))
    return found[0], found[1]


def _header(path: Path) -> dict:
    """The tensors of a safetensors file's checked header (ConfigError naming the file)."""
    if not path.is_file():
        raise ConfigError(f"{path.parent}: {path.name} is missing")
    try:
        header = safetensors_header(path)
    except ConvertError as e:
        raise ConfigError(str(e)) from None
    return {n: t for n, t in header.items() if n != "__metadata__"}


def _check_header(path: Path, expected: dict[str, tuple[int, ...]], config_path: Path) -> None:
    """ConfigError naming ``path`` and the tensor when its header lacks one of ``expected``'s
    tensors, holds another, or one of another shape or a dtype that is not float."""
    tensors = _header(path)
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ConfigError(f"{path}: tensor {extra[0]} is not one {config_path.name} describes")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConfigError(f"{path}: no tensor {missing[0]}, which {config_path.name} describes")
    for name, shape in expected.items():
        got = tuple(tensors[name]["shape"])
        if got != shape:
            raise ConfigError(
                f"{path}: tensor {name} has shape {got}, but {config_path.name} and the base model give {shape}"
            )
        if tensors[name]["dtype"] not in ("F32", "F16", "BF16"):
            raise ConfigError(f"{path}: tensor {name} is {tensors[name]['dtype']}, not a float weight")


# --- fusing -----------------------------------------------------------------------------------
def fuse_adapter(
    path_or_repo_id: str | Path, out: str | Path, base: str | Path | None = None, force: bool = False
) -> Path:
    """Write the base with the adapters merged into its weights (mlx-lm's ``LoRALinear.fuse``)
    as a float MLX model directory ``out``, through ``outputs.StagedDirectory``; a quantized
    base is dequantized (the merged weights are float). ``esmc_mlx.load(out)`` gives the
    adapted encoder; the task head stays in the adapter. Raises what ``load_adapter`` raises,
    OutputError for an ``out`` that cannot be written."""
    directory = resolve(str(path_or_repo_id)).path
    config = read_adapter_config(directory)
    base_dir = base_source(config, base, directory, str(path_or_repo_id))
    how = "the base model given" if base is not None else f"the base model {path_or_repo_id} records"
    inputs = [directory, *local_paths(base), Found(base_dir, how)]
    check_target(out, force, sources=inputs)  # before the model loads
    model = _load(directory, config, base_dir).base
    lora, _ = lora_module()
    fused = [(name, m.fuse(dequantize=True)) for name, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
    model.update_modules(tree_unflatten(fused))
    dtype = model.dtype
    dequantize_model(model, dtype)
    meta = config["esmc_mlx"]
    with guard(out, "model", "directory", force=force, inputs=inputs) as stage:
        writer = ShardWriter(stage.path)
        for name, array in tree_flatten(model.parameters()):
            writer.add(name, array.astype(dtype))
        writer.close()
        provenance = {
            "source": {"id": meta["base"]["name"], "revision": meta["base"].get("revision")},
            "converter": {"name": "esmc-mlx", "version": __version__},
            "adapter": {"lora": config["lora_parameters"], "num_layers": config["num_layers"], "task": meta["labels"]},
            "quantization": None,
        }
        write_config(stage.path, model.config, dtype, None, provenance)
        write_tokenizer_files(stage.path)
        return stage.publish()


# --- the card and the curves ------------------------------------------------------------------
def render_card(directory: str | Path, repo_id: str | None = None) -> str:
    """The adapter's README.md: base model, task, labels, settings, metrics, how to load it."""
    directory = Path(directory)
    config = read_adapter_config(directory, complete=False)
    meta = config["esmc_mlx"]
    base, labels, training = meta["base"], meta["labels"], meta["training"]
    repo_id = repo_id or directory.name
    history = _read_metrics(directory)
    metric = METRIC_NAMES[labels["task"]]
    tags = ["esmc", "mlx", "esmc-mlx", "lora", "protein", labels["task"]]
    front = ["---", "library_name: mlx", f"tags: [{', '.join(tags)}]"]
    if base.get("repo_id") and not base["repo_id"].startswith("esmc-mlx/"):
        front.append(f"base_model: {base['repo_id']}")
    front.append("---")
    rows = [
        f"| {h['epoch']} | {_num(h.get('train_loss'))} | {_num(h.get('train_' + metric))} | "
        f"{_num(h.get('valid_loss'))} | {_num(h.get('valid_' + metric))} |"
        for h in history
    ]
    what = {
        "classification": f"sequence classification into {len(labels['classes'] or [])} classes",
        "regression": "sequence regression",
        "per-residue": f"per-residue classification into {len(labels['classes'] or [])} classes",
    }[labels["task"]]
    classes = f"Classes: {', '.join(f'`{c}`' for c in labels['classes'])}.\n\n" if labels.get("classes") else ""
    revision = f" at revision `{base['revision']}`" if base.get("revision") else ""
    lines = [
        *front,
        f"# {repo_id}",
        "",
        f"LoRA adapters and a {meta['head']} head for {what}, on the ESMC model "
        f"`{base['repo_id'] or base['name']}`{revision} ({base['precision']}), trained with "
        f"esmc-mlx {meta.get('version', __version__)}.",
        "",
        classes
        + "The base's weight files (sha256, checked when the adapter loads): "
        + ", ".join(f"`{n}` {h[:16]}..." for n, h in sorted(base["files"].items()))
        + ".",
        "",
        "## Use",
        "",
        "esmc-mlx is not published on PyPI: install it from a checkout of its repository "
        '(`pip install ".[finetune]"`), or from a wheel built there by `python -m build`.',
        "",
        "```python",
        "from esmc_mlx import load_adapter",
        "",
        f'model = load_adapter("{repo_id}")  # downloads the base model too',
        'model.predict(["MKTAYIAKQRQISFVKSHFSRQ"])',
        "```",
        "",
        "```bash",
        f"esmc-mlx predict {repo_id} --fasta proteins.fasta -o predictions.csv",
        "```",
        "",
        "## Training",
        "",
        f"LoRA rank {config['lora_parameters']['rank']} (scale {config['lora_parameters']['scale']}) on "
        f"{', '.join(config['lora_parameters']['keys'])} of the top {config['num_layers']} blocks; "
        f"{meta['pool']} pooling; " + ", ".join(f"{k} {v}" for k, v in training.items()) + ".",
        "",
        f"| epoch | train loss | train {metric} | valid loss | valid {metric} |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Best epoch: {meta.get('best_epoch', '-')}; its weights are the ones published."
        if meta.get("best_epoch")
        else "",
        "",
        GENERATED_CARD_LINE,
        "",
    ]
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _read_metrics(directory: Path) -> list[dict]:
    """The epochs of ``metrics.json`` (none when it is missing), through the bounded reader:
    each an object of an ``epoch`` number and numbers (or null). ConfigError naming the file."""
    path = directory / METRICS
    if not path.is_file():
        return []
    data = read_json(path, ConfigError, max_bytes=CONFIG_BYTES * 16)
    epochs = data.get("epochs") if isinstance(data, dict) else None
    if not isinstance(epochs, list):
        raise ConfigError(f"{path}: no list of epochs")
    for row in epochs:
        if not (isinstance(row, dict) and _count(row.get("epoch"))):
            raise ConfigError(f"{path}: an entry of epochs is not an object with an epoch number: {row!r:.80}")
        bad = [k for k, v in row.items() if v is not None and not _number(v)]
        if bad:
            raise ConfigError(f"{path}: epoch {row['epoch']}: {bad[0]} is {row[bad[0]]!r:.40}, not a number")
    return epochs


def write_curves(path: Path, history: list[dict], metric: str) -> bool:
    """The loss and metric curves per epoch as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = [h["epoch"] for h in history]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key in zip(axes, ("loss", metric)):
        for split in ("train", "valid"):
            values = [h.get(f"{split}_{key}") for h in history]
            if any(v is not None for v in values):
                ax.plot(epochs, [float("nan") if v is None else v for v in values], marker="o", label=split)
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.legend()
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return True
