"""The jobs behind ``esmc-mlx embed``, ``scan`` and ``score``: resumable embedding of a FASTA
file into a directory (``store.EmbeddingStore``), saturation scans, and scoring a CSV of mutants. Both run
unchanged under ``mlx.launch``: every rank reads the input and takes a slice, rank 0 alone writes.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..artifact import plural
from ..errors import EsmcMlxError, JobError
from ..outputs import atomic_file, guarded
from ..outputs import held as held_output
from ..readers import open_binary, text_lines
from ..runtime.load import load
from ..runtime.model import ESMC
from ..vocab import check_sequence
from .distributed import World
from .fasta import iter_fasta, read_fasta
from .heatmap import check_plotting
from .mutations import apply, parse_mutants
from .scan import ScanManifest, safe_name, scan_settings
from .scan import scan as run_scan
from .scoring import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_WINDOW,
    PAD_MULTIPLE,
    check_forward_memory,
    check_joint_windows,
    check_multi_window,
    default_batch_tokens,
    encode,
    iter_embeddings,
    length_batches,
    pick_layers,
    positive_int,
    resolve_layers,
    resolve_methods,
    resolve_pools,
    score_mutations,
)
from .stats import spearman
from .store import (
    FLUSH_BYTES,
    FORMATS,
    EmbeddingStore,
    IdIndex,
    IdList,
    array_names,
    legacy_entries,
    require_h5py,
    sequence_hash,
)

CHUNK_RECORDS = 8192  # FASTA records read, sorted by length and embedded at a time
GATHER_BYTES = 64 << 20  # results a rank holds before sending them to rank 0 (upper bound)
GATHER_ROUNDS = 32  # batches between two gathers, at most (rank 0 flushes after a gather)

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


def _model(model: ESMC | str | Path, name: str | None):
    """A loaded model, or a path / Hub id to load (on every rank)."""
    if isinstance(model, (str, Path)):
        return load(model)[0], name or str(model)
    return model, name


@guarded(
    "out",
    "embeddings",
    "folder",
    inputs=("model", "fasta"),
    when=lambda args: World.of(args["group"]).is_root,
    legacy=legacy_entries,
)
def embed_fasta(
    model: ESMC | str | Path,
    fasta: str | Path,
    out: str | Path,
    *,
    layer: int | None = None,
    per_residue: bool = False,
    layers=None,
    pools=None,
    storage: str = "npy",
    batch_tokens: int | None = None,
    dtype: str = "float32",
    force: bool = False,
    drop_missing: bool = False,
    flush_every: int = 256,
    flush_seconds: float = 60.0,
    chunk_records: int = CHUNK_RECORDS,
    group=None,
    progress: bool = False,
    model_name: str | None = None,
) -> EmbedSummary:
    """Embed every record of ``fasta`` into the directory ``out``, resuming from what is there.
    ``model``: a loaded ESMC, or a path / Hub id to load once the FASTA has been read.
    ``layers`` (``"all"``, ``"6,12,-1"`` or ints; default ``layer``) and ``pools`` (mean, max,
    cls, per_residue; default mean; ``per_residue`` adds per_residue) are all computed in
    one forward pass per batch. ``storage``: npy, safetensors or h5 (see ``tasks.store``).

    The FASTA is read as a stream, twice: a first pass checks it and keeps each record's ID,
    length and sha1; the second embeds ``chunk_records`` records at a time (sorted by length
    within the chunk). Memory holds that metadata, one chunk and the unflushed results.
    ``batch_tokens``: padded tokens per forward pass (default ``default_batch_tokens()``:
    16384 on a CUDA GPU, 4096 elsewhere).

    A rerun resumes only with the same settings and model weights (``ESMC.fingerprint``, the
    same for the artifact moved, or loaded on another device); ``model_name`` is how the manifest
    names the model for people (default: the path or Hub id given).

    Raises FastaError for a bad FASTA, JobError for an output directory holding other settings
    (or other sequences under the same IDs), ScoringError for a layer or pool the model lacks.
    """
    world = World.of(group)
    # checked before anything is read or made (length_batches would refuse it with the store open)
    batch_tokens = positive_int(default_batch_tokens() if batch_tokens is None else batch_tokens, "batch_tokens")
    if dtype not in ("float32", "float16"):
        raise JobError(f"dtype must be float32 or float16, got {dtype!r}")
    if storage not in FORMATS:
        raise JobError(f"storage format must be one of {', '.join(FORMATS)}, got {storage!r}")
    if storage == "h5":
        require_h5py()
    pools = resolve_pools(pools, per_residue)
    layers = pick_layers(layer, layers)
    if Path(fasta).exists() and not Path(fasta).is_file():  # iter_fasta names a missing one
        raise JobError(
            f"{fasta}: not a regular file. embed reads its FASTA twice (every record checked before the model "
            "loads, then embedded), and a pipe can be read only once: write it to a file first (a gzip-compressed "
            "FASTA is read as it is)"
        )
    # Compact per-record metadata (~70 bytes a record with IdIndex): ID, length, sha1.
    ids, lengths, hashes = IdList(), array("q"), bytearray()
    for r in iter_fasta(fasta):  # before loading a model: bad input fails fast
        ids.append(r.id)
        lengths.append(len(r.sequence))
        hashes += sequence_hash(r.sequence).encode()
    lengths, hashes = np.frombuffer(lengths, dtype=np.int64), np.frombuffer(bytes(hashes), dtype="S40")
    model, model_name = _model(model, model_name)
    n_layers = model.config.num_hidden_layers
    layers = resolve_layers(layers, n_layers)
    if len(lengths):  # the largest batch checked against memory before anything is written
        longest = int(np.argmax(lengths))
        width = -(-(int(lengths[longest]) + 2) // PAD_MULTIPLE) * PAD_MULTIPLE
        hidden = any(i != n_layers for i in layers)
        if width > batch_tokens:
            check_forward_memory(
                model.config,
                1,
                width,
                f"{fasta}: record {ids[longest]!r} ({int(lengths[longest]):,} residues)",
                "attention grows with the square of the length: split the record (into domains, or "
                "overlapping pieces) before embedding it",
                hidden_states=hidden,
            )
        check_forward_memory(
            model.config,
            max(1, batch_tokens // width),
            width,
            f"--batch-tokens {batch_tokens:,}",
            "give a smaller --batch-tokens",
            hidden_states=hidden,
        )
    names = array_names(layers, pools)
    settings = {
        "layers": list(layers),
        "pools": list(pools),
        "dtype": dtype,
        "storage": storage,
        "hidden_size": model.config.hidden_size,
        "num_hidden_layers": n_layers,
        "arrays": list(names.values()),
        "pooling": "mean and max over the tokens between <cls> and <eos>; cls = the <cls> token",
        "model": model_name,
        "model_weights": model.fingerprint(),  # what decides whether a rerun may resume
        "fasta": str(fasta),
    }
    store, id_index = (EmbeddingStore(out, held_output(out)) if world.is_root else None), None
    # Rank 0 reads the directory; every rank learns what is left (and whether rank 0 failed).
    status, failure = np.zeros(len(ids) + 1, dtype=np.int32), None
    if store is not None:
        try:
            store.open(settings, force)
            id_index = IdIndex(ids)
            done, changed, missing = store.status(id_index, hashes)
            if changed:
                raise JobError(
                    f"{out} holds an embedding of another sequence under the ID {changed[0]!r} "
                    f"({len(changed)} such IDs); use another output directory or --force"
                )
            if missing and not drop_missing:  # computed embeddings are not thrown away unasked
                raise JobError(
                    f"{out} holds embeddings of {plural(len(missing), 'ID')} that {fasta} lacks ({min(missing)!r} ...); "
                    "the merge would drop them: use another output directory, or --drop-missing"
                )
            store.begin(settings)
            status[1:] = done
        except EsmcMlxError as e:
            failure, status[0] = e, 1
    status = world.broadcast(status)
    if failure is not None:
        raise failure
    if status[0]:
        raise JobError("rank 0 could not open the output directory (see its error)")
    is_done = status[1:].astype(bool)
    skipped = int(is_done.sum())
    d, out_dtype = model.config.hidden_size, np.dtype(dtype)
    every = gather_every(batch_tokens, d, names) if world.size > 1 else 1  # alone: flush as before
    buffer: list[tuple] = []
    buffered, buffered_bytes, last_flush, computed = 0, 0, time.monotonic(), 0

    def flush():
        nonlocal buffer, buffered, buffered_bytes, last_flush
        if store is not None and buffer:
            rows = np.concatenate([b[0] for b in buffer])
            store.write_part(
                [ids[i] for i in rows],
                hashes[rows].astype(str).tolist(),
                lengths[rows],
                {name: np.concatenate([b[1][name] for b in buffer]).astype(out_dtype) for name in names.values()},
            )
        buffer, buffered, buffered_bytes, last_flush = [], 0, 0, time.monotonic()

    from tqdm.auto import tqdm

    bar = tqdm(
        total=int((~is_done).sum()),
        unit="seq",
        desc="embed",
        disable=not (progress and world.is_root),
        dynamic_ncols=True,
    )
    try:
        for first, chunk in _chunks(iter_fasta(fasta), chunk_records):
            pending = [k for k in range(len(chunk)) if not is_done[first + k]]
            if not pending:
                continue
            record_of = np.array([first + k for k in pending], dtype=np.int64)
            # a checked FASTA sequence holds residues only: one token each, plus <cls> and <eos>
            token_lengths = np.array([len(chunk[k].sequence) + 2 for k in pending])
            # The batches one process would run, dealt out round-robin (longest first, so every
            # rank gets a similar mix): each sequence is embedded in the same batch, padded to
            # the same width, whatever the number of ranks, so the outputs are the same.
            batches = world.shard(length_batches(token_lengths, batch_tokens, PAD_MULTIPLE))
            encoded = [None] * len(pending)  # this rank tokenizes its own batches only
            for b in batches:
                for i, e in zip(b, encode([chunk[pending[i]].sequence for i in b])):
                    encoded[i] = e
            embeddings = iter_embeddings(model, encoded, batches, layers=layers, pools=pools)
            rounds, held = world.max(len(batches)), []  # held: batches not yet gathered
            for step in range(rounds):
                rows, values = next(embeddings, (np.zeros(0, np.int64), None))
                held.append((record_of[rows], values))
                if (step + 1) % every and step + 1 < rounds:
                    continue
                rows, values = _merge(held, names)
                held = []
                ints = world.gather(rows.astype(np.int64))
                floats = world.gather(_flatten(values, names, d))
                for got_rows, flat in zip(ints, floats):
                    n = len(got_rows)
                    computed += n
                    if n and store is not None:
                        buffer.append((got_rows, _unflatten(flat, names, lengths[got_rows], d)))
                        buffered += n
                        buffered_bytes += flat.nbytes
                        bar.update(n)
                if (
                    buffered >= flush_every
                    or buffered_bytes >= FLUSH_BYTES
                    or time.monotonic() - last_flush >= flush_seconds
                ):
                    flush()
    finally:
        flush()  # keep what was computed, also on Ctrl-C
        bar.close()
    world.barrier()
    dropped = store.merge(ids, lengths, hashes, settings, id_index) if store is not None else 0
    return EmbedSummary(Path(out), len(ids), skipped, computed, dropped, world.rank, world.size)


def gather_every(batch_tokens: int, d: int, names: dict) -> int:
    """Batches each rank embeds between two gathers: as many as fit ``GATHER_BYTES`` (at most
    ``GATHER_ROUNDS``), the same number on every rank. Every gather makes the ranks wait for
    each other and for rank 0's writing; a gather per batch kept them in lockstep."""
    per_residue = sum(1 for key in names if key[1] == "per_residue")
    pooled = len(names) - per_residue
    # rows per batch: at most batch_tokens residues, at most batch_tokens / PAD_MULTIPLE sequences
    round_bytes = 4 * d * (per_residue * batch_tokens + pooled * max(1, batch_tokens // PAD_MULTIPLE))
    return max(1, min(GATHER_ROUNDS, GATHER_BYTES // round_bytes))


def _merge(held: list[tuple], names: dict) -> tuple[np.ndarray, dict | None]:
    """Several batches' (rows, values) as one batch's."""
    rows = np.concatenate([r for r, _ in held])
    parts = [v for _, v in held if v is not None]
    if not parts:
        return rows, None
    merged = {}
    for key in names:
        if key[1] == "per_residue":
            merged[key] = [a for v in parts for a in v[key]]
        else:
            merged[key] = np.concatenate([v[key] for v in parts])
    return rows, merged


def _chunks(records, size: int):
    """(index of the first record, list of records) for consecutive chunks of ``size``."""
    chunk, first = [], 0
    for r in records:
        chunk.append(r)
        if len(chunk) == size:
            yield first, chunk
            first, chunk = first + size, []
    if chunk:
        yield first, chunk


def _flatten(values: dict | None, names: dict, d: int) -> np.ndarray:
    """One batch's arrays as one float32 (rows, d) block for ``World.gather``: every pooled
    array (n rows each), then every per-residue array (sum of lengths rows each), in ``names``
    order."""
    if values is None:
        return np.zeros((0, d), np.float32)
    pooled = [values[k] for k in names if k[1] != "per_residue"]
    residues = [np.concatenate(values[k]) for k in names if k[1] == "per_residue"]
    return np.concatenate(pooled + residues).astype(np.float32)


def _unflatten(flat: np.ndarray, names: dict, lengths: np.ndarray, d: int) -> dict[str, np.ndarray]:
    n, total, out, at = len(lengths), int(lengths.sum()), {}, 0
    for key, name in names.items():
        if key[1] != "per_residue":
            out[name], at = flat[at : at + n], at + n
    for key, name in names.items():
        if key[1] == "per_residue":
            out[name], at = flat[at : at + total], at + total
    return out


# --- esmc-mlx scan ----------------------------------------------------------------------------


@dataclasses.dataclass
class ScanSummary:
    out: Path
    scanned: list[tuple[str, int, int]]  # (name, residues, forward passes) per protein
    rank: int = 0
    world_size: int = 1
    skipped: list[str] = dataclasses.field(default_factory=list)  # names already scanned in out


@guarded(
    "out", "scan", "folder", inputs=("model", "fasta", "sequence"), when=lambda args: World.of(args["group"]).is_root
)
def scan_job(
    model: ESMC | str | Path,
    out: str | Path,
    *,
    sequence: str | None = None,
    fasta: str | Path | None = None,
    name: str | None = None,
    method: str = "masked_marginal",
    batch_size: int = DEFAULT_BATCH_SIZE,
    window: int | None = DEFAULT_WINDOW,
    offset: int = 1,
    plot: bool = True,
    per_row: int = 100,
    group=None,
    progress: bool = False,
    force: bool = False,
) -> ScanSummary:
    """Scan ``sequence`` (literal, or a FASTA file with one record; its files named ``name``,
    default ``sequence``) or every record of ``fasta`` (named by their IDs) and write each
    protein's files into ``out`` (see ``Scan.write``); rank 0 writes.

    Resumes: a protein that ``out`` already holds, scanned from the same sequence with the same
    settings and model weights (``out/scan-manifest.json``; ``ESMC.fingerprint``), is skipped
    unless ``force``.
    Raises FastaError, ScoringError, JobError (matplotlib missing with ``plot``, a manifest of
    another tool)."""
    if (sequence is None) == (fasta is None):
        raise JobError("give exactly one of --sequence and --fasta")
    if fasta is not None and name is not None:  # it would be ignored: say so instead
        raise JobError(f"--name {name!r} names --sequence's files; with --fasta each record's ID names its files")
    if fasta is not None:
        records = [(r.id, r.sequence) for r in iter_fasta(fasta)]  # all checked before the model loads
    else:
        records = [(name or "sequence", resolve_sequence(sequence))]
    stems: dict[str, str] = {}
    for ident, _ in records:  # case-blind: macOS's file system is
        other = stems.setdefault(safe_name(ident).lower(), ident)
        if other != ident:
            raise JobError(
                f"{fasta}: the IDs {other!r} and {ident!r} would both be written as {safe_name(ident)}_*; "
                "rename one of them"
            )
    world = World.of(group)
    if plot and world.is_root:
        check_plotting()
    # Rank 0 reads OUT (before the model loads: fails fast); every rank learns whether it failed
    # (else the others would wait for it in the first pass), then which proteins are left.
    manifest, failure, status = None, None, np.zeros(1, dtype=np.int32)
    if world.is_root:
        try:
            manifest = ScanManifest(held_output(out))
        except EsmcMlxError as e:
            failure, status[0] = e, 1
    if world.broadcast(status)[0]:
        raise failure or JobError(f"rank 0 could not read {out} (see its error)")
    model, _ = _model(model, None)
    weights = model.fingerprint()  # the same model: the same weights, wherever they were loaded from
    settings = [
        scan_settings(seq, method=method, window=window, offset=offset, model=weights, plot=plot, per_row=per_row)
        for _, seq in records
    ]
    done = np.zeros(len(records), dtype=np.int32)
    if manifest is not None and not force:
        done[:] = [manifest.done(safe_name(ident), entry) for (ident, _), entry in zip(records, settings)]
    done = world.broadcast(done)
    skipped = [ident for (ident, _), d in zip(records, done) if d]
    scanned = []
    for (ident, seq), entry, is_done in zip(records, settings, done):
        if is_done:
            continue
        result = run_scan(
            model,
            seq,
            method=method,
            batch_size=batch_size,
            window=window,
            offset=offset,
            name=ident,
            group=world.group,
            progress=progress,
        )
        if manifest is not None:
            manifest.record(safe_name(ident), entry, result.write(out, plot=plot, per_row=per_row))
        scanned.append((ident, len(result.positions), result.passes))
    return ScanSummary(Path(out), scanned, world.rank, world.size, skipped)


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
        # the bytes as they are (readers.text_lines): a byte-order mark dropped, CRLF, CR or LF
        # lines, a Windows code page in a description; line endings kept for quoted fields
        with open_binary(path) as f:
            reader = csv.DictReader(text_lines(f, path, JobError, keepends=True))
            columns = list(reader.fieldnames or [])
            rows, where = [], []
            for row in reader:
                if not any((v or "").strip() if isinstance(v, str) else any(v) for v in row.values()):
                    continue  # ",,," rows a spreadsheet leaves below the data: not a mutant
                rows.append(row)
                where.append(f"{path}, line {reader.line_num}: ")
    except (OSError, EOFError, csv.Error) as e:
        raise JobError(f"{path}: cannot read CSV ({e})") from None
    if mutant_column not in columns:
        raise JobError(
            f"{path}: no {mutant_column!r} column (columns: {', '.join(columns) or 'none'}); "
            "name the column of mutant strings with --mutant-column"
        )
    if not rows:
        raise JobError(f"{path}: no rows")
    return columns, rows, where


# What a FASTA file's name ends with; a --sequence ending so (or holding a '/', never a residue)
# that names no file is a mistyped path: ".", "F", "A", "S", "T" are all residue letters.
FASTA_SUFFIXES = (".fa", ".fasta", ".faa", ".fas", ".fna", ".fsa", ".seq", ".txt", ".gz", ".gzip")


def resolve_sequence(text: str) -> str:
    """A wild-type sequence given literally or as a FASTA file with one record."""
    path = Path(text).expanduser()
    if _names_input(path):
        records = read_fasta(path)
        if len(records) != 1:
            raise JobError(f"{path}: holds {len(records)} records; the wild type must be a single sequence")
        return records[0].sequence
    stripped = text.strip()
    if "/" in stripped or stripped.lower().endswith(FASTA_SUFFIXES):
        raise JobError(f"--sequence {text}: no such file (give a protein sequence or an existing FASTA file)")
    return check_sequence(stripped, "--sequence", label="sequence")


def _names_input(path: Path) -> bool:
    """Whether ``path`` names something to read: a file, or a pipe (``<(zcat wt.fa.gz)``); False
    for a directory, and for text no file system accepts as a name (a protein of more than ~255
    residues given literally raises OSError "File name too long")."""
    try:
        return path.exists() and not path.is_dir()
    except (OSError, ValueError):
        return False


@guarded(
    "out",
    "scores",
    "file",
    inputs=("model", "mutations_csv", "sequence"),
    when=lambda args: World.of(args["group"]).is_root,
)
def score_csv(
    model: ESMC | str | Path,
    sequence: str,
    mutations_csv: str | Path,
    out: str | Path | None,
    *,
    methods: Sequence[str] = ("masked_marginal", "wt_marginal"),
    batch_size: int = DEFAULT_BATCH_SIZE,
    offset: int = 1,
    multi: str = "sum",
    window: int | None = DEFAULT_WINDOW,
    mutant_column: str = "mutant",
    dms_column: str = "DMS_score",
    group=None,
    progress: bool = False,
) -> ScoreSummary:
    """Score the mutants of a CSV and write it back (to ``out``) with one column per method.
    ``sequence``: the wild type, or a FASTA file holding it. ``model``: a loaded ESMC, or a
    path / Hub id to load once the input has been checked.

    With a ``dms_column`` present, reports Spearman's rho of each method against it (rows with
    an empty or non-numeric value left out). A ``mutated_sequence`` column, when present, must
    agree with the mutant strings. Raises JobError, MutationError, FastaError, ScoringError.
    """
    world = World.of(group)
    methods = resolve_methods(methods)
    check_multi_window(multi, window)
    wt = resolve_sequence(sequence)
    columns, rows, where = read_mutants_csv(mutations_csv, mutant_column)
    mutants = [row[mutant_column] or "" for row in rows]
    parsed = parse_mutants(mutants, wt, offset, where)  # before loading a model: bad input fails fast
    if "masked_marginal" in methods and multi == "joint":
        check_joint_windows(mutants, parsed, len(wt), window, where)
    if "mutated_sequence" in columns:
        for row, subs, prefix in zip(rows, parsed, where):
            given = (row["mutated_sequence"] or "").strip().upper()
            if given and given != apply(wt, subs):
                raise JobError(
                    f"{prefix}mutated_sequence does not match the mutant {row[mutant_column]!r} "
                    "applied to the wild type (wrong --sequence or --offset?)"
                )
    model, _ = _model(model, None)
    result = score_mutations(
        model,
        wt,
        mutants,
        methods=methods,
        batch_size=batch_size,
        offset=offset,
        multi=multi,
        window=window,
        group=world.group,
        progress=progress,
        where=where,
    )
    correlations = {}
    if dms_column in columns:
        measured = np.array([_float(row[dms_column]) for row in rows])
        keep = ~np.isnan(measured)
        for method, values in result.scores.items():
            correlations[method] = (spearman(values[keep], measured[keep]), int(keep.sum()))
    out_path = Path(out) if out is not None else None
    if world.is_root and out_path is not None:
        header = columns + [m for m in result.scores if m not in columns]
        with atomic_file(out_path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
            writer.writeheader()
            for i, row in enumerate(rows):
                writer.writerow({**row, **{m: _fmt(v[i]) for m, v in result.scores.items()}})
    return ScoreSummary(
        out_path,
        len(rows),
        list(result.scores),
        correlations,
        dms_column if dms_column in columns else None,
        result.wt_pppl,
        result.passes,
        world.rank,
        world.size,
    )


def _float(text: str | None) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _fmt(value: float) -> str:
    return f"{value:.8g}"
