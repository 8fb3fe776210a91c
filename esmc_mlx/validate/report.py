"""report.json (every figure), report.md (read in ten seconds) and per_position.png, for a
model's validation (``core.validate``) and a fold artifact's (``fold.validate_fold_artifact``,
``data["kind"] == "fold"``: its own report.md and plot, the same files and table)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..artifact import PLOT_NAME, REPORT_FILES
from ..errors import ValidationError
from ..outputs import add_to_marker, atomic_file, output_lock, read_marker, write_marker
from ..privacy import public_source_id, scrub
from ..readers import read_json
from .panel import Panel

LABELS = {
    "config": "architecture matches the reference",
    "artifact_loads": "artifact loads",
    "finite_outputs": "outputs free of NaN and Inf",
    "weights": "weights: max rel. L2 error of a tensor",
    "fidelity_logits": "logits rel. L2 (MLX vs torch, same weights)",
    "fidelity_hidden": "last hidden state rel. L2 (same weights)",
    "kl_mean": "KL(original ‖ artifact), mean per position",
    "kl_max": "KL, worst position",
    "top1": "top-1 token agreement",
    "logits_rel_err": "logits rel. L2 error",
    "hidden_rel_err": "last hidden state rel. L2 error",
    "embedding_cosine": "cosine of mean embeddings (worst sequence)",
    "spearman": "Spearman of masked-marginal scores",
    # fold artifacts (validate/fold.py)
    "fidelity_distogram": "distogram logits rel. L2 (MLX vs torch, same weights and draws)",
    "fidelity_ca": "C-alpha max deviation, Å (same weights and draws)",
    "fidelity_atoms": "all-atom max deviation, Å (same weights and draws)",
    "fidelity_plddt": "pLDDT max abs. error (same weights and draws)",
    "fidelity_pae": "PAE max abs. error, Å (same weights and draws)",
    "fidelity_ptm": "pTM max abs. error (same weights and draws)",
    "ca_rmsd": "C-alpha RMSD after superposition, Å (worst protein)",
    "lddt_ca": "lDDT-Cα (worst protein)",
    "plddt_mae": "pLDDT mean abs. error (worst protein)",
    "pae_mae": "PAE mean abs. error, Å (worst protein)",
    "ptm_error": "pTM abs. error (worst protein)",
}


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value == 0 or value == 1:
            return str(int(value))
        if 0.99 < value < 1:  # agreement figures: what is short of 1 is what matters
            return f"1 − {1 - value:.2g}"
        if 1e-3 <= abs(value) < 1e4:
            return f"{value:.4g}"
        return f"{value:.3g}"
    return str(value)


def _bound(check) -> str:
    if check.name == "config":
        return "identical"
    if check.threshold is None:
        return ""
    return f"{'≥' if check.comparison == '>=' else '≤'} {_fmt(check.threshold)}"


def _status(check) -> str:
    if not check.enforced:
        return "info" if check.passed else "info (outside bound)"
    return "pass" if check.passed else "**FAIL**"


def markdown(report, plot: str | None) -> str:
    if report.data.get("kind") == "fold":
        return fold_markdown(report, plot)
    d = report.data
    a, r, mode = d["artifact"], d["reference"], d["reference_mode"]
    quality = d.get("quality") or {}
    verdict = "PASSED" if report.passed else "FAILED"
    failed = ", ".join(c.name for c in report.failed)
    name = Path(a["path"]).name
    lines = [
        f"# Validation of {name}: {verdict}",
        "",
        f"{'All enforced checks pass.' if report.passed else 'Failed: ' + failed + '.'} "
        f"Artifact `{name}` ({_describe_precision(a)}) against `{r['id']}` ({r['dtype']}); "
        f"panel of {d['panel']['inputs']} inputs, {d['panel']['tokens']:,} tokens.",
        "",
        *_check_table(report),
        "**Fidelity**: does MLX compute what torch computes on the same (dequantized) weights? "
        "**Quality**: how far is the artifact from the original checkpoint?",
    ]
    lines.append("")
    if quality:
        acc = quality["identity_accuracy"]["original"]
        if quality.get("enforced"):
            lines.append(f"Quality bounds are those of the `{d['precision']}` row (docs/validation.md).")
        else:
            why = (
                f"the reference looks untrained (its top-1 recovers {acc:.0%} of input residues)"
                if not quality.get("reference_trained")
                else "quality gate off"
            )
            lines.append(f"Quality figures are informational: {why}.")
        lines.append("")
    if d.get("stopped_before_panel"):
        lines.append(f"Stopped before any forward pass ({d['stopped_before_panel']}): see the failed checks.")
        lines.append("")
    elif mode["torch"] is None or not quality:
        lines.append("The forward passes did not run or did not finish: see the failed checks.")
        lines.append("")
    cache = d.get("reference_cache") or {}
    lines.append(
        _footer(
            d,
            f"References: transformers `EsmcForMaskedLM` in fp32 on {mode.get('torch_device') or 'n/a'}, "
            f"{mode['torch']}{' (layer by layer)' if mode['torch'] == 'layered' else ' model'}"
            f"{'; the original from the cache' if cache.get('hit') else ''}; MLX {mode['mlx']}, "
            f"computing in {mode['mlx_compute_dtype']} on the {_mlx_device(d)}",
        )
    )
    if plot:
        lines += ["", f"![Per-position error along each panel sequence]({plot})"]
    return "\n".join(lines) + "\n"


def _check_table(report) -> list[str]:
    """The checks as a table, then the failed checks' details (what every report.md shows)."""
    lines = ["| | check | value | bound | |", "|---|---|---|---|---|"]
    for c in report.checks:
        value = "0 differences" if c.name == "config" and c.passed else _fmt(c.value)
        if c.name == "config" and not c.passed:
            value = c.detail
        lines.append(f"| {c.kind} | {LABELS.get(c.name, c.name)} | {value} | {_bound(c)} | {_status(c)} |")
    lines.append("")
    details = [f"- **{c.name}**: {c.detail}" for c in report.failed if c.detail and c.name != "config"]
    return lines + (details + [""] if details else [])


def _footer(d: dict, references: str) -> str:
    """The last paragraph: what ran where (``references``, a sentence naming the torch side and
    MLX's), versions, time and memory."""
    return (
        f"{references}. "
        f"esmc-mlx {d['versions']['esmc_mlx']}, mlx {d['versions']['mlx']}, torch {d['versions']['torch']}, "
        f"transformers {d['versions']['transformers']}; {d['resources']['seconds']:.0f} s, "
        f"peak RSS {d['resources']['peak_rss_bytes'] / 2**30:.2f} GiB. Every figure: `report.json`."
    )


def fold_markdown(report, plot: str | None) -> str:
    """report.md of a fold artifact's validation (validate/fold.py)."""
    d = report.data
    a, r, mode, panel, run = d["artifact"], d["reference"], d["reference_mode"], d["panel"], d["fold"]
    quality = d.get("quality") or {}
    name = Path(a["path"]).name
    failed = ", ".join(c.name for c in report.failed)
    complexes = panel["complexes"]
    lines = [
        f"# Validation of {name}: {'PASSED' if report.passed else 'FAILED'}",
        "",
        f"{'All enforced checks pass.' if report.passed else 'Failed: ' + failed + '.'} "
        f"Fold artifact `{name}` (folding model {a['dtype']}, ESMC backbone {_describe_backbone(a)}) against "
        f"`{r['id']}` ({r['dtype']}); panel of {panel['inputs']} proteins"
        + (f" ({complexes} of them {'a complex' if complexes == 1 else 'complexes'})" if complexes else "")
        + f", {panel['residues']:,} residues; {plural_samples(run['samples'])}, {run['steps']} steps, "
        f"{run['loops']} recycling loops, every side on the same random draws.",
        "",
        *_check_table(report),
        "**Fidelity**: does MLX fold what transformers' `EsmFold2Model` folds, on the same (dequantized) weights "
        "and the same random draws? **Quality**: how far are the artifact's structures and confidences from the "
        "original checkpoint's, on the same draws?",
        "",
    ]
    if quality:
        share = f"{quality['ca_geometry']:.0%} of consecutive C-alpha pairs 3.5-4.1 Å apart"
        if not quality.get("reference_trained"):
            lines.append(
                f"**The original looks random-weight**: its structures are not protein-like ({share}; a trained "
                "model puts nearly all there). On random weights quality figures say nothing about a lossy "
                "precision: the random network turns the rounding of a quantized (at 4 bits, any) backbone into "
                "unrelated structures. What is proven here is fidelity; for quality, check the report of the "
                "published weights."
            )
            lines.append("")
        if quality.get("enforced"):
            why = (
                "the artifact is lossless, so it must fold what the original folds whatever the weights"
                if quality.get("lossless") and not quality.get("reference_trained")
                else f"the original's structures are protein-like ({share})"
                if quality.get("reference_trained")
                else "quality gate on"
            )
            lines.append(
                f"Quality bounds are those of the `{d['precision']}` row (docs/validation.md), enforced: {why}."
            )
        else:
            why = "quality gate off" if d.get("quality_gate") == "off" else "the original looks untrained"
            lines.append(f"Quality figures are informational: {why}.")
        lines.append("")
    if d.get("stopped_before_panel"):
        lines.append(f"Not every fold ran (stopped at: {d['stopped_before_panel']}): see the failed checks.")
        lines.append("")
    shared = " (the artifact's weights are the original's: one fold served both)" if mode.get("shared") else ""
    lines.append(
        _footer(
            d,
            f"References: transformers `EsmFold2Model` in fp32 on {mode.get('torch_device') or 'n/a'}, on the "
            f"original and on the artifact's weights{shared}, the draws of its fold of the original replayed into "
            f"the other folds; MLX `load_fold`, computing in {mode['mlx_compute_dtype']} on the {_mlx_device(d)}",
        )
    )
    if plot:
        lines += ["", f"![Per-residue C-alpha deviation along each panel protein]({plot})"]
    return "\n".join(lines) + "\n"


def _mlx_device(d: dict) -> str:
    return d["platform"]["mlx_device"].split("(")[-1].split(",")[0]


def plural_samples(n: int) -> str:
    return f"{n} sample{'s' if n != 1 else ''}"


def _describe_backbone(artifact: dict) -> str:
    q = artifact.get("quantization")
    if q:
        return f"{q.get('mode', 'affine')} {q['bits']}-bit, group {q['group_size']}"
    return artifact["dtype"]


def _describe_precision(artifact: dict) -> str:
    q = artifact.get("quantization")
    if q:
        return f"{q.get('mode', 'affine')} {q['bits']}-bit, group {q['group_size']}, other tensors {artifact['dtype']}"
    return artifact["dtype"]


def text_summary(report) -> str:
    """What the CLI prints: one line per check."""
    rows = []
    for c in report.checks:
        rows.append(
            f"  {_status(c).replace('**', ''):<8} {c.name:<17} {_fmt(c.value):>10}  {_bound(c)}"
            + (f"   {c.detail}" if c.detail and not c.passed else "")
        )
    head = "PASSED" if report.passed else "FAILED (" + ", ".join(c.name for c in report.failed) + ")"
    return "\n".join([f"Validation {head}", *rows])


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Geometric running mean (the mean of log y), the right average on a log axis."""
    if len(y) < 3 or window < 2:
        return y
    window = min(window, len(y))
    logs = np.log(y)
    kernel = np.ones(window) / window
    padded = np.pad(logs, (window // 2, window - 1 - window // 2), mode="edge")
    return np.exp(np.convolve(padded, kernel, mode="valid"))


def plot(report, panel: Panel, path: Path) -> bool:
    """Per-position KL (quality) and logit error (fidelity) along each sequence, log y axis:
    faint raw values, a running geometric mean on top, ``<mask>`` inputs marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    d = report.data
    quality, fidelity = d.get("quality"), d.get("fidelity")
    if not quality or not fidelity:
        return False
    if d.get("kind") == "fold":
        return _fold_plot(report, panel, path, plt)
    inputs = [i for i in panel.inputs if i.kind in ("record", "two-chain", "masked")]
    floor = 1e-12
    fig, axes = plt.subplots(2, 1, figsize=(13, 7.5), sharex=True)
    fig.subplots_adjust(left=0.07, right=0.74, top=0.9, bottom=0.08, hspace=0.18)
    cmap = plt.get_cmap("tab20")
    for k, inp in enumerate(inputs):
        color = cmap(k % 20)
        style = {"record": "-", "two-chain": "--", "masked": ":"}[inp.kind]
        kl = np.maximum(np.asarray(quality["per_input"][inp.name]["per_position_kl"], dtype=float), floor)
        fe = np.maximum(np.asarray(fidelity["per_input"][inp.name]["per_position"], dtype=float), floor)
        x = np.arange(1, len(kl) + 1)
        window = max(5, len(kl) // 40)
        for ax, y in ((axes[0], kl), (axes[1], fe)):
            ax.plot(x, y, "-", color=color, lw=0.4, alpha=0.25)
            ax.plot(
                x,
                _smooth(y, window),
                style,
                color=color,
                lw=1.3,
                label=f"{inp.name} ({len(kl)})" if ax is axes[0] else None,
            )
        masked = quality["per_input"][inp.name].get("masked_positions") or []
        if masked:
            axes[0].plot(np.array(masked) + 1, kl[masked], "v", color=color, mec="black", mew=0.4, ms=4)
    thr = d["thresholds"]
    axes[0].axhline(thr["kl_mean"], color="crimson", ls="--", lw=1.2, label=f"bound on mean KL ({thr['kl_mean']:g})")
    axes[0].axhline(
        max(quality["kl_mean"] or floor, floor),
        color="black",
        ls="-.",
        lw=1.2,
        label=f"mean KL ({_fmt(quality['kl_mean'])})",
    )
    axes[1].axhline(
        thr["fidelity_logits"],
        color="crimson",
        ls="--",
        lw=1.2,
        label=f"bound on pooled error ({thr['fidelity_logits']:g})",
    )
    axes[1].axhline(
        max(fidelity["logits_rel_l2"] or floor, floor),
        color="black",
        ls="-.",
        lw=1.2,
        label=f"pooled error ({_fmt(fidelity['logits_rel_l2'])})",
    )
    for ax in axes:
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
    gate = "" if quality.get("enforced") else "  (informational: the reference looks untrained)"
    axes[0].set_title("Quality: KL(original ‖ artifact) per residue, nats" + gate, fontsize=10, loc="left")
    axes[1].set_title(
        "Fidelity: |Δ logits| / |logits| per residue, MLX vs torch on the artifact's weights", fontsize=10, loc="left"
    )
    axes[1].set_xlabel(
        "residue position (faint: per residue; bold: running geometric mean; "
        "dashed: two-chain; dotted: 15% masked, ▼ at <mask>)",
        fontsize=8.5,
    )
    axes[0].legend(
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        title="panel input (length)",
        title_fontsize=7.5,
        frameon=False,
    )
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _titled_and_saved(fig, plt, path, report, _describe_precision(d["artifact"]))


def _fold_plot(report, panel, path: Path, plt) -> bool:
    """Per-residue C-alpha deviation along each protein of a fold panel, log y axis: quality
    (after superposition on the original's structure) on top, fidelity (MLX against torch on the
    same weights and draws) below, the bounds drawn in and chain breaks marked."""
    d = report.data
    quality, fidelity, thr = d["quality"], d["fidelity"], d["thresholds"]
    floor = 1e-7
    fig, axes = plt.subplots(2, 1, figsize=(13, 7.5), sharex=True)
    fig.subplots_adjust(left=0.07, right=0.74, top=0.9, bottom=0.08, hspace=0.18)
    cmap = plt.get_cmap("tab10")
    for k, protein in enumerate(panel.proteins):
        color = cmap(k % 10)
        style = "--" if len(protein.chains) > 1 else "-"
        for ax, part in ((axes[0], quality), (axes[1], fidelity)):
            y = np.maximum(np.asarray(part["per_input"][protein.name]["per_residue"], dtype=float), floor)
            x = np.arange(1, len(y) + 1)
            ax.plot(
                x,
                y,
                style,
                color=color,
                lw=1.1,
                label=f"{protein.name} ({protein.residues})" if ax is axes[0] else None,
            )
            for cut in np.cumsum([len(c) for c in protein.chains])[:-1]:
                ax.axvline(cut + 0.5, color=color, ls=":", lw=0.8)
    axes[0].axhline(
        thr["ca_rmsd"], color="crimson", ls="--", lw=1.2, label=f"bound on C-alpha RMSD ({thr['ca_rmsd']:g} Å)"
    )
    axes[1].axhline(
        thr["fidelity_ca"],
        color="crimson",
        ls="--",
        lw=1.2,
        label=f"bound on the largest deviation ({thr['fidelity_ca']:g} Å)",
    )
    for ax in axes:
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
    gate = (
        ""
        if quality.get("enforced")
        else "  (informational: "
        + ("quality gate off)" if d.get("quality_gate") == "off" else "the original looks random-weight)")
    )
    axes[0].set_title(
        "Quality: C-alpha deviation from the original's structure after superposition, Å" + gate,
        fontsize=10,
        loc="left",
    )
    axes[1].set_title(
        "Fidelity: C-alpha deviation, MLX vs torch on the artifact's weights, same draws, Å", fontsize=10, loc="left"
    )
    axes[1].set_xlabel("residue (dashed: a complex, its chain breaks dotted)", fontsize=8.5)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="protein (residues)",
                   title_fontsize=7.5, frameon=False)  # fmt: skip
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _titled_and_saved(fig, plt, path, report, "backbone " + _describe_backbone(d["artifact"]))


def _titled_and_saved(fig, plt, path: Path, report, precision: str) -> bool:
    """The plot's title (the artifact, its ``precision``, the reference, the verdict), written whole
    to ``path``; the figure closed either way."""
    d = report.data
    fig.suptitle(
        f"{Path(d['artifact']['path']).name} ({precision}) vs {public_source_id(d['reference']['id'])}: "
        f"{'PASSED' if report.passed else 'FAILED'}",
        fontsize=11,
        x=0.07,
        ha="left",
    )
    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
    finally:
        plt.close(fig)
    return True


def _finite(obj):
    """``obj`` with every NaN or Inf float replaced by None (a last guard: core rounds already)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def check_report_folder(directory: Path) -> None:
    """ValidationError, before any work, for a report folder holding a report.json, report.md
    or plot that is not an esmc-mlx report's (the run would replace them): one whose report.json
    is an esmc-mlx report is a previous run's, replaced by this one."""
    present = [n for n in REPORT_FILES if (directory / n).exists()]
    if not present:
        return
    try:
        data = read_json(directory / "report.json", ValidationError)
        ours = isinstance(data, dict) and {"passed", "checks", "thresholds", "panel"} <= data.keys()
    except ValidationError:
        ours = False
    if not ours:
        raise ValidationError(
            f"{directory / present[0]} is not an esmc-mlx validation report, and the report would replace it; "
            "choose another --report folder (or move the file)"
        )


def report_entries(directory: Path) -> list[str] | None:
    """The report files of a report folder written before the .esmc-mlx marker (its
    report.json is an esmc-mlx report), or None."""
    try:
        check_report_folder(directory)
    except ValidationError:
        return None
    present = [n for n in REPORT_FILES if (Path(directory) / n).exists()]
    return present or None


def write_report(report, panel: Panel, directory: Path, draw: bool = True, own_folder: bool = False) -> Path:
    """Write report.json, the plot and report.md into ``directory``, each file whole or not at all
    (a full disk is one error naming the file). The model directory's marker records its report
    folder; a folder of its own (``validate --report DIR``, ``own_folder``) gets its own marker."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValidationError(f"cannot create the report folder {directory}: {e.strerror}") from None
    # The files may be published: local paths become relative to the artifact or basenames
    # (privacy.py); report.data, in memory, keeps them. NaN/Inf never reach JSON.
    root = (report.data.get("artifact") or {}).get("path")
    public = _finite(scrub(report.data, root))  # NaN/Inf never reach JSON
    with output_lock(directory):  # two validations of one artifact never mix their files
        if own_folder:
            marker = read_marker(directory)
            write_marker(directory, "report", [*(marker or {}).get("entries", []), *REPORT_FILES])
        with atomic_file(directory / "report.json") as f:
            f.write(json.dumps(public, indent=1, allow_nan=False) + "\n")
        drew = draw and plot(report, panel, directory / PLOT_NAME)
        if not drew and (directory / PLOT_NAME).exists():
            (directory / PLOT_NAME).unlink()
        with atomic_file(directory / "report.md") as f:
            f.write(scrub(markdown(report, PLOT_NAME if drew else None), root))
    if not own_folder:
        add_to_marker(directory.parent, directory.name)
    return directory
