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

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .._version import __version__
from ..artifact import (
    GENERATED_CARD_LINE,
    ArtifactKind,
    precision_label,
    read_config,
    register_artifact_kind,
    weight_files,
)
from ..convert import write_config
from ..convert.writer import ShardWriter
from ..errors import HubError, JobError
from ..hashes import file_hashes
from ..outputs import atomic_file, check_target, guard, local_paths
from ..privacy import public_path
from ..resolve import LOCAL_ALIASES, Source, resolve
from ..runtime.load import load
from ..runtime.quantized import dequantize_model
from ..vocab import write_tokenizer_files
from .data import Labels
from .model import METRIC_NAMES, AdaptedModel, lora_module

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


def base_source(config: dict, base: str | Path | None, directory: Path, origin: str) -> Path:
    """The base model's directory: ``base`` when given, else resolved from the recorded repo id
    and revision (a local base: where LOCAL_BASE says it was); checked against the sha256."""
    recorded = config["esmc_mlx"]["base"]
    if base is None and recorded.get("repo_id") is None and (directory / LOCAL_BASE).is_file():
        base = (directory / LOCAL_BASE).read_text().strip()
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
def read_adapter_config(directory: str | Path, complete: bool = True) -> dict:
    """``adapter_config.json`` of an adapter directory; JobError when it is missing, not
    esmc-mlx's, or (``complete``) its training has not finished."""
    directory = Path(directory)
    path = directory / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise JobError(f"{directory}: no {CONFIG}; not an esmc-mlx adapter directory") from None
    except (OSError, ValueError) as e:
        raise JobError(f"{path}: unreadable ({e})") from None
    meta = config.get("esmc_mlx") if isinstance(config, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise JobError(f"{path}: not an esmc-mlx adapter config")
    if complete and not meta.get("complete"):
        raise JobError(
            f"{directory}: training has not finished; run the same esmc-mlx finetune command again to resume it"
        )
    return config


def is_adapter(directory: str | Path) -> bool:
    """Whether ``directory`` holds an esmc-mlx adapter config (finished or not)."""
    try:
        read_adapter_config(directory, complete=False)
    except JobError:
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
    return _load(directory, read_adapter_config(directory), base, str(path_or_repo_id))


def _load(directory: Path, config: dict, base: str | Path | None, origin: str) -> AdaptedModel:
    meta = config["esmc_mlx"]
    model, _ = load(base_source(config, base, directory, origin), fuse=False)
    adapted = AdaptedModel(model, Labels.from_dict(meta["labels"]), meta["head"], meta["pool"])
    _, utils = lora_module()
    model.freeze()
    utils.load_adapters(model.esmc, str(directory))  # mlx-lm's: checks every name and shape
    try:
        adapted.head.load_weights(str(directory / HEAD), strict=True)
    except (ValueError, RuntimeError, OSError) as e:
        raise JobError(f"{directory / HEAD}: does not fit the adapter's head ({e})") from None
    model.reset_compiled()  # traces made before the adapters went in
    mx.eval(adapted.parameters())
    return adapted.eval()


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
    inputs = [directory, *local_paths(base)]
    check_target(out, force, sources=inputs)  # before the model loads
    model = _load(directory, config, base, str(path_or_repo_id)).base
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
    try:
        data = json.loads((directory / METRICS).read_text())
    except (OSError, ValueError):
        return []
    return data.get("epochs", []) if isinstance(data, dict) else []


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
