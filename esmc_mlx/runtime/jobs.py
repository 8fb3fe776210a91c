"""The two jobs behind ``esmc-mlx embed`` and ``esmc-mlx score``: resumable embedding of a
FASTA file into a directory, and scoring a CSV of mutants. Both run unchanged under
``mlx.launch``: every rank reads the input and takes a slice, rank 0 alone writes.

Embedding directory (see docs/scoring.md)::

    OUT/manifest.json        settings and state ({"complete": true} once merged)
    OUT/index.tsv            id, length, sha1 of the sequence; row i <-> mean.npy[i]
    OUT/mean.npy             (N, d) mean embeddings, FASTA order
    OUT/per_residue.npy      (sum of lengths, d), with --per-residue
    OUT/offsets.npy          (N + 1,) int64: rows of sequence i are offsets[i]:offsets[i+1]
    OUT/parts/part-*.npz     results flushed while running (ids, sha1, mean, lengths[, residues]);
                             merged into the files above and deleted when every record is done

A rerun skips the IDs already in the directory (merged or in a part), so an interrupted run
resumes where it stopped, and a FASTA that grew computes only its new records.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import EsmcMlxError
from .distributed import World
from .fasta import Record, check_sequence, read_fasta
from .mutations import apply, parse_mutants
from .scoring import DEFAULT_BATCH_SIZE, DEFAULT_BATCH_TOKENS, METHODS, ScoringError, _encode, iter_embeddings, \
    length_batches, resolve_layer, score_mutations

FORMAT = "esmc-mlx-embeddings"
FORMAT_VERSION = 1
FLUSH_BYTES = 256 << 20  # also flush once this much is buffered (per-residue outputs of big models)
SETTINGS_KEYS = ("layer", "per_residue", "dtype", "hidden_size", "num_hidden_layers")


class JobError(EsmcMlxError):
    """An output directory or input file that the job cannot use as asked."""


def sequence_hash(sequence: str) -> str:
    return hashlib.sha1(sequence.encode()).hexdigest()


# --- the embedding directory (rank 0 only) ---------------------------------------------------

class EmbeddingStore:
    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.parts = self.out / "parts"
        self.manifest_path = self.out / "manifest.json"
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self._count = 0

    def manifest(self) -> dict | None:
        if not self.manifest_path.exists():
            return None
        try:
            data = json.loads(self.manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise JobError(f"{self.manifest_path}: unreadable ({e}); use --force to start over") from None
        if data.get("format") != FORMAT:
            raise JobError(f"{self.out}: not an esmc-mlx embeddings directory")
        return data

    def open(self, settings: dict, force: bool) -> None:
        """Create the directory, or check that an existing one holds the same settings."""
        existing = self.manifest() if self.out.exists() else None
        if self.out.exists() and existing is None and any(self.out.iterdir()):
            raise JobError(f"{self.out} exists, is not empty and is not an esmc-mlx embeddings directory")
        if existing is not None and force:
            for name in ("parts", ".merge"):
                shutil.rmtree(self.out / name, ignore_errors=True)
            for name in ("manifest.json", "index.tsv", "mean.npy", "per_residue.npy", "offsets.npy"):
                (self.out / name).unlink(missing_ok=True)
            existing = None
        if existing is not None:
            differ = [f"{k}: {existing.get(k)!r} there, {settings[k]!r} now" for k in SETTINGS_KEYS
                      if existing.get(k) != settings[k]]
            if differ:
                raise JobError(f"{self.out} holds embeddings made with other settings ({'; '.join(differ)}); "
                               "use another output directory or --force to start over")
        self.parts.mkdir(parents=True, exist_ok=True)
        self._write_manifest(dict(existing or {}, **settings, complete=False))

    def _write_manifest(self, data: dict) -> None:
        tmp = self.out / ".manifest.json.tmp"
        tmp.write_text(json.dumps(dict(format=FORMAT, version=FORMAT_VERSION, **{
            k: v for k, v in data.items() if k not in ("format", "version")}), indent=2) + "\n")
        os.replace(tmp, self.manifest_path)

    def _merged(self) -> dict | None:
        """The merged files, if present and consistent: ids, hashes, lengths, arrays (mmap)."""
        index = self.out / "index.tsv"
        if not index.exists() or not (self.out / "mean.npy").exists():
            return None
        lines = index.read_text().splitlines()[1:]
        ids, lengths, hashes = [], [], []
        for line in lines:
            ident, length, digest = line.split("\t")
            ids.append(ident)
            lengths.append(int(length))
            hashes.append(digest)
        mean = np.load(self.out / "mean.npy", mmap_mode="r")
        merged = {"ids": ids, "lengths": np.array(lengths, dtype=np.int64), "sha1": hashes, "mean": mean}
        if (self.out / "per_residue.npy").exists():
            merged["residues"] = np.load(self.out / "per_residue.npy", mmap_mode="r")
            merged["offsets"] = np.load(self.out / "offsets.npy")
        if mean.shape[0] != len(ids) or ("offsets" in merged and len(merged["offsets"]) != len(ids) + 1):
            return None  # a merge that was cut short; the parts it came from are still there
        return merged

    def _part_files(self) -> list[Path]:
        return sorted(self.parts.glob("part-*.npz")) if self.parts.exists() else []

    def done(self) -> dict[str, str]:
        """id -> sha1 of every sequence already embedded here."""
        done: dict[str, str] = {}
        merged = self._merged()
        if merged:
            done.update(zip(merged["ids"], merged["sha1"]))
        for path in self._part_files():
            with np.load(path) as part:
                done.update(zip(part["ids"].tolist(), part["sha1"].tolist()))
        return done

    def write_part(self, ids: list[str], hashes: list[str], mean: np.ndarray, lengths: np.ndarray,
                   residues: np.ndarray | None) -> Path:
        self._count += 1
        path = self.parts / f"part-{self.run_id}-{self._count:06d}.npz"
        tmp = self.parts / f".{path.name}.tmp"
        arrays = {"ids": np.array(ids), "sha1": np.array(hashes), "mean": mean, "lengths": lengths}
        if residues is not None:
            arrays["residues"] = residues
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
        return path

    def merge(self, records: list[Record], settings: dict) -> int:
        """Write the merged files in FASTA order from the old merged files and the parts; delete
        the parts. Returns how many stored embeddings were dropped (IDs not in the FASTA)."""
        position = {r.id: i for i, r in enumerate(records)}
        merged = self._merged()
        if merged and not self._part_files() and merged["ids"] == [r.id for r in records]:
            self._write_manifest(dict(self.manifest() or {}, **settings, complete=True, count=len(records)))
            return 0  # nothing new: the merged files are already this FASTA's
        dtype = np.dtype(settings["dtype"])
        d = settings["hidden_size"]
        sources = []  # (loader, ids); later sources win
        if merged:
            sources.append((lambda m=merged: m, merged["ids"]))
        for path in self._part_files():
            with np.load(path) as part:
                sources.append((lambda p=path: _load_part(p), part["ids"].tolist()))
        winner: dict[str, tuple[int, int]] = {}
        for s, (_, ids) in enumerate(sources):
            for row, ident in enumerate(ids):
                winner[ident] = (s, row)
        missing = [r.id for r in records if r.id not in winner]
        if missing:
            raise JobError(f"cannot merge {self.out}: {len(missing)} records have no embedding yet (e.g. {missing[0]!r})")
        dropped = sum(1 for ident in winner if ident not in position)
        lengths = np.array([len(r.sequence) for r in records], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        staging = self.out / ".merge"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        mean = np.lib.format.open_memmap(staging / "mean.npy", mode="w+", dtype=dtype, shape=(len(records), d))
        residues = None
        if settings["per_residue"]:
            residues = np.lib.format.open_memmap(staging / "per_residue.npy", mode="w+", dtype=dtype,
                                                 shape=(int(offsets[-1]), d))
        for s, (load_source, ids) in enumerate(sources):
            mine = [(row, position[ident]) for row, ident in enumerate(ids)
                    if ident in position and winner[ident] == (s, row)]
            if not mine:
                continue
            src = load_source()
            src_offsets = src.get("offsets")
            if src_offsets is None and residues is not None:
                src_offsets = np.concatenate([[0], np.cumsum(src["lengths"])])
            for row, dest in mine:
                mean[dest] = src["mean"][row]
                if residues is not None:
                    residues[offsets[dest] : offsets[dest + 1]] = src["residues"][src_offsets[row] : src_offsets[row + 1]]
        mean.flush()
        del mean
        if residues is not None:
            residues.flush()
            del residues
            np.save(staging / "offsets.npy", offsets)
        with open(staging / "index.tsv", "w") as f:
            f.write("id\tlength\tsha1\n")
            for r in records:
                f.write(f"{r.id}\t{len(r.sequence)}\t{sequence_hash(r.sequence)}\n")
        for name in ("mean.npy", "per_residue.npy", "offsets.npy", "index.tsv"):
            if (staging / name).exists():
                os.replace(staging / name, self.out / name)
            elif name in ("per_residue.npy", "offsets.npy"):
                (self.out / name).unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        self._write_manifest(dict(self.manifest() or {}, **settings, complete=True, count=len(records)))
        for path in self._part_files():
            path.unlink()
        if self.parts.exists() and not any(self.parts.iterdir()):
            self.parts.rmdir()
        return dropped


def _load_part(path: Path) -> dict:
    with np.load(path) as part:
        return {k: part[k] for k in part.files}


@dataclasses.dataclass
class StoredEmbeddings:
    """An embeddings directory, read back (arrays memory-mapped)."""

    ids: list[str]
    mean: np.ndarray
    residues: np.ndarray | None = None
    offsets: np.ndarray | None = None

    def per_residue(self, key: int | str) -> np.ndarray:
        """(L, d) rows of record ``key`` (an index or an ID)."""
        if self.residues is None:
            raise JobError("this directory was written without --per-residue")
        i = self.ids.index(key) if isinstance(key, str) else key
        return self.residues[self.offsets[i] : self.offsets[i + 1]]


def read_embeddings(out: str | Path) -> StoredEmbeddings:
    """Open a completed ``esmc-mlx embed`` output directory."""
    store = EmbeddingStore(out)
    manifest = store.manifest()
    merged = store._merged() if manifest else None
    if not manifest or not manifest.get("complete") or merged is None:
        raise JobError(f"{out}: no completed embeddings (run esmc-mlx embed again to finish it)")
    return StoredEmbeddings(merged["ids"], merged["mean"], merged.get("residues"), merged.get("offsets"))


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
        from .load import load

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
    encoded = _encode([r.sequence for r in records], names=[r.id for r in records])
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

def _rank(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties get their average rank."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties averaged), as scipy.stats.spearmanr; NaN if undefined."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2:
        return float("nan")
    ra, rb = _rank(a), _rank(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


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
