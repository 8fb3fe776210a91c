"""The two jobs behind ``esmc-mlx embed`` and ``esmc-mlx score``: resumable embedding of a
FASTA file into a directory (``store.EmbeddingStore``), and scoring a CSV of mutants. Both run
unchanged under ``mlx.launch``: every rank reads the input and takes a slice, rank 0 alone writes.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import EsmcMlxError, JobError, ScoringError
from ..runtime.load import load
from ..vocab import check_sequence
from .distributed import World
from .fasta import read_fasta
from .mutations import apply, parse_mutants
from .scoring import DEFAULT_BATCH_SIZE, DEFAULT_BATCH_TOKENS, METHODS, encode, iter_embeddings, length_batches, \
    resolve_layer, score_mutations
from .stats import spearman
from .store import FLUSH_BYTES, EmbeddingStore, sequence_hash

# --- esmc-mlx embed ---------------------------------------------------------------------------

@dataclasses.dataclass
class EmbedSummary:
    out: Path
    total: int  # records in the FASTA
    skipped: int  # already embedded before this run
    computed: int  # embedded by this run (all ranks)
    dropped: int = 0  # stored embeddings of IDs no longer in the FASTA
    rank: int = 0
    world_size: int = 1


def _model(model, name: str | None):
    """A loaded model, or a path / Hub id to load (on every rank)."""
    if isinstance(model, (str, Path)):
        return load(model)[0], name or str(model)
    return model, name


def embed_fasta(model, fasta: str | Path, out: str | Path, *, layer: int = -1, per_residue: bool = False,
                batch_tokens: int = DEFAULT_BATCH_TOKENS, dtype: str = "float32", force: bool = False,
                flush_every: int = 256, flush_seconds: float = 60.0, group=None, progress: bool = False,
                model_name: str | None = None) -> EmbedSummary:
    """Embed every record of ``fasta`` into the directory ``out``, resuming from what is there.
    ``model``: a loaded ESMC, or a path / Hub id to load once the FASTA has been read.

    Raises FastaError for a bad FASTA, JobError for an output directory holding other settings
    (or other sequences under the same IDs), ScoringError for a layer the model lacks.
    """
    world = World.of(group)
    if dtype not in ("float32", "float16"):
        raise JobError(f"dtype must be float32 or float16, got {dtype!r}")
    records = read_fasta(fasta)  # before loading a model: bad input fails fast
    model, model_name = _model(model, model_name)
    n_layers = model.config.num_hidden_layers
    settings = {"layer": resolve_layer(layer, n_layers), "per_residue": bool(per_residue), "dtype": dtype,
                "hidden_size": model.config.hidden_size, "num_hidden_layers": n_layers,
                "pooling": "mean over the tokens between <cls> and <eos>",
                "model": model_name, "fasta": str(fasta)}
    store = EmbeddingStore(out) if world.is_root else None
    # Rank 0 reads the directory; every rank learns what is left (and whether rank 0 failed).
    status, failure = np.zeros(len(records) + 1, dtype=np.int32), None
    if store is not None:
        try:
            store.open(settings, force)
            done = store.done()
            changed = [r.id for r in records if r.id in done and done[r.id] != sequence_hash(r.sequence)]
            if changed:
                raise JobError(f"{out} holds an embedding of another sequence under the ID {changed[0]!r} "
                               f"({len(changed)} such IDs); use another output directory or --force")
            status[1:] = [r.id in done for r in records]
        except EsmcMlxError as e:
            failure, status[0] = e, 1
    status = world.broadcast(status)
    if failure is not None:
        raise failure
    if status[0]:
        raise JobError("rank 0 could not open the output directory (see its error)")
    is_done = status[1:].astype(bool)
    skipped = int(is_done.sum())
    encoded = encode([r.sequence for r in records], names=[r.id for r in records])
    token_lengths = np.array([len(e) for e in encoded])
    pending = np.array([i for i in np.argsort(-token_lengths, kind="stable") if not is_done[i]], dtype=np.int64)
    mine = world.shard(pending)
    batches = [mine[b] for b in length_batches(token_lengths[mine], batch_tokens)]
    rounds = world.max(len(batches))
    embeddings = iter_embeddings(model, encoded, batches, layer=layer, per_residue=per_residue)
    d, out_dtype = model.config.hidden_size, np.dtype(dtype)
    buffer: list[tuple] = []
    buffered, buffered_bytes, last_flush, computed = 0, 0, time.monotonic(), 0

    def flush():
        nonlocal buffer, buffered, buffered_bytes, last_flush
        if store is not None and buffer:
            rows = np.concatenate([b[0] for b in buffer])
            store.write_part([records[i].id for i in rows], [sequence_hash(records[i].sequence) for i in rows],
                             np.concatenate([b[1] for b in buffer]).astype(out_dtype),
                             np.concatenate([b[2] for b in buffer]),
                             np.concatenate([b[3] for b in buffer]).astype(out_dtype) if per_residue else None)
        buffer, buffered, buffered_bytes, last_flush = [], 0, 0, time.monotonic()

    from tqdm.auto import tqdm

    bar = tqdm(total=len(pending), unit="seq", desc="embed", disable=not (progress and world.is_root),
               dynamic_ncols=True)
    try:
        for _ in range(rounds):
            rows, mean, per = next(embeddings, (np.zeros(0, np.int64), np.zeros((0, d), np.float32), None))
            lengths = np.array([len(records[i].sequence) for i in rows], dtype=np.int64)
            residues = np.concatenate(per) if per else np.zeros((0, d), np.float32)
            ints = world.gather(np.stack([rows, lengths], axis=1).astype(np.int64))
            floats = world.gather(np.concatenate([mean, residues]).astype(np.float32))
            for meta, values in zip(ints, floats):
                n = len(meta)
                computed += n
                if n and store is not None:
                    buffer.append((meta[:, 0], values[:n], meta[:, 1], values[n:]))
                    buffered += n
                    buffered_bytes += values.nbytes
                    bar.update(n)
            if (buffered >= flush_every or buffered_bytes >= FLUSH_BYTES
                    or time.monotonic() - last_flush >= flush_seconds):
                flush()
    finally:
        flush()  # keep what was computed, also on Ctrl-C
        bar.close()
    world.barrier()
    dropped = store.merge(records, settings) if store is not None else 0
    return EmbedSummary(Path(out), len(records), skipped, computed, dropped, world.rank, world.size)


# --- esmc-mlx score ---------------------------------------------------------------------------

@dataclasses.dataclass
class ScoreSummary:
    out: Path | None
    count: int
    methods: list[str]
    spearman: dict[str, tuple[float, int]]  # method -> (rho, rows with a DMS value)
    dms_column: str | None
    wt_pppl: float | None
    passes: int
    rank: int = 0
    world_size: int = 1


def read_mutants_csv(path: str | Path, mutant_column: str = "mutant") -> tuple[list[str], list[dict], list[str]]:
    """(column names, rows, a 'file, line N: ' prefix per row). Raises JobError."""
    path = Path(path)
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            rows, where = [], []
            for row in reader:
                rows.append(row)
                where.append(f"{path}, line {reader.line_num}: ")
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise JobError(f"{path}: cannot read CSV ({e})") from None
    if mutant_column not in columns:
        raise JobError(f"{path}: no {mutant_column!r} column (columns: {', '.join(columns) or 'none'}); "
                       "name the column of mutant strings with --mutant-column")
    if not rows:
        raise JobError(f"{path}: no rows")
    return columns, rows, where


def resolve_sequence(text: str) -> str:
    """A wild-type sequence given literally or as a FASTA file with one record."""
    path = Path(text).expanduser()
    if path.is_file():
        records = read_fasta(path)
        if len(records) != 1:
            raise JobError(f"{path}: holds {len(records)} records; the wild type must be a single sequence")
        return records[0].sequence
    return check_sequence(text.strip(), "--sequence", label="sequence")


def score_csv(model, sequence: str, mutations_csv: str | Path, out: str | Path | None, *,
              methods: Sequence[str] = ("masked_marginal", "wt_marginal"), batch_size: int = DEFAULT_BATCH_SIZE,
              offset: int = 1, mutant_column: str = "mutant", dms_column: str = "DMS_score",
              group=None, progress: bool = False) -> ScoreSummary:
    """Score the mutants of a CSV and write it back (to ``out``) with one column per method.
    ``sequence``: the wild type, or a FASTA file holding it. ``model``: a loaded ESMC, or a
    path / Hub id to load once the input has been checked.

    With a ``dms_column`` present, reports Spearman's rho of each method against it (rows with
    an empty or non-numeric value left out). A ``mutated_sequence`` column, when present, must
    agree with the mutant strings. Raises JobError, MutationError, FastaError, ScoringError.
    """
    world = World.of(group)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ScoringError(f"unknown scoring method {unknown or methods!r}; choose from {', '.join(METHODS)}")
    wt = resolve_sequence(sequence)
    columns, rows, where = read_mutants_csv(mutations_csv, mutant_column)
    mutants = [row[mutant_column] or "" for row in rows]
    parsed = parse_mutants(mutants, wt, offset, where)  # before loading a model: bad input fails fast
    if "mutated_sequence" in columns:
        for row, subs, prefix in zip(rows, parsed, where):
            given = (row["mutated_sequence"] or "").strip().upper()
            if given and given != apply(wt, subs):
                raise JobError(f"{prefix}mutated_sequence does not match the mutant {row[mutant_column]!r} "
                               "applied to the wild type (wrong --sequence or --offset?)")
    model, _ = _model(model, None)
    result = score_mutations(model, wt, mutants, methods=methods, batch_size=batch_size, offset=offset,
                             group=world.group, progress=progress, where=where)
    correlations = {}
    if dms_column in columns:
        measured = np.array([_float(row[dms_column]) for row in rows])
        keep = ~np.isnan(measured)
        for method, values in result.scores.items():
            correlations[method] = (spearman(values[keep], measured[keep]), int(keep.sum()))
    out_path = Path(out) if out is not None else None
    if world.is_root and out_path is not None:
        header = columns + [m for m in result.scores if m not in columns]
        tmp = out_path.with_name(f".{out_path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
            writer.writeheader()
            for i, row in enumerate(rows):
                writer.writerow({**row, **{m: _fmt(v[i]) for m, v in result.scores.items()}})
        os.replace(tmp, out_path)
    return ScoreSummary(out_path, len(rows), list(result.scores), correlations,
                        dms_column if dms_column in columns else None, result.wt_pppl, result.passes,
                        world.rank, world.size)


def _float(text: str | None) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _fmt(value: float) -> str:
    return f"{value:.8g}"
