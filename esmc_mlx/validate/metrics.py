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


# --- ESMFold2 -------------------------------------------------------------------------------------
# A fold's outputs, as validate/fold.py gathers them from either side: "coords" (S, A, 3) angstrom,
# "distogram" (L, L, bins), "plddt" (S, L) on a 0-1 scale, "pae" (S, L, L) angstrom, "ptm" and
# "iptm" (S,). ``features`` are the fold's inputs (``tasks.fold.protein_features``).
CA_NAME = (ord("C") - 32, ord("A") - 32, 0, 0)  # " CA " as the featurizer encodes atom names
LDDT_CUTOFF = 15.0  # angstrom: pairs closer than this in the reference are scored
LDDT_THRESHOLDS = (0.5, 1.0, 2.0, 4.0)


def ca_atoms(features: dict) -> np.ndarray:
    """The atom index of each residue's C-alpha (one per token, in token order)."""
    names = np.asarray(features["ref_atom_name_chars"])[0]
    real = np.asarray(features["atom_attention_mask"])[0].astype(bool)
    index = np.flatnonzero(real & (names == np.array(CA_NAME)).all(axis=-1))
    tokens = np.asarray(features["atom_to_token"])[0][index]
    if len(index) != len(np.asarray(features["attention_mask"])[0]) or np.any(np.diff(tokens) <= 0):
        raise ValueError("features without exactly one C-alpha per residue")
    return index


def superposed(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x`` (N, 3) moved by the rotation and translation that best fit it onto ``y`` (Kabsch,
    least squares, no reflection), in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    cx, cy = x - x.mean(0), y - y.mean(0)
    u, _, vt = np.linalg.svd(cx.T @ cy)
    d = np.sign(np.linalg.det(u @ vt)) or 1.0
    rotation = u @ np.diag([1.0, 1.0, d]) @ vt
    return cx @ rotation + y.mean(0)


def rmsd_after_superposition(x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(RMSD of ``x`` onto ``y`` after superposition, each point's deviation there), angstrom."""
    deviation = np.linalg.norm(superposed(x, y) - np.asarray(y, np.float64), axis=-1)
    return float(np.sqrt((deviation**2).mean())), deviation


def lddt(model: np.ndarray, reference: np.ndarray, cutoff: float = LDDT_CUTOFF) -> float:
    """Global lDDT of ``model`` (N, 3) against ``reference`` (Mariani et al. 2013, as AlphaFold
    computes it): over the pairs i != j closer than ``cutoff`` in the reference, the share of
    distances the model keeps within 0.5, 1, 2 and 4 angstrom, averaged over the four. No
    superposition: it compares distances. 1 for identical structures."""
    model, reference = np.asarray(model, np.float64), np.asarray(reference, np.float64)
    d_ref = np.linalg.norm(reference[:, None] - reference[None], axis=-1)
    d_model = np.linalg.norm(model[:, None] - model[None], axis=-1)
    scored = (d_ref < cutoff) & ~np.eye(len(reference), dtype=bool)
    error = np.abs(d_model - d_ref)[scored]
    if not len(error):
        return float("nan")
    return float(np.mean([(error < t).mean() for t in LDDT_THRESHOLDS]))


def ca_geometry(ca: np.ndarray, asym_id: np.ndarray, distance: float, tolerance: float) -> tuple[int, int]:
    """(consecutive C-alpha pairs of a chain ``distance`` +- ``tolerance`` apart, such pairs in
    all): a trained model's structures put nearly all of them at 3.8 angstrom."""
    same_chain = np.asarray(asym_id)[1:] == np.asarray(asym_id)[:-1]
    gaps = np.linalg.norm(np.diff(np.asarray(ca, np.float64), axis=0), axis=-1)[same_chain]
    return int((np.abs(gaps - distance) <= tolerance).sum()), int(len(gaps))


def distance_bins(coords: np.ndarray, features: dict, boundaries: np.ndarray) -> np.ndarray:
    """(S, L, L) the bin of each token pair's representative-atom distance, as the confidence
    head bins a sampled structure (``distance > boundary`` counted): a hard threshold."""
    rep = np.asarray(coords, np.float64)[:, np.asarray(features["distogram_atom_idx"])[0]]
    distance = np.linalg.norm(rep[:, :, None] - rep[:, None], axis=-1)
    return (distance[..., None] > np.asarray(boundaries, np.float64)).sum(-1)


def fold_fidelity(proteins: list[tuple[str, dict]], mlx: list[dict], ref: list[dict], boundaries: np.ndarray) -> dict:
    """The MLX fold against transformers' on the same weights and draws, per protein and worst
    over the panel: distogram logits rel. L2, the largest C-alpha and atom deviation (angstrom,
    no superposition: the same draws place both in the same frame), the largest pLDDT, PAE and pTM
    error. The confidence head bins the sampled structure's distances at ``boundaries``: a pair
    within the coordinates' own deviation (~1e-4 angstrom) of a boundary lands in different bins
    on the two sides and moves that sample's confidences by far more than the arithmetic does.
    Such samples (``bin_flips``, counted and reported) are left out of the confidence figures;
    their coordinates still count, and a fold that is wrong moves them past ``fidelity_ca``."""
    per_input = {}
    for (name, features), a, b in zip(proteins, mlx, ref):
        real = np.asarray(features["atom_attention_mask"])[0].astype(bool)
        deviation = np.linalg.norm(np.asarray(a["coords"], np.float64) - b["coords"], axis=-1)  # (S, A)
        ca = deviation[:, ca_atoms(features)]
        flips = distance_bins(a["coords"], features, boundaries) != distance_bins(b["coords"], features, boundaries)
        flips = flips.reshape(len(flips), -1).sum(-1)
        same = flips == 0  # the samples whose confidence heads read the same bins
        per_input[name] = {
            "distogram_rel_l2": rel_l2(a["distogram"], b["distogram"]),
            "ca_max_dev": float(ca.max()),
            "atom_max_dev": float(deviation[:, real].max()),
            "plddt_max_err": _max_abs(a["plddt"][same], b["plddt"][same]) if same.any() else 0.0,
            "pae_max_err": _max_abs(a["pae"][same], b["pae"][same]) if same.any() else 0.0,
            "ptm_err": _max_abs(a["ptm"][same], b["ptm"][same]) if same.any() else 0.0,
            "bin_flips": int(flips.sum() // 2),  # pairs (i, j) and (j, i) are one
            "samples_compared": int(same.sum()),
            "per_residue": ca.max(axis=0),
        }
    keys = ("distogram_rel_l2", "ca_max_dev", "atom_max_dev", "plddt_max_err", "pae_max_err", "ptm_err")
    worst = {k: max(v[k] for v in per_input.values()) for k in keys}
    return {**worst, "bin_flips": sum(v["bin_flips"] for v in per_input.values()), "per_input": per_input}


def fold_quality(proteins: list[tuple[str, dict]], artifact: list[dict], original: list[dict]) -> dict:
    """The artifact's fold (MLX) against the original checkpoint's (transformers), same draws,
    per protein (the worst of its samples) and worst over the panel: C-alpha RMSD after
    superposition, lDDT-C-alpha (the original's structure the reference), pLDDT and PAE mean
    absolute error, pTM (and ipTM, for complexes) absolute error."""
    per_input = {}
    for (name, features), a, o in zip(proteins, artifact, original):
        ca = ca_atoms(features)
        rmsds, deviations, lddts = [], [], []
        for s in range(len(o["coords"])):
            rmsd, deviation = rmsd_after_superposition(a["coords"][s, ca], o["coords"][s, ca])
            rmsds.append(rmsd)
            deviations.append(deviation)
            lddts.append(lddt(a["coords"][s, ca], o["coords"][s, ca]))
        worst = int(np.argmax(rmsds))
        mae = {k: float(np.abs(np.asarray(a[k], np.float64) - o[k]).mean(axis=tuple(range(1, o[k].ndim))).max())
               for k in ("plddt", "pae")}  # fmt: skip
        per_input[name] = {
            "ca_rmsd": rmsds[worst],
            "lddt_ca": float(min(lddts)),
            "plddt_mae": mae["plddt"],
            "pae_mae": mae["pae"],
            "ptm_error": _max_abs(a["ptm"], o["ptm"]),
            "iptm_error": _max_abs(a["iptm"], o["iptm"]) if len(np.unique(features["asym_id"])) > 1 else None,
            "per_residue": deviations[worst],
        }
    worst_of = {"ca_rmsd": max, "lddt_ca": min, "plddt_mae": max, "pae_mae": max, "ptm_error": max}
    return {**{k: f(v[k] for v in per_input.values()) for k, f in worst_of.items()}, "per_input": per_input}


def _max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
