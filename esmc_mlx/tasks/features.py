"""``esmc-mlx features``: sparse autoencoder features of every residue of a FASTA file (or of one
sequence), stored sparse and resumable, with a per-protein summary and heatmaps.

Layout of OUT (an ``EmbeddingStore``: parts while running, merged at the end; see ``tasks.store``)::

    OUT/manifest.json            settings and state ({"complete": true} once merged)
    OUT/index.tsv                id, length, sha1; record i's rows are offsets[i]:offsets[i+1]
    OUT/offsets.npy              (N + 1,) int64
    OUT/layer{N}_indices.npy     (residues, k) int32: the k active features of each residue
    OUT/layer{N}_values.npy      (residues, k) float32: their activations, largest first
    OUT/summary.csv              per protein and layer, its --top most active features
    OUT/heatmap_<id>.png         the top features along the sequence (with the plot extra)

Rows are residues: the features of ``<cls>`` and ``<eos>`` (which ``sae_features`` returns) are
not stored. A rerun skips the records already there; it resumes only with the same model, SAE,
layers and ``normalize``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import numpy as np

from ..errors import JobError
from ..outputs import atomic_file, guard, guarded, held
from ..runtime.model import ESMC
from ..runtime.sae import SparseAutoencoder, load_sae
from .distributed import World
from .fasta import Record, iter_fasta
from .heatmap import check_plotting
from .jobs import (
    CHUNK_RECORDS,
    GATHER_BYTES,
    GATHER_ROUNDS,
    RecordIndex,
    _model,
    _rank_zero,
    agree_on_output,
    check_batch_memory,
    check_fasta_file,
    check_input_options,
    check_stems,
    fill_store,
    input_records,
    open_store,
)
from .sae import SAEFeatures, iter_sae_features, probes
from .scan import safe_name
from .scoring import default_batch_tokens, positive_int
from .store import EmbeddingStore, record_index

DEFAULT_TOP = 10  # features per protein and layer in summary.csv and the heatmap
SUMMARY = "summary.csv"
SUMMARY_COLUMNS = (
    "id",
    "layer",
    "rank",
    "feature",
    "residues_active",
    "mean_activation",
    "max_activation",
    "max_position",
    "positions",
)


class FeatureStore(EmbeddingStore):
    FORMAT = "esmc-mlx-sae-features"
    KIND = "SAE features"
    COMMAND = "features"
    SETTINGS_KEYS = ("layers", "normalize", "storage", "model_weights", "sae_weights")


def array_name(layer: int, part: str) -> str:
    return f"layer{layer}_{part}"


@dataclasses.dataclass
class StoredFeatures:
    """A completed ``esmc-mlx features`` directory, read back (arrays as memory maps)."""

    ids: list[str]
    layers: tuple[int, ...]
    codebook_dim: int
    sae: str
    arrays: dict
    offsets: np.ndarray

    def get(self, key: int | str, layer: int | None = None) -> SAEFeatures:
        """Record ``key``'s features (an index or an ID), one row per residue."""
        if layer is None and len(self.layers) == 1:
            layer = self.layers[0]
        if layer not in self.layers:
            raise JobError(f"no features of layer {layer!r} here (stored: layers {list(self.layers)})")
        i = record_index(self.ids, key)
        a, b = self.offsets[i], self.offsets[i + 1]
        top = np.asarray(self.arrays[array_name(layer, "indices")][a:b])
        vals = np.asarray(self.arrays[array_name(layer, "values")][a:b])
        return SAEFeatures(top, vals, self.codebook_dim, layer, self.sae)


def read_features(out: str | Path) -> StoredFeatures:
    """Open a completed ``esmc-mlx features`` directory. Raises JobError when it is not one."""
    manifest, merged = FeatureStore(out).completed()
    return StoredFeatures(
        merged["ids"],
        tuple(manifest["layers"]),
        int(manifest["codebook_dim"]),
        manifest.get("sae", ""),
        merged["arrays"],
        merged["offsets"],
    )


@dataclasses.dataclass
class FeaturesSummary:
    out: Path
    total: int
    skipped: int
    computed: int
    dropped: int = 0
    heatmaps: int = 0
    rank: int = 0
    world_size: int = 1


def _records(sequence: str | None, fasta, name: str | None):
    """A fresh iterator over the input records (a --sequence is one record named ``name``)."""
    check_input_options(sequence, fasta, name)
    if fasta is not None:
        check_fasta_file(fasta, "features")
        return lambda: iter_fasta(fasta)
    record = Record(*input_records(sequence, None, name)[0])
    return lambda: iter([record])


@guarded(
    "out", "features", "folder", inputs=("model", "sae", "fasta", "sequence"), when=_rank_zero, agree=agree_on_output
)
def features_job(
    model: ESMC | str | Path,
    sae: SparseAutoencoder | str | Path,
    out: str | Path,
    *,
    sequence: str | None = None,
    fasta: str | Path | None = None,
    name: str | None = None,
    layers=None,
    normalize: bool = False,
    top: int = DEFAULT_TOP,
    plot: bool | None = None,
    batch_tokens: int | None = None,
    force: bool = False,
    drop_missing: bool = False,
    flush_every: int = 256,
    flush_seconds: float = 60.0,
    chunk_records: int = CHUNK_RECORDS,
    group=None,
    progress: bool = False,
    model_name: str | None = None,
) -> FeaturesSummary:
    """SAE features of every residue of ``fasta`` (or of ``sequence``, a protein or a FASTA file
    of one record, named ``name``) into the directory ``out``, resuming from what is there.
    ``sae``: an SAE from ``load_sae`` or a folder / Hub id to load; ``layers``: the backbone
    hidden states (default: the SAE's only one), all from one forward per batch. ``top``:
    features per protein and layer in summary.csv and the heatmaps. ``plot``: draw
    ``heatmap_<id>.png`` (default: for a --sequence only). Runs under ``mlx.launch`` as embed.

    Raises FastaError / SequenceError for bad input (``<mask>`` included), JobError for an output
    directory holding other settings or another tool's files, ScoringError for a layer the SAE
    or the model lacks."""
    world = World.of(group)
    batch_tokens = positive_int(default_batch_tokens() if batch_tokens is None else batch_tokens, "batch_tokens")
    top = positive_int(top, "top")
    records = _records(sequence, fasta, name)
    plot = sequence is not None if plot is None else plot
    if plot and world.is_root:
        check_plotting()
    index = RecordIndex.read(records())  # every record checked before the model loads
    if plot:
        check_stems(index.ids, fasta, "heatmap_{}.png")
    model, model_name = _model(model, model_name)
    if not isinstance(sae, SparseAutoencoder):
        sae = load_sae(sae)
    plan = probes(model, sae, layers)
    check_batch_memory(model, index, batch_tokens, fasta or "--sequence", hidden_states=False)
    layers = [p.layer for p in plan]
    k, names = sae.config.k, {(layer, part): array_name(layer, part) for layer in layers for part in PARTS}
    settings = {
        "layers": layers,
        "normalize": bool(normalize),
        "storage": "npy",
        "dtype": "float32",
        "hidden_size": model.config.hidden_size,
        "num_hidden_layers": model.config.num_hidden_layers,
        "codebook_dim": sae.config.codebook_dim,
        "k": k,
        "arrays": list(names.values()),
        "array_layouts": {n: [k, PARTS[part]] for (_, part), n in names.items()},
        "rows": "one per residue, in sequence order (<cls> and <eos> are not stored)",
        "model": model_name,
        "model_weights": model.fingerprint(),
        "sae": sae.name,
        "sae_weights": sae.fingerprint(layers),
        "input": str(fasta) if fasta is not None else "--sequence",
    }
    store = FeatureStore(out, held(out)) if world.is_root else None
    is_done, id_index = open_store(
        store, world, settings, index, force=force, drop_missing=drop_missing, source=fasta or "--sequence"
    )
    skipped = int(is_done.sum())

    def compute(encoded, batches):
        for rows, per_probe in iter_sae_features(model, encoded, batches, plan, normalize):
            values = {}
            for layer, got in zip(layers, per_probe):  # residue rows: <cls> and <eos> dropped
                values[names[layer, "indices"]] = np.concatenate([t[1:-1] for t, _ in got])
                values[names[layer, "values"]] = np.concatenate([v[1:-1] for _, v in got])
            yield rows, values

    round_bytes = 4 * len(names) * k * batch_tokens
    computed = fill_store(
        store,
        world,
        records,
        index,
        is_done,
        compute,
        lambda held: _pack(held, names, k),
        lambda flat, lengths: _unpack(flat, names, k),
        every=max(1, min(GATHER_ROUNDS, GATHER_BYTES // round_bytes)) if world.size > 1 else 1,
        batch_tokens=batch_tokens,
        chunk_records=chunk_records,
        flush_every=flush_every,
        flush_seconds=flush_seconds,
        progress=progress,
        desc="features",
    )
    world.barrier()
    dropped, drawn = 0, 0
    if store is not None:
        dropped = store.merge(index.ids, index.lengths, index.hashes, settings, id_index)
        drawn = write_summary(read_features(out), records, Path(out), top, plot)
    return FeaturesSummary(Path(out), len(index.ids), skipped, computed, dropped, drawn, world.rank, world.size)


PARTS = {"indices": "int32", "values": "float32"}


def _pack(held: list[dict], names: dict, k: int) -> np.ndarray:
    """Batches' arrays side by side as one int32 block (values' bits as int32): one gather."""
    if not held:
        return np.zeros((0, k * len(names)), np.int32)
    columns = [np.concatenate([v[n] for v in held]).view(np.int32) for n in names.values()]
    return np.concatenate(columns, axis=1)


def _unpack(flat: np.ndarray, names: dict, k: int) -> dict[str, np.ndarray]:
    out = {}
    for j, ((_, part), n) in enumerate(names.items()):
        block = np.ascontiguousarray(flat[:, j * k : (j + 1) * k])
        out[n] = block.view(np.float32) if part == "values" else block
    return out


# --- summary and heatmaps ---------------------------------------------------------------------


def top_features(features: SAEFeatures, top: int) -> list[dict]:
    """The ``top`` features of one record (rows = residues) by total activation: how many
    residues each is active at, its mean over all residues, its maximum, where that is (1-based
    residue number) and every residue it is active at (``3-7;12``)."""
    idx, vals = features.indices.astype(np.int64), features.values
    n = len(idx)
    active = vals > 0
    totals = np.bincount(idx[active], weights=vals[active], minlength=features.codebook_dim)
    ranked = [int(f) for f in _largest(totals, top)]
    # Every ranked feature's activation along the residues in one pass over the (n, k) entries
    # (a feature appears at most once in a residue's k).
    slot = np.full(features.codebook_dim, -1, np.int64)
    slot[ranked] = np.arange(len(ranked))
    residue, column = np.nonzero(active & (slot[idx] >= 0))
    profiles = np.bincount(
        slot[idx[residue, column]] * n + residue, weights=vals[residue, column], minlength=len(ranked) * n
    ).reshape(len(ranked), n)
    rows = []
    for rank, f in enumerate(ranked, 1):
        per_residue = profiles[rank - 1].astype(np.float32)
        where = np.nonzero(per_residue)[0]
        rows.append(
            {
                "rank": rank,
                "feature": int(f),
                "residues_active": len(where),
                "mean_activation": float(totals[f] / n),
                "max_activation": float(per_residue.max()),
                "max_position": int(per_residue.argmax()) + 1,
                "positions": _ranges(where + 1),
                "profile": per_residue,
            }
        )
    return rows


def _largest(totals: np.ndarray, top: int) -> np.ndarray:
    """The indices of the ``top`` largest positive ``totals``, largest first, ties by index (a
    stable sort of the entries at or above the top-th value, not of the whole codebook)."""
    candidates = np.flatnonzero(totals > 0)
    if len(candidates) > top:
        cut = np.partition(totals[candidates], len(candidates) - top)[len(candidates) - top]
        candidates = candidates[totals[candidates] >= cut]
    return candidates[np.argsort(-totals[candidates], kind="stable")][:top]


def _ranges(positions: np.ndarray) -> str:
    """1-based positions as runs: [3, 4, 5, 9] -> ``3-5;9``."""
    if not len(positions):
        return ""
    breaks = np.nonzero(np.diff(positions) != 1)[0]
    starts = np.concatenate([[positions[0]], positions[breaks + 1]])
    ends = np.concatenate([positions[breaks], [positions[-1]]])
    return ";".join(str(a) if a == b else f"{a}-{b}" for a, b in zip(starts, ends))


def write_summary(stored: StoredFeatures, records, out: Path, top: int, plot: bool) -> int:
    """Write OUT/summary.csv (tidy: one row per protein, layer and top feature) and, with
    ``plot``, each protein's heatmap that is not drawn yet. Returns how many heatmaps were drawn."""
    drawn = 0
    with guard(out, "features", "folder") as folder, folder.file(SUMMARY, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(SUMMARY_COLUMNS)
        for i, record in enumerate(records()):
            per_layer = {}
            for layer in stored.layers:
                ranked = top_features(stored.get(i, layer), top)
                per_layer[layer] = ranked
                for row in ranked:
                    writer.writerow([record.id, layer] + [_fmt(row[c]) for c in SUMMARY_COLUMNS[2:]])
            heatmap = f"heatmap_{safe_name(record.id)}.png"
            if plot and not (folder.owns(heatmap) and (out / heatmap).is_file()):
                plot_features(folder.claim(heatmap), record, per_layer, stored.sae)
                drawn += 1
    return drawn


def _fmt(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def plot_features(path: Path, record: Record, per_layer: dict[int, list[dict]], sae: str) -> Path:
    """One panel per layer: the top features (rows) along the residues (columns), coloured by
    activation. Needs matplotlib (``esmc-mlx[plot]``)."""
    check_plotting()
    from matplotlib.figure import Figure

    n = len(record.sequence)
    width = min(24.0, max(6.0, 1.5 + n * 0.08))
    heights = [max(1, len(rows)) * 0.22 + 0.6 for rows in per_layer.values()]
    fig = Figure(figsize=(width, sum(heights) + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(len(per_layer), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (layer, rows) in zip(axes, per_layer.items()):
        profile = np.array([r["profile"] for r in rows]) if rows else np.zeros((1, n))
        image = ax.imshow(profile, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_yticks(range(len(rows)), [str(r["feature"]) for r in rows], fontsize=6)
        ax.set_ylabel(f"layer {layer}\nfeature", fontsize=7)
        step = max(1, 10 ** math.floor(math.log10(max(n, 1))) // 10 * (5 if n > 500 else 1))
        ticks = [p for p in range(n) if (p + 1) % step == 0]
        ax.set_xticks(ticks, [str(p + 1) for p in ticks], fontsize=6)
        fig.colorbar(image, ax=ax, pad=0.01).ax.tick_params(labelsize=6)
    axes[-1].set_xlabel("residue", fontsize=7)
    fig.suptitle(f"{record.id}: top SAE features ({sae})", fontsize=8)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    return path
