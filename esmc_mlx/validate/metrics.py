"""The figures of a report, from unpadded per-input outputs (numpy, fp32).

Fidelity compares every attended position, all 64 logits (the function, dead columns included).
Quality compares residue positions (``<cls>``/``<eos>`` left out) over the 33 tokens of the
vocabulary (columns 33-63 are never produced by the tokenizer and carry no distribution).
"""

from __future__ import annotations

import numpy as np

from ..runtime.tokenizer import ESMCTokenizer
from ..tasks.stats import spearman as rank_correlation  # equals scipy's spearmanr (tested)
from ..vocab import AMINO_ACIDS, VOCAB
from .panel import Panel
from .reference import Outputs

V = len(VOCAB)
AA_IDS = np.array([ESMCTokenizer.token_to_id[a] for a in AMINO_ACIDS])


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||, in float64; 0 when both are zero."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den > 0 else float(num)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_per_position(reference_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(reference || artifact) of the token distributions at each position, in nats."""
    lp, lq = log_softmax(reference_logits[:, :V]), log_softmax(logits[:, :V])
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def _rows(panel: Panel, kinds=None) -> list[int]:
    return [i for i, inp in enumerate(panel.inputs) if kinds is None or inp.kind in kinds]


def fidelity(panel: Panel, mlx: Outputs, ref: Outputs) -> dict:
    """The MLX runtime against torch on the artifact's own weights."""
    rows = range(len(panel.inputs))
    logits_mlx = np.concatenate([mlx.logits[i] for i in rows])
    logits_ref = np.concatenate([ref.logits[i] for i in rows])
    per_input = {}
    for i in _rows(panel, ("record", "two-chain", "masked")):
        d = np.linalg.norm(mlx.logits[i] - ref.logits[i], axis=-1)
        n = np.linalg.norm(ref.logits[i], axis=-1)
        per_input[panel.inputs[i].name] = {
            "logits_rel_l2": rel_l2(mlx.logits[i], ref.logits[i]),
            "per_position": (d / np.maximum(n, 1e-30))[1:-1],
        }
    return {
        "logits_rel_l2": rel_l2(logits_mlx, logits_ref),
        "hidden_rel_l2": rel_l2(
            np.concatenate([mlx.hidden[i] for i in rows]), np.concatenate([ref.hidden[i] for i in rows])
        ),
        "logits_max_abs_diff": float(np.abs(logits_mlx - logits_ref).max()),
        "positions": int(logits_ref.shape[0]),
        "per_input": per_input,
    }


def identity_accuracy(panel: Panel, out: Outputs) -> float:
    """Fraction of unmasked standard residues of the panel records that the model's top-1
    prediction reproduces: ~1 for a trained masked LM, ~1/33 for random weights."""
    hits = total = 0
    for i in _rows(panel, ("record",)):
        ids = np.array([ESMCTokenizer.token_to_id[t] for t in panel.inputs[i].tokens])
        keep = np.isin(ids, AA_IDS)
        pred = out.logits[i][1:-1, :V].argmax(-1)
        hits += int((pred[keep] == ids[keep]).sum())
        total += int(keep.sum())
    return hits / total if total else float("nan")


def masked_marginals(panel: Panel, out: Outputs) -> np.ndarray:
    """log p(mutant) - log p(wild type) at the masked position of every marginal row, for every
    substitution to another standard amino acid, in a fixed order."""
    scores = []
    for i in _rows(panel, ("marginal",)):
        _, pos, wt = panel.inputs[i].marginal
        lp = log_softmax(out.logits[i][pos + 1, :V])
        wt_id = ESMCTokenizer.token_to_id[wt]
        scores.extend(lp[a] - lp[wt_id] for a in AA_IDS if a != wt_id)
    return np.array(scores)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 3:
        return float("nan")

    return rank_correlation(a, b)


def quality(panel: Panel, artifact: Outputs, original: Outputs) -> dict:
    """The artifact (as MLX runs it) against the original checkpoint (torch)."""
    rows = _rows(panel)
    seq_rows = _rows(panel, ("record", "two-chain", "masked"))
    kl_all, top1_hits, per_input = [], 0, {}
    la, lo, ha, ho = [], [], [], []
    cosines = {}
    for i in rows:
        a, o = artifact.logits[i][1:-1, :V], original.logits[i][1:-1, :V]
        kl = kl_per_position(o, a)
        kl_all.append(kl)
        top1_hits += int((a.argmax(-1) == o.argmax(-1)).sum())
        la.append(a)
        lo.append(o)
        hidden_a, hidden_o = artifact.hidden[i][1:-1], original.hidden[i][1:-1]
        ha.append(hidden_a)
        ho.append(hidden_o)
        if i in seq_rows:
            ea, eo = hidden_a.astype(np.float64).mean(0), hidden_o.astype(np.float64).mean(0)
            cos = float(ea @ eo / max(np.linalg.norm(ea) * np.linalg.norm(eo), 1e-300))
            name = panel.inputs[i].name
            cosines[name] = cos
            per_input[name] = {
                "kl_mean": float(kl.mean()),
                "kl_max": float(kl.max()),
                "top1": float((a.argmax(-1) == o.argmax(-1)).mean()),
                "logits_rel_err": rel_l2(a, o),
                "embedding_cosine": cos,
                "per_position_kl": kl,
                "masked_positions": [p for p, t in enumerate(panel.inputs[i].tokens) if t == "<mask>"],
            }
    kl_all = np.concatenate(kl_all)
    ma, mo = masked_marginals(panel, artifact), masked_marginals(panel, original)
    return {
        "kl_mean": float(kl_all.mean()),
        "kl_max": float(kl_all.max()),
        "top1": top1_hits / len(kl_all),
        "logits_rel_err": rel_l2(np.concatenate(la), np.concatenate(lo)),
        "hidden_rel_err": rel_l2(np.concatenate(ha), np.concatenate(ho)),
        "embedding_cosine": min(cosines.values()) if cosines else float("nan"),
        "spearman": spearman(ma, mo),
        "spearman_scores": int(len(ma)),
        "positions": int(len(kl_all)),
        "identity_accuracy": {
            "original": identity_accuracy(panel, original),
            "artifact": identity_accuracy(panel, artifact),
        },
        "per_input": per_input,
    }
