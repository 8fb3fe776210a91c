"""Validation of a bfloat16 / float16 / 8-bit sparse autoencoder against the SAE it was made from.

Both SAEs read the same hidden states, from one forward pass of the backbone per batch over the
validation panel's unmasked inputs (its records and its two-chain input: SAEs refuse <mask>).
For each layer, over every token:

* ``topk_agreement``: the mean over tokens of |A & B| / max(|A|, |B|), A and B the features the
  reference and the artifact find active (top-k, value > 0); 1 when both find none;
* ``value_rel_err``: the relative L2 error of the dense feature vectors, ||F - F_ref|| / ||F_ref||
  over all tokens.

Bounds are ``thresholds.SAE_QUALITY``'s row for the artifact's precision (docs/validation.md).
The report (``validation/report.json`` and ``report.md``) reads as a model's does for the model
card and ``push``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .._version import __version__
from ..artifact import REPORT_DIR
from ..outputs import add_to_marker, atomic_file, output_lock
from ..privacy import public_source_id, scrub
from ..runtime.model import ESMC
from ..runtime.sae import SparseAutoencoder
from ..tasks.sae import Probe, iter_sae_features
from ..tasks.scoring import PAD_MULTIPLE, encode, length_batches
from . import thresholds as th
from .core import Check, Report, platform_info
from .panel import build_panel

UNMASKED = ("record", "two-chain")
DENSE_ROWS = 256  # tokens scattered to dense rows at a time when comparing values


class SAEReport(Report):
    """A validation report whose ``data`` describes an SAE (the model report's fields differ)."""

    def summary(self) -> str:
        lines = [f"SAE validation: {'PASSED' if self.passed else 'FAILED'} ({self.data['precision']})"]
        for c in self.checks:
            mark = "ok  " if c.passed else "FAIL"
            lines.append(f"  {mark} {c.name} {c.detail}: {c.value:.6g} ({c.comparison} {c.threshold:g})")
        return "\n".join(lines)


def agreement(ref_idx, ref_val, idx, val) -> np.ndarray:
    """Per token, |A & B| / max(|A|, |B|) of the active (value > 0) features; 1 where neither has any."""
    out = np.ones(len(ref_idx))
    for t in range(len(ref_idx)):
        a = set(ref_idx[t][ref_val[t] > 0].tolist())
        b = set(idx[t][val[t] > 0].tolist())
        if a or b:
            out[t] = len(a & b) / max(len(a), len(b))
    return out


def squared_errors(ref_idx, ref_val, idx, val, codebook_dim: int) -> tuple[float, float]:
    """(sum of squared differences, sum of squared reference values) of the dense features."""
    diff, norm = 0.0, 0.0
    for start in range(0, len(ref_idx), DENSE_ROWS):
        rows = slice(start, start + DENSE_ROWS)
        dense = np.zeros((len(ref_idx[rows]), codebook_dim), np.float64)
        np.put_along_axis(dense, ref_idx[rows].astype(np.int64), -ref_val[rows].astype(np.float64), axis=1)
        norm += float((ref_val[rows].astype(np.float64) ** 2).sum())
        np.add.at(dense, (np.arange(len(dense))[:, None], idx[rows].astype(np.int64)), val[rows].astype(np.float64))
        diff += float((dense**2).sum())
    return diff, norm


def validate_sae(
    sae: SparseAutoencoder,
    reference: SparseAutoencoder,
    model: ESMC,
    *,
    layers=None,
    fasta: str | Path | None = None,
    batch_tokens: int = 4096,
    overrides: dict[str, float] | None = None,
    name: str | None = None,
) -> SAEReport:
    """Compare ``sae``'s features with ``reference``'s on the panel (``fasta``, default the
    bundled one) through ``model``, for ``layers`` (default: every layer ``sae`` holds).
    ``name``: what the report calls ``sae`` (default its own name)."""
    layers = list(sae.config.available_layers if layers is None else layers)
    panel = build_panel(fasta)
    inputs = [i for i in panel.inputs if i.kind in UNMASKED]
    encoded = encode([i.text for i in inputs])
    batches = length_batches([len(e) for e in encoded], batch_tokens, PAD_MULTIPLE)
    plan = [Probe(s, layer) for layer in layers for s in (reference, sae)]
    collected: list[list] = [[] for _ in plan]
    for _, per_probe in iter_sae_features(model, encoded, batches, plan, normalize=False):
        for p, got in enumerate(per_probe):
            collected[p].extend(got)
    bounds = th.resolve_sae(sae.config.precision, overrides)
    checks, per_layer = [], {}
    for j, layer in enumerate(layers):
        ref_idx, ref_val = (np.concatenate(x) for x in zip(*collected[2 * j]))
        idx, val = (np.concatenate(x) for x in zip(*collected[2 * j + 1]))
        agree = float(agreement(ref_idx, ref_val, idx, val).mean())
        diff, norm = squared_errors(ref_idx, ref_val, idx, val, sae.config.codebook_dim)
        err = float(np.sqrt(diff / norm)) if norm else (0.0 if diff == 0 else float("inf"))
        per_layer[layer] = {"topk_agreement": agree, "value_rel_err": err, "tokens": len(ref_idx)}
        for name, value in (("topk_agreement", agree), ("value_rel_err", err)):
            bound = bounds[name]
            passed = value >= bound if name in th.HIGHER_IS_BETTER else value <= bound
            checks.append(Check(name, "quality", value, bound, passed, detail=f"layer {layer}"))
    data = {
        "kind": "sae",
        "precision": sae.config.precision,
        "sae": {"name": name or sae.name, "config": sae.config.to_dict()},
        "reference": {"name": public_source_id(reference.name), "precision": reference.config.precision},
        "model": {"hidden_size": model.config.hidden_size, "num_hidden_layers": model.config.num_hidden_layers},
        "layers": per_layer,
        "panel": dict(panel.describe(), used=list(UNMASKED), tokens_used=int(sum(len(e) for e in encoded))),
        "thresholds": bounds,
        "esmc_mlx": __version__,
        "platform": platform_info(),
    }
    return SAEReport(all(c.passed for c in checks), checks, data)


def markdown(report: SAEReport) -> str:
    d = report.data
    lines = [
        f"# SAE validation: {'passed' if report.passed else 'FAILED'}",
        "",
        f"{d['sae']['name']} ({d['precision']}) against {d['reference']['name']} ({d['reference']['precision']}): "
        f"the features of both on the same hidden states, {d['panel']['tokens_used']:,} tokens of the validation "
        "panel's unmasked inputs.",
        "",
        "| Layer | Check | Value | Bound | Passed |",
        "|---|---|---|---|---|",
    ]
    for c in report.checks:
        lines.append(
            f"| {c.detail.removeprefix('layer ')} | {c.name} | {c.value:.6g} | {c.comparison} {c.threshold:g} | "
            f"{'yes' if c.passed else '**no**'} |"
        )
    lines += [
        "",
        "topk_agreement: mean over tokens of |A & B| / max(|A|, |B|), A and B the active features of the "
        "reference and of this SAE. value_rel_err: relative L2 error of the dense features.",
        "",
    ]
    return "\n".join(lines)


def write_sae_report(report: SAEReport, directory: Path) -> Path:
    """report.json and report.md into ``directory`` (each whole), recorded in the folder's marker."""
    directory.mkdir(parents=True, exist_ok=True)
    # published with the SAE: local paths as basenames (privacy.scrub), as a model's report
    payload = scrub({"passed": report.passed, "checks": [c.as_dict() for c in report.checks], **report.data})
    with output_lock(directory):
        with atomic_file(directory / "report.json") as f:
            f.write(json.dumps(payload, indent=1, allow_nan=False) + "\n")
        with atomic_file(directory / "report.md") as f:
            f.write(markdown(report))
    add_to_marker(directory.parent, directory.name)
    report.directory = directory
    return directory


__all__ = ["REPORT_DIR", "SAEReport", "validate_sae", "write_sae_report"]
