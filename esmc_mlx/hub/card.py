"""The model card (README.md) of a published artifact, written from the artifact itself.

Everything on the card is read from the directory: config.json (architecture, dtype,
quantization, provenance: source repo, revision, file hashes, the conversion command,
license), the safetensors headers (which layers are quantized), ``esmc_mlx.info.describe``
(bits per weight, size) and ``validation/`` (report.json, report.md, plots). Nothing is typed
by hand, so the card cannot drift from the weights it describes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .._version import __version__
from ..artifact import (
    FP_MODES,
    REPORT_DIR,
    describe,
    human_size,
    plural,
    precision_label,
    quantization_record,
    quantized_bits,
    read_config,
    safetensors_header,
    weight_files,
)
from ..artifact import GENERATED_CARD_LINE as MARKER  # the card's last line
from ..errors import ConfigError, EsmcMlxError, HubError
from ..fold_artifact import BACKBONE, FOLD
from ..readers import read_json
from ..sae_artifact import read_sae_config, read_sae_json, sae_files
from .repo_id import is_repo_id


def install_text(version: str) -> str:
    """What a card says about installing esmc-mlx (``version``: the one that converted the model):
    it is not on PyPI, so no `pip install esmc-mlx` line."""
    return (
        "esmc-mlx is not published on PyPI. Install it from its source: `pip install .` in a checkout of "
        f"the esmc-mlx repository, or `pip install esmc_mlx-{version}-py3-none-any.whl` with a wheel built "
        "there by `python -m build` (add `[cuda]` for NVIDIA GPUs on Linux)."
    )


# The models that ship inside esmc-mlx (source ids ``esmc-mlx/<alias>``), as their cards describe them.
BUNDLED = {
    "esmc-mlx/tiny": (
        "esmc-tiny is the small demo model that ships inside esmc-mlx: ESMC's architecture at 6 layers and "
        "width 256 (5.2 M parameters), trained by esmc-mlx with masked language modelling on about 4,900 "
        "public protein sequences, for tests, demos and the quality side of validation. It is not a model "
        "for biology: it predicts a masked residue only a little better than the residue frequencies do, so "
        "its variant scores and embeddings say little about real proteins. It is not EvolutionaryScale's "
        "ESM C and holds none of its weights."
    ),
}


@dataclasses.dataclass
class Validation:
    """What ``validation/`` says about an artifact."""

    state: str  # "passed", "failed", "missing" or "unreadable"
    report: dict | None = None
    markdown: str | None = None
    plots: list[str] = dataclasses.field(default_factory=list)  # paths relative to the artifact
    problem: str | None = None  # why the state is not "passed", in words

    @property
    def passed(self) -> bool:
        return self.state == "passed"

    @property
    def checks(self) -> list[dict]:
        checks = (self.report or {}).get("checks")
        return [c for c in checks if isinstance(c, dict)] if isinstance(checks, list) else []

    @property
    def enforced(self) -> list[dict]:
        """The checks that decide ``passed`` (the others are informational)."""
        return [c for c in self.checks if c.get("enforced", True) is not False]

    @property
    def failed_checks(self) -> list[dict]:
        return [c for c in self.enforced if c.get("passed") is not True]

    def headline(self) -> str:
        n, info = len(self.enforced), len(self.checks) - len(self.enforced)
        extra = f"; {info} informational" if info else ""
        if self.state == "passed":
            return f"passed ({n} of {n} checks{extra})" if n else "passed"
        if self.state == "failed":
            return f"FAILED ({len(self.failed_checks)} of {n} checks failed{extra})" if n else "FAILED"
        return "not validated" if self.state == "missing" else f"not validated ({self.problem})"


def read_validation(model_dir: Path) -> Validation:
    """Read ``validation/report.json`` (+ report.md and PNG plots) of an artifact directory."""
    folder = Path(model_dir) / REPORT_DIR
    report_path = folder / "report.json"
    plots = sorted(p.relative_to(model_dir).as_posix() for p in folder.glob("*.png")) if folder.is_dir() else []
    markdown = (folder / "report.md").read_text(errors="replace") if (folder / "report.md").is_file() else None
    if not report_path.is_file():
        return Validation("missing", markdown=markdown, plots=plots, problem="validation/report.json is missing")
    try:
        report = read_json(report_path, HubError)
    except HubError as e:
        return Validation("unreadable", plots=plots, problem=f"validation/report.json is not readable JSON ({e})")
    if not isinstance(report, dict) or not isinstance(report.get("passed"), bool):
        return Validation("unreadable", plots=plots, problem='validation/report.json has no boolean "passed"')
    v = Validation("passed" if report["passed"] else "failed", report, markdown, plots)
    if not v.passed:
        shown = [_check_text(c) for c in v.failed_checks[:5]]
        v.problem = "validation failed" + (": " + "; ".join(shown) if shown else "")
        if len(v.failed_checks) > 5:
            v.problem += f"; and {len(v.failed_checks) - 5} more"
    return v


def _check_text(check: dict) -> str:
    text = str(check.get("name", "?"))
    if "value" in check:
        text += f" = {_fmt(check['value'])}"
    if "threshold" in check:
        text += f" (threshold {_fmt(check['threshold'])})"
    return text


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


# --- facts ------------------------------------------------------------------------------------
def artifact_facts(model_dir: Path) -> dict:
    """config.json, provenance and storage facts the card and the push summary need."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise HubError(f"{model_dir}: no config.json; is this an esmc-mlx output directory?")
    try:
        config = read_config(model_dir)  # bounded, its fields checked
    except EsmcMlxError as e:
        raise HubError(str(e)) from None
    try:
        facts = describe(model_dir)
    except Exception as e:  # a config or shard that does not parse: say which artifact, not a traceback
        raise HubError(f"{model_dir}: cannot describe the artifact ({e})") from None
    quantized, linear = set(), set()
    for shard in weight_files(model_dir):
        for name, meta in safetensors_header(shard).items():
            if name.endswith(".scales"):
                quantized.add(name[: -len(".scales")])
            elif name.endswith(".weight") and len(meta.get("shape", ())) == 2:
                linear.add(name[: -len(".weight")])
    return {
        "config": config,
        "meta": config.get("esmc_mlx") or {},
        "describe": facts,
        "quantized_layers": sorted(quantized),
        "matrices": sorted(linear | quantized),
    }


def base_model_of(meta: dict) -> str | None:
    """The source's Hub repo id, when the artifact was converted from one (not a local path)."""
    source_id = (meta.get("source") or {}).get("id") or ""
    if is_repo_id(source_id) and not source_id.startswith("esmc-mlx/"):  # esmc-mlx/...: a bundled model
        return source_id
    return None


def rerun_reference(meta: dict, validation: Validation | None = None) -> str:
    """What ``esmc-mlx validate --reference`` takes to re-check the artifact: the reference its
    report names, else its source: a Hub repo id, the alias of a model bundled with esmc-mlx
    (``tiny``), or a local checkpoint by its name; ``SOURCE_CHECKPOINT`` only where neither was
    recorded."""
    report = (validation.report or {}) if validation is not None else {}
    reference = report.get("reference") if isinstance(report.get("reference"), dict) else {}
    for source_id in (reference.get("id"), (meta.get("source") or {}).get("id")):
        if not isinstance(source_id, str) or not source_id.strip():
            continue
        if source_id.startswith("esmc-mlx/"):
            return source_id.removeprefix("esmc-mlx/")
        return source_id if is_repo_id(source_id) else Path(source_id).name
    return "SOURCE_CHECKPOINT"


def _tags(config: dict, family: tuple[str, ...] = ("esmc", "protein", "protein-language-model")) -> list[str]:
    """The card's tags: mlx, the model ``family``'s, biology and the precision's."""
    tags = ["mlx", *family, "biology"]
    q = quantization_record(config) or {}
    bits = quantized_bits(q) if q else []
    if len(bits) > 1:
        tags += ["mixed_" + "_".join(map(str, bits)), "mixed-precision", "quantized"]
    elif q:
        mode = q.get("mode", "affine")
        tags += [mode if mode in FP_MODES else f"{q['bits']}-bit", "quantized"]
    else:
        tags.append(config.get("dtype", "float32"))
    return list(dict.fromkeys(tags))


def _card_data(meta: dict, base: str | None, quantized: bool, tags: list[str], pipeline_tag: str | None = None):
    """The card's YAML metadata (huggingface_hub's ``ModelCardData``): mlx, the license ``meta``
    records, the base model (``quantized`` from it where the weights are), ``tags``."""
    from huggingface_hub import ModelCardData

    return ModelCardData(
        library_name="mlx",
        license=meta.get("license") or None,
        license_name=meta.get("license_name"),
        license_link=meta.get("license_link"),
        base_model=base,
        base_model_relation="quantized" if (base and quantized) else None,
        pipeline_tag=pipeline_tag,
        tags=tags,
    )


# --- rendering ----------------------------------------------------------------------------------
def render_card(model_dir: Path, repo_id: str | None = None, endpoint: str | None = None) -> str:
    """The README.md for ``model_dir`` as it will be published under ``repo_id``.

    Raises HubError when the directory is not a readable artifact. ``huggingface_hub.ModelCard``
    parses the result (YAML metadata + markdown).
    """
    from huggingface_hub import constants

    model_dir = Path(model_dir)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    facts = artifact_facts(model_dir)
    config, meta, info = facts["config"], facts["meta"], facts["describe"]
    validation = read_validation(model_dir)
    source = meta.get("source") or {}
    base = base_model_of(meta)
    license_ = meta.get("license")
    q = config.get("quantization") or {}
    repo_id = repo_id or model_dir.name
    precision = precision_label(config)

    data = _card_data(meta, base, bool(q), _tags(config), pipeline_tag="fill-mask")
    base_link = f"[{base}]({endpoint}/{base})" if base else _local_source(source)
    revision = source.get("revision")
    hidden = config.get("hidden_size", "d")
    converter = meta.get("converter") or {}
    converted_with = f"esmc-mlx {converter.get('version', __version__)}"

    out: list[str] = ["---", data.to_yaml(), "---", "", f"# {repo_id}", ""]
    weights = f"quantized to **{precision}**" if q else f"stored as **{precision}**"
    out += [
        (f"ESMC protein language model {base_link}" if base else f"An ESMC protein language model from {base_link},")
        + " converted to [MLX](https://github.com/ml-explore/mlx) "
        f"with esmc-mlx, weights {weights}: {info['bits per weight']} bits per weight, "
        f"{info['size on disk']} on disk.",
        "",
        _validation_banner(validation),
        "",
        "| | |",
        "|---|---|",
        f"| Base model | {base_link}" + (f" at `{revision[:12]}`" if revision else "") + " |",
        f"| Architecture | {info['architecture']} |",
        f"| Parameters | {info['parameters']} |",
        f"| Weights | {info['storage']} |",
        f"| Bits per weight | {info['bits per weight']} |",
        f"| Size on disk | {info['size on disk']} in {plural(info['shards'], 'shard')} |",
        f"| Validation | {validation.headline()} |",
        f"| Converter | {converted_with} |",
        f"| License | {_license_text(license_, base, endpoint)} |",
        "",
        "## What this model is",
        "",
        BUNDLED.get(source.get("id") or "")
        or "ESM C (ESM Cambrian) is a protein language model from EvolutionaryScale, trained by masked language "
        "modelling on protein sequences. For every residue of an amino-acid sequence it gives a distribution "
        "over ESMC's 33-token vocabulary (logits are 64 wide; the extra columns are padding) and an embedding "
        f"of width {hidden}. The embeddings feed structure, function and variant-effect predictors; the "
        "masked-token probabilities score mutations directly.",
        "",
        "This repository holds that network in MLX format, for Apple-silicon Macs (Metal), NVIDIA GPUs (CUDA) "
        "and plain CPUs. It is read by the `esmc_mlx` package (no PyTorch needed)"
        + ("; transformers cannot read its MLX-quantized weights." if q else "."),
        "",
        "## Usage",
        "",
        install_text(converter.get("version", __version__)),
        "",
        "```python",
        "from esmc_mlx import load",
        "",
        f'model, tokenizer = load("{repo_id}")',
        'batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"])',
        'out = model(batch["input_ids"], attention_mask=batch["attention_mask"])',
        "out.logits             # (batch, length, 64) masked-LM logits",
        f"out.last_hidden_state  # (batch, length, {hidden}) per-residue embeddings",
        "```",
        "",
        "From the command line:",
        "",
        "```bash",
        f"hf download {repo_id} --local-dir {repo_id.split('/')[-1]}",
        f"esmc-mlx info {repo_id.split('/')[-1]}",
    ]
    reference = rerun_reference(meta, validation)
    if reference != "SOURCE_CHECKPOINT":
        out.append(f"esmc-mlx validate {repo_id.split('/')[-1]} --reference {reference}   # re-check it yourself")
    out += ["```", "", "## Conversion", ""] + _conversion_section(meta, base_link, converted_with)
    out += ["", "## Quantization", ""] + _quantization_section(config, facts, info)
    out += ["", "## Validation", ""] + _validation_section(validation, repo_id, reference)
    out += ["", MARKER, ""]
    return "\n".join(out)


def _conversion_section(meta: dict, base_link: str, converted_with: str) -> list[str]:
    """How the artifact was made: the command, the source and its files' sha256."""
    source = meta.get("source") or {}
    revision = source.get("revision")
    command = meta.get("command")
    if command:
        out = [f"Made with {converted_with} by this command:", "", "```bash", command, "```", ""]
    else:
        out = [f"Made with {converted_with} through its Python API (no command line was recorded).", ""]
    files = source.get("files") or {}
    if source:
        out.append(f"Source: {base_link}" + (f", commit `{revision}`" if revision else "") + ".")
    if files:
        out += ["", "| Source file | sha256 |", "|---|---|"] + [f"| {n} | `{h}` |" for n, h in sorted(files.items())]
    return out


def _local_source(source: dict) -> str:
    """A source that is not a Hub repo, named without the converting machine's directories."""
    if not source.get("id"):
        return "an unrecorded source"
    if source["id"] in BUNDLED:
        return f"esmc-{source['id'].removeprefix('esmc-mlx/')}, the demo model bundled with esmc-mlx"
    return f"a local checkpoint (`{Path(source['id']).name}`)"


def _license_text(license_: str | None, base: str | None, endpoint: str) -> str:
    if not license_:
        return "not recorded by the source; see the base model's card" if base else "not recorded"
    if license_ == "other" and base:
        return f"other: the license of [{base}]({endpoint}/{base}) applies"
    return f"`{license_}` (carried from the source)"


def _validation_banner(v: Validation) -> str:
    if v.passed:
        return (
            f"**Validation: passed.** All {len(v.enforced)} checks against the PyTorch reference passed; "
            "the report is [below](#validation)."
        )
    if v.state == "failed":
        return (
            f"**Validation: FAILED.** {len(v.failed_checks)} of {len(v.enforced)} checks failed "
            "(see [below](#validation)). This artifact was published anyway; do not rely on it."
        )
    return (
        "**Not validated.** This artifact carries no validation report: nothing has checked it against "
        "the PyTorch reference."
    )


def _quantization_section(config: dict, facts: dict, info: dict) -> list[str]:
    q = config.get("quantization") or {}
    dtype = config.get("dtype", "float32")
    if not q:
        return [
            f"Not quantized: every tensor is stored as {dtype} ({info['bits per weight']} bits per weight, "
            f"{info['size on disk']})."
        ]
    lines = _quantized_lines(
        q,
        f"{len(facts['quantized_layers'])} of {len(facts['matrices'])} weight matrices; every other "
        f"tensor (norms, biases and the matrices left in float) is {dtype}",
    )
    lines += [
        f"- Bits per weight: **{info['bits per weight']}** (stored bytes x 8 / parameters; scales and biases included)",
        f"- Size on disk: {info['size on disk']} ({plural(info['shards'], 'safetensors shard')})",
    ]
    return lines


def _quantized_lines(q: dict, quantized: str) -> list[str]:
    """The quantization record ``q`` in words: mode, bits, group size, what is ``quantized``, the
    per-layer overrides of a mixed recipe."""
    mode = q.get("mode", "affine")
    overrides = {k: v for k, v in q.items() if isinstance(v, (dict, bool))}
    lines = [
        f"- Mode: `{mode}`" + (" (scale and bias per group)" if mode == "affine" else " (shared scale per group)"),
        f"- Bits: {q.get('bits')}{' by default' if overrides else ''}, group size {q.get('group_size')}",
        f"- Quantized: {quantized}",
    ]
    if overrides:
        by_bits: dict[str, int] = {}
        for v in overrides.values():
            key = (
                "kept in float"
                if v is False
                else f"{v.get('bits', q.get('bits'))}-bit"
                + (f" {v['mode']}" if isinstance(v, dict) and v.get("mode") and v["mode"] != mode else "")
            )
            by_bits[key] = by_bits.get(key, 0) + 1
        counts = ", ".join(f"{plural(n, 'layer')} {k}" for k, n in sorted(by_bits.items()))
        lines.append(f"- Per-layer overrides (mixed recipe): {counts}")
    return lines


def _validation_section(v: Validation, repo_id: str, reference: str) -> list[str]:
    name = repo_id.split("/")[-1]
    recheck = f"esmc-mlx validate {name} --reference {reference}"
    if v.state in ("missing", "unreadable"):
        return [
            "Not validated: this artifact has no "
            + ("readable " if v.state == "unreadable" else "")
            + "validation report. To check it against the PyTorch reference:",
            "",
            "```bash",
            recheck,
            "```",
        ]
    lines = [f"Result: **{v.headline()}**.", ""]
    shown = set()
    if v.markdown:
        embedded = _rebase_links(_demote_headings(v.markdown.strip()), "validation/")
        shown = {p for p in v.plots if f"({p})" in embedded}
        lines += [embedded, ""]
    elif v.checks:
        lines += ["| Check | Value | Threshold | Passed |", "|---|---|---|---|"]
        lines += [
            f"| {c.get('name')} | {_fmt(c.get('value'))} | {_fmt(c.get('threshold'))} | "
            f"{'yes' if c.get('passed') is True else '**no**'} |"
            for c in v.checks
        ]
        lines.append("")
    for plot in v.plots:
        if plot not in shown:
            lines += [f"![Validation plot: {Path(plot).stem}]({plot})", ""]
    lines += [
        "The full report is [validation/report.json](validation/report.json). Re-run it with:",
        "",
        "```bash",
        recheck,
        "```",
    ]
    return lines


def _rebase_links(markdown: str, prefix: str) -> str:
    """report.md links its plot relative to validation/; the card sits one folder up."""

    def rebase(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^([a-z][a-z0-9+.-]*:|/|#)", target, re.I):
            return m.group(0)
        return f"{m.group(1)}({prefix}{target})"

    return re.sub(r"(!?\[[^\]]*\])\(([^)\s]+)\)", rebase, markdown)


def _demote_headings(markdown: str) -> str:
    """Nest the report's own headings under the card's "## Validation"."""
    return "\n".join(("##" + line) if re.match(r"^#{1,4} ", line) else line for line in markdown.splitlines())


# --- sparse autoencoders ------------------------------------------------------------------------
def render_sae_card(sae_dir: Path, repo_id: str | None = None, endpoint: str | None = None) -> str:
    """The README.md of an SAE folder (``sae_artifact``'s layout) as published under
    ``repo_id``: what it is, how to run it, its storage and its validation report."""
    from huggingface_hub import ModelCardData, constants

    sae_dir = Path(sae_dir)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    try:
        config = read_sae_config(sae_dir)
        raw = read_sae_json(sae_dir)
    except ConfigError as e:
        raise HubError(str(e)) from None
    meta = raw.get("esmc_mlx") or {}
    base = base_model_of(meta)
    validation = read_validation(sae_dir)
    repo_id = repo_id or sae_dir.name
    files = [name for name in sae_files(sae_dir) if name.endswith(".safetensors")]
    size = sum((sae_dir / name).stat().st_size for name in files)
    q = config.quantization
    storage = f"{q['bits']}-bit affine, group size {q['group_size']}" if q else config.dtype
    data = ModelCardData(
        library_name="mlx",
        base_model=base,
        base_model_relation="quantized" if base else None,
        tags=["mlx", "esmc", "sparse-autoencoder", "interpretability", "protein", "biology"],
    )
    base_link = f"[{base}]({endpoint}/{base})" if base else _local_source(meta.get("source") or {})
    layers = ", ".join(map(str, config.available_layers))
    layer = config.available_layers[-1]
    out = ["---", data.to_yaml(), "---", "", f"# {repo_id}", ""]
    out += [
        f"Sparse autoencoders (SAEs) for ESMC hidden states from {base_link}, in the published layout "
        f"(`config.json`, one `layer_{{i}}.safetensors` per backbone layer) with the matrices stored as "
        f"**{storage}**, for esmc-mlx.",
        "",
        _sae_validation_banner(validation),
        "",
        "| | |",
        "|---|---|",
        f"| Source | {base_link}"
        + (f" at `{meta['source']['revision'][:12]}`" if (meta.get("source") or {}).get("revision") else "")
        + " |",
        f"| Backbone width (d_model) | {config.d_model} |",
        f"| Codebook | {config.codebook_dim:,} features, top-{config.k} per token |",
        f"| Layers | {layers} |",
        f"| Reads | {'residual updates h[N] - h[N-1]' if config.use_residual_update_instead_of_states else 'hidden states h[N]'} |",
        f"| Matrices | {storage} (b_dec, idf and max in float32) |",
        f"| Size on disk | {human_size(size)} in {plural(len(files), 'file')} |",
        f"| Validation | {validation.headline()} |",
        "",
        "## Usage",
        "",
        "```python",
        "from esmc_mlx import load, load_sae",
        "",
        'model, tokenizer = load("MODEL")  # the backbone these SAEs were trained on',
        f'sae = load_sae("{repo_id}")  # layers are downloaded when first used',
        f'features = model.sae_features(["MKTAYIAKQRQISFVKSHFSRQ"], sae, layer={layer})',
        f"features[0].indices, features[0].values  # (tokens, {config.k}): active features of every token",
        "```",
        "",
        "```bash",
        f"esmc-mlx features MODEL --sae {repo_id} --layer {layer} --fasta proteins.fasta -o features",
        "```",
        "",
        "## Validation",
        "",
    ]
    if validation.markdown:
        out += [_rebase_links(_demote_headings(validation.markdown.strip()), "validation/"), ""]
    else:
        out += ["Not validated: this folder carries no validation report.", ""]
    out += [MARKER, ""]
    return "\n".join(out)


def _sae_validation_banner(v: Validation) -> str:
    if v.passed:
        return f"**Validation: passed.** All {len(v.enforced)} checks against the float32 SAE passed."
    if v.state == "failed":
        return f"**Validation: FAILED.** {len(v.failed_checks)} of {len(v.enforced)} checks failed; do not rely on it."
    return "**Not validated.** Nothing has compared these SAEs with the float32 ones they came from."


# --- ESMFold2 -----------------------------------------------------------------------------------
FOLD_SEQUENCE = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"


def render_fold_card(model_dir: Path, repo_id: str | None = None, endpoint: str | None = None) -> str:
    """The README.md of a fold artifact (``fold_artifact``'s layout) as published under
    ``repo_id``: what ESMFold2 is, the precision of its folding model and of its ESMC backbone,
    how to fold with it, how it was made and its validation report. HubError when the directory
    is not a readable fold artifact."""
    from huggingface_hub import constants

    model_dir = Path(model_dir)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    if not FOLD.recognise(model_dir):
        raise HubError(f"{model_dir}: its config.json does not describe an ESMFold2 model")
    facts = artifact_facts(model_dir)
    config, meta, info = facts["config"], facts["meta"], facts["describe"]
    validation = read_validation(model_dir)
    base = base_model_of(meta)
    license_ = meta.get("license")
    q = quantization_record(config) or {}
    repo_id = repo_id or model_dir.name
    name = repo_id.split("/")[-1]
    dtype = config.get("dtype", "float32")
    converter = meta.get("converter") or {}
    converted_with = f"esmc-mlx {converter.get('version', __version__)}"
    revision = (meta.get("source") or {}).get("revision")
    msa = isinstance(config.get("msa_encoder"), dict) and config["msa_encoder"].get("enabled", True) is not False

    data = _card_data(
        meta, base, bool(q), _tags(config, ("esmfold2", "esmc", "protein", "protein-structure-prediction"))
    )
    base_link = f"[{base}]({endpoint}/{base})" if base else _local_source(meta.get("source") or {})
    backbone = f"quantized to **{precision_label(config)}**" if q else f"stored as **{dtype}**"
    out: list[str] = ["---", data.to_yaml(), "---", "", f"# {repo_id}", ""]
    out += [
        (f"ESMFold2 protein structure model {base_link}" if base else f"An ESMFold2 model from {base_link},")
        + f" converted to [MLX](https://github.com/ml-explore/mlx) with esmc-mlx: the folding model stored as "
        f"**{dtype}**, its ESMC backbone {backbone}; {info['size on disk']} on disk.",
        "",
        _validation_banner(validation),
        "",
        "| | |",
        "|---|---|",
        f"| Base model | {base_link}" + (f" at `{revision[:12]}`" if revision else "") + " |",
        f"| Architecture | {info['architecture']} |",
        f"| Folding model | {info['folding parameters']} parameters, {info['folding storage']} |",
        f"| Backbone | {info['backbone']}, {info['backbone parameters']} parameters |",
        f"| Backbone weights | {info['backbone storage']}; {info['backbone bits per weight']} bits per weight |",
        f"| Size on disk | {info['size on disk']} in {plural(info['shards'], 'shard')} |",
        f"| Validation | {validation.headline()} |",
        f"| Converter | {converted_with} |",
        f"| License | {_license_text(license_, base, endpoint)} |",
        "",
        "## What this model is",
        "",
        "ESMFold2 predicts the three-dimensional structure of a protein from its amino-acid sequence. An ESMC "
        "protein language model (the backbone) reads the sequence; the hidden states of all its layers feed a "
        "folding trunk of pair updates (triangle multiplicative updates and transitions) that runs for several "
        "recycling loops; a diffusion module samples the atoms' coordinates from that representation, and a "
        "confidence head scores them (pLDDT per residue, PAE, pTM).",
        "",
        "This repository holds that network in MLX format, for Apple-silicon Macs (Metal), NVIDIA GPUs (CUDA) "
        "and plain CPUs. It is read by the `esmc_mlx` package (no PyTorch needed)"
        + ("; transformers cannot read its MLX-quantized backbone." if q else ".")
        + (
            " The checkpoint's MSA encoder is kept with the other weights; esmc-mlx folds single sequences and "
            "does not run it."
            if msa
            else ""
        ),
        "",
        "## Usage",
        "",
        install_text(converter.get("version", __version__)),
        "",
        "```bash",
        f"esmc-mlx fold {repo_id} --sequence {FOLD_SEQUENCE}",
        "```",
        "",
        "```python",
        "from esmc_mlx import load_fold",
        "",
        f'model = load_fold("{repo_id}")',
        "```",
        "",
        "To keep a local copy and describe it:",
        "",
        "```bash",
        f"hf download {repo_id} --local-dir {name}",
        f"esmc-mlx info {name}",
        "```",
        "",
        "## Conversion",
        "",
    ]
    out += _conversion_section(meta, base_link, converted_with)
    out += ["", "## Precision", ""] + _fold_precision_section(config, facts, info)
    out += ["", "## Validation", ""] + _validation_section(validation, repo_id, rerun_reference(meta, validation))
    out += ["", MARKER, ""]
    return "\n".join(out)


def _fold_precision_section(config: dict, facts: dict, info: dict) -> list[str]:
    dtype = config.get("dtype", "float32")
    folding = f"- Folding model: every tensor {dtype}"
    if dtype != "float32":
        folding += (
            ", but for those transformers keeps in float32 in a half-precision model (every norm, the Fourier "
            "noise features, the confidence head's distance bins, the distogram head, parcae.log_delta), "
            "stored as float32"
        )
    lines = [folding + "."]
    q = quantization_record(config)
    if not q:
        lines.append(f"- Backbone (ESMC): every tensor {dtype}.")
    else:
        matrices = [m for m in facts["matrices"] if m.startswith(BACKBONE)]
        lines.append("- Backbone (ESMC), quantized as esmc-mlx quantizes an ESMC:")
        lines += [
            "  " + line
            for line in _quantized_lines(
                q,
                f"{len(facts['quantized_layers'])} of the backbone's {len(matrices)} weight matrices (its blocks' "
                f"projections); its other tensors are {dtype}",
            )
        ]
    lines += [
        f"- Backbone bits per weight: **{info['backbone bits per weight']}** (stored bytes x 8 / parameters; "
        "scales and biases included)",
        f"- Size on disk: {info['size on disk']} ({plural(info['shards'], 'safetensors shard')})",
    ]
    return lines
