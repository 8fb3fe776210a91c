"""``esmc-mlx attention``: a protein's attention maps, layer by layer, and the APC-corrected
average that serves as an unsupervised contact map.

Per protein (``<stem>`` is its FASTA ID or ``--name``), into OUT::

    <stem>_layer{N}.npy      (heads, T, T) float32: block N's attention probabilities (queries x
                             keys), every token (<cls>, residues, <eos>); the heads asked for, in
                             order. The same numbers as ``model(..., output_attentions=True)
                             .attentions[N - 1]`` (transformers' ``output_attentions``).
    <stem>_contacts.npy      (L, L) float32 over the residues: the mean over those layers and heads
                             of each map made symmetric, (A + A^T) / 2, then APC-corrected
                             (F - F_i. F_.j / F_..; Dunn et al. 2008, as ESM's contact head) unless
                             --no-apc
    <stem>_contacts.png      that map (the plot extra)
    attention-manifest.json  what each protein's files were made from (a rerun skips them)

Memory stays bounded for long proteins: the blocks run one at a time, a block's maps are
computed a few heads at a time and written as they come, and the forward's own attention runs a
few query rows at a time, so no more than about ``MAP_BYTES`` of scores is held at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import JobError, ScoringError
from ..outputs import guard, guarded, held
from ..runtime.model import ESMC, PLAIN, Ops, additive_mask, attention_mask_for
from .distributed import World
from .heatmap import check_plotting
from .jobs import _model, check_stems, input_records
from .scan import ScanManifest, safe_name
from .scoring import _pack, check_records_memory, encode
from .store import sequence_hash

MAP_BYTES = 16 << 20  # attention maps computed (and held) at a time: whole heads, at least one


class RowChunks(Ops):
    """MLX's plain ops with attention computed ``MAP_BYTES`` of scores at a time (whole query
    rows, every head): on the CPU, MLX's attention holds all (H, T, T) scores and their softmax,
    twice one block's maps."""

    def attention(self, q, k, v, scale, mask):
        rows = max(1, MAP_BYTES // (4 * q.shape[0] * q.shape[1] * k.shape[2]))
        if rows >= q.shape[2]:
            return super().attention(q, k, v, scale, mask)
        parts = []
        for start in range(0, q.shape[2], rows):
            part = mask if mask is None or mask.shape[-2] == 1 else mask[..., start : start + rows, :]
            parts.append(super().attention(q[:, :, start : start + rows], k, v, scale, part))
            mx.eval(parts[-1])
        return mx.concatenate(parts, axis=2)


ROW_CHUNKS = RowChunks()


class AttentionManifest(ScanManifest):
    NAME = "attention-manifest.json"
    FORMAT = "esmc-mlx-attention/1"
    TOOL = "attention"


def _ints(value, option: str, example: str) -> list:
    """``"1,2"``, an int or a list -> a list (its items checked by the caller)."""
    if isinstance(value, str):
        try:
            return [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise ScoringError(f"{option} {value!r}: give comma-separated {example}") from None
    return [value] if isinstance(value, numbers.Integral) else list(value)


def resolve_blocks(layers, num_layers: int) -> tuple[int, ...]:
    """``None`` (all), ``"1,15,-1"``, an int or ints -> distinct block numbers 1..n (block N
    makes hidden state N; -1 is the last), in the order given."""
    if layers is None:
        return tuple(range(1, num_layers + 1))
    out = []
    for x in _ints(layers, "layers", "block numbers like 1,15,-1"):
        if (
            isinstance(x, bool)
            or not isinstance(x, numbers.Integral)
            or not (1 <= x <= num_layers or -num_layers <= x < 0)
        ):
            raise ScoringError(f"layer {x!r}: this model's blocks are 1..{num_layers} (-1 = the last)")
        out.append(int(x) if x > 0 else num_layers + 1 + int(x))
    if not out:
        raise ScoringError("no layer given")
    return tuple(dict.fromkeys(out))


def resolve_heads(heads, num_heads: int) -> tuple[int, ...]:
    """``None`` (all), ``"0,3"``, an int or ints -> distinct head indices 0..H-1, in order given."""
    if heads is None:
        return tuple(range(num_heads))
    heads = _ints(heads, "heads", "head indices like 0,3,7")
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, numbers.Integral) or not 0 <= h < num_heads:
            raise ScoringError(f"head {h!r}: this model's heads are 0..{num_heads - 1}")
    if not heads:
        raise ScoringError("no head given")
    return tuple(dict.fromkeys(int(h) for h in heads))


def apc(x: np.ndarray) -> np.ndarray:
    """Average product correction: ``x - rowsum * colsum / total``."""
    total = x.sum()
    return x - x.sum(axis=1, keepdims=True) * x.sum(axis=0, keepdims=True) / (total if total else 1.0)


def iter_attention(model: ESMC, sequence: str, layers, heads, head_chunk: int | None = None):
    """For each block of ``layers`` (1-based), in model order: (block, heads' indices, weights
    (h, T, T) float32 numpy) a few heads at a time (``MAP_BYTES`` at a time), for one sequence;
    the residual stream runs through every block up to the last one asked for."""
    ids, _, sid = _pack(encode([sequence]), [0])
    T = ids.shape[1]
    mask = attention_mask_for(None, None if sid is None else mx.array(sid))
    mask = None if mask is None else additive_mask(mask, model.dtype)
    per = head_chunk or max(1, MAP_BYTES // (4 * T * T))
    x = model.esmc.embed_tokens(mx.array(ids))
    wanted = set(layers)
    for block, layer in enumerate(model.esmc.layers[: max(wanted)], 1):
        if block in wanted:
            attn = layer.self_attn
            q, k, _ = PLAIN.heads(attn, layer.input_layernorm(x))  # as Attention.attend's weights path
            q = q * attn.scale
            for start in range(0, len(heads), per):
                chosen = mx.array(heads[start : start + per])
                scores = q[:, chosen] @ k[:, chosen].transpose(0, 1, 3, 2)
                if mask is not None:
                    scores = scores + mask
                weights = np.array(mx.softmax(scores.astype(mx.float32), axis=-1)[0])
                del scores
                yield block, heads[start : start + per], weights
        x = layer.step(x, layer.input_layernorm(x), mask, ops=ROW_CHUNKS)[0]
        mx.eval(x)


@dataclasses.dataclass
class AttentionMaps:
    """What one protein's run wrote: files by kind, the contact map, the bytes of maps."""

    name: str
    residues: int
    files: dict[str, Path]
    contacts: np.ndarray
    nbytes: int


def write_attention(
    model: ESMC,
    sequence: str,
    out_dir: Path,
    name: str,
    layers,
    heads,
    use_apc: bool = True,
    plot: bool = True,
    head_chunk: int | None = None,
) -> AttentionMaps:
    """Write one protein's per-layer maps, contact map and plot into the attention folder
    ``out_dir`` (``outputs.OutputFolder``: a new or empty folder, or one esmc-mlx made for
    attention maps); the files are written aside and go into place together, or none of them.
    The layout is this module's docstring."""
    stem = safe_name(name)
    T, L = len(sequence) + 2, len(sequence)
    names: dict[str, str] = {}
    total = np.zeros((L, L), np.float64)
    count, nbytes = 0, 0
    chunks = iter_attention(model, sequence, layers, heads, head_chunk)
    with guard(out_dir, "attention", "folder") as folder, folder.files() as staged:
        for block, group in itertools.groupby(chunks, key=lambda chunk: chunk[0]):
            names[f"layer{block}"] = f"{stem}_layer{block}.npy"
            with staged.open(names[f"layer{block}"], "wb") as f:  # the .npy format, a few heads at a time
                np.lib.format.write_array_header_1_0(
                    f, {"descr": "<f4", "fortran_order": False, "shape": (len(heads), T, T)}
                )
                for _, chosen, weights in group:
                    f.write(np.ascontiguousarray(weights, dtype="<f4").data)
                    nbytes += weights.nbytes
                    for inner in weights[:, 1:-1, 1:-1]:  # (A + A^T) summed in place: no (L, L) copies
                        np.add(total, inner, out=total)
                        np.add(total, inner.T, out=total)
                    count += len(chosen)
        contacts = (total / (2 * max(count, 1))).astype(np.float32)
        if use_apc:
            contacts = apc(contacts).astype(np.float32)
        names["contacts"] = f"{stem}_contacts.npy"
        with staged.open(names["contacts"], "wb") as f:
            np.save(f, contacts)
        if plot:
            names["png"] = f"{stem}_contacts.png"
            plot_contacts(staged.path(names["png"]), contacts, name, use_apc, layers, len(heads))
    files = {key: Path(out_dir) / n for key, n in names.items()}
    return AttentionMaps(name, L, files, contacts, nbytes)


def plot_contacts(path: Path, contacts: np.ndarray, name: str, use_apc: bool, layers, n_heads: int) -> Path:
    """The contact map as a square image (residue numbers on both axes)."""
    check_plotting()
    from matplotlib.figure import Figure

    n = len(contacts)
    fig = Figure(figsize=(6.4, 5.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    shown = contacts.copy()
    np.fill_diagonal(shown, np.nan)  # the diagonal dominates and says nothing about contacts
    high = float(np.nanpercentile(shown, 99.5)) if n > 1 else 1.0
    image = ax.imshow(shown, cmap="Blues", vmin=min(0.0, float(np.nanmin(shown)) if n > 1 else 0.0), vmax=high or 1)
    image.set_extent((0.5, n + 0.5, n + 0.5, 0.5))
    ax.set_xlabel("residue", fontsize=8)
    ax.set_ylabel("residue", fontsize=8)
    ax.tick_params(labelsize=7)
    fig.colorbar(image, ax=ax, shrink=0.8).ax.tick_params(labelsize=7)
    what = "APC-corrected " if use_apc else ""
    span = (
        f"blocks {layers[0]}-{layers[-1]}"
        if list(layers) == list(range(layers[0], layers[-1] + 1))
        else "blocks " + ",".join(map(str, layers))
    )
    ax.set_title(f"{name}: {what}mean attention, {span}, {n_heads} heads", fontsize=8)
    with open(path, "xb") as f:  # (a new file: staged by the caller)
        fig.savefig(f, dpi=100, format="png")
    return path


@dataclasses.dataclass
class AttentionSummary:
    out: Path
    written: list[AttentionMaps]
    skipped: list[str]


@guarded("out", "attention", "folder", inputs=("model", "fasta", "sequence"))
def attention_job(
    model: ESMC | str | Path,
    out: str | Path,
    *,
    sequence: str | None = None,
    fasta: str | Path | None = None,
    name: str | None = None,
    layers=None,
    heads=None,
    use_apc: bool = True,
    plot: bool = True,
    force: bool = False,
    progress: bool = False,
) -> AttentionSummary:
    """Attention maps of ``sequence`` (a protein, or a FASTA file of one record; files named
    ``name``, default ``sequence``) or of every record of ``fasta`` into ``out``: see this
    module's docstring. ``layers``: blocks 1..n (default all); ``heads``: 0..H-1 (default all).
    A protein already written with the same sequence, settings and model is skipped unless
    ``force``. Raises FastaError, ScoringError, JobError (matplotlib missing with ``plot``,
    another tool's manifest, a run under ``mlx.launch``)."""
    if World.current().size > 1:
        raise JobError(
            "attention runs in one process (its maps are written where they are computed); not under mlx.launch"
        )
    records = input_records(sequence, fasta, name)
    check_stems([ident for ident, _ in records], fasta, "{}_*")
    if plot:
        check_plotting()
    manifest = AttentionManifest(held(out))
    model, _ = _model(model, None)
    check_records_memory(  # one protein a forward: the batch is the record
        model.config,
        [len(seq) for _, seq in records],
        1,
        lambda i: f"{fasta}: record {records[i][0]!r}" if fasta is not None else "--sequence",
        attentions=True,
    )
    blocks = resolve_blocks(layers, model.config.num_hidden_layers)
    chosen = resolve_heads(heads, model.config.num_attention_heads)
    weights = model.fingerprint()
    written, skipped = [], []
    from tqdm.auto import tqdm

    for ident, seq in tqdm(records, unit="protein", desc="attention", disable=not progress, dynamic_ncols=True):
        settings = {
            "sequence_sha1": sequence_hash(seq),
            "layers": list(blocks),
            "heads": list(chosen),
            "apc": use_apc,
            "plot": plot,
            "model": weights,
        }
        stem = safe_name(ident)
        if not force and manifest.done(stem, settings):
            skipped.append(ident)
            continue
        maps = write_attention(model, seq, Path(out), ident, sorted(blocks), chosen, use_apc, plot)
        manifest.record(stem, settings, maps.files)
        written.append(maps)
    return AttentionSummary(Path(out), written, skipped)
