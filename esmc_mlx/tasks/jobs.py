"""The jobs behind ``esmc-mlx embed``, ``scan`` and ``score``: resumable embedding of a FASTA
file into a directory (``store.EmbeddingStore``), saturation scans, and scoring a CSV of mutants. Both run
unchanged under ``mlx.launch``: every rank reads the input and takes a slice, rank 0 alone writes.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..artifact import plural
from ..errors import EsmcMlxError, JobError
from ..outputs import atomic_file, guarded, written_in_place
from ..outputs import held as held_output
from ..readers import open_binary, text_lines
from ..runtime.load import load
from ..runtime.model import ESMC
from ..vocab import check_sequence, nonstandard_positions
from .distributed import World
from .fasta import iter_fasta, read_fasta
from .heatmap import check_plotting
from .scan import ScanManifest, safe_name, scan_settings
from .scan import scan as run_scan
from .scoring import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_WINDOW,
    PAD_MULTIPLE,
    NonstandardTally,
    Rejected,
    check_forward_memory,
    check_multi_window,
    check_mutants,
    default_batch_tokens,
    encode,
    iter_embeddings,
    length_batches,
    pick_layers,
    positive_int,
    rejection_error,
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


def _rank_zero(args: dict) -> bool:
    return World.of(args["group"]).is_root


def agree_on_output(args: dict, error: BaseException | None) -> None:
    """Every rank learns whether rank 0's output guard refused ``out`` (``outputs.guarded``'s
    ``agree``): rank 0 raises its own error, the others a JobError, and none waits for the other."""
    world = World.of(args["group"])
    if world.size > 1 and world.broadcast(np.array([error is not None], dtype=np.int32))[0] and error is None:
        raise JobError(f"rank 0 could not write {args['out']} (see its error)")


@guarded(
    "out",
    "embeddings",
    "folder",
    inputs=("model", "fasta"),
    when=_rank_zero,
    legacy=legacy_entries,
    agree=agree_on_output,
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
    keep_nonstandard: bool = False,
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
    Mean and max leave non-standard residues (X B Z U O) out, with one warning for the file,
    unless ``keep_nonstandard`` (see ``tasks.scoring.embed``).

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
    check_fasta_file(fasta, "embed")
    tally, nonstandard = NonstandardTally(keep_nonstandard, pools), []

    def tallied(records):
        for r in records:
            tally.add(r.id, r.sequence)
            if not nonstandard and nonstandard_positions(r.sequence):
                nonstandard.append(r.id)
            yield r

    index = RecordIndex.read(tallied(iter_fasta(fasta)))  # before loading a model: bad input fails fast
    if world.is_root:
        tally.warn()
    model, model_name = _model(model, model_name)
    n_layers = model.config.num_hidden_layers
    layers = resolve_layers(layers, n_layers)
    check_batch_memory(model, index, batch_tokens, fasta, hidden_states=any(i != n_layers for i in layers))
    names = array_names(layers, pools)
    settings = {
        "layers": list(layers),
        "pools": list(pools),
        "dtype": dtype,
        "storage": storage,
        "hidden_size": model.config.hidden_size,
        "num_hidden_layers": n_layers,
        "arrays": list(names.values()),
        "pooling": "mean and max over the tokens between <cls> and <eos>"
        + ("" if keep_nonstandard else ", non-standard residues (X B Z U O) left out")
        + "; cls = the <cls> token",
        "keep_nonstandard": keep_nonstandard,
        "model": model_name,
        "model_weights": model.fingerprint(),  # what decides whether a rerun may resume
        "fasta": str(fasta),
    }
    store = EmbeddingStore(out, held_output(out)) if world.is_root else None
    # the residue policy changes nothing for sequences of standard residues: any store of them resumes
    moot = () if nonstandard else ("keep_nonstandard",)
    is_done, id_index = open_store(
        store, world, settings, index, force=force, drop_missing=drop_missing, source=fasta, moot=moot
    )
    skipped = int(is_done.sum())
    d, out_dtype = model.config.hidden_size, np.dtype(dtype)
    computed = fill_store(
        store,
        world,
        lambda: iter_fasta(fasta),
        index,
        is_done,
        lambda encoded, batches: iter_embeddings(
            model, encoded, batches, layers=layers, pools=pools, keep_nonstandard=keep_nonstandard
        ),
        lambda held: _flatten(_merge(held, names), names, d),
        lambda flat, lengths: {k: v.astype(out_dtype) for k, v in _unflatten(flat, names, lengths, d).items()},
        every=gather_every(batch_tokens, d, names) if world.size > 1 else 1,  # alone: flush as before
        batch_tokens=batch_tokens,
        chunk_records=chunk_records,
        flush_every=flush_every,
        flush_seconds=flush_seconds,
        progress=progress,
        desc="embed",
    )
    world.barrier()
    dropped = store.merge(index.ids, index.lengths, index.hashes, settings, id_index) if store is not None else 0
    return EmbedSummary(Path(out), len(index.ids), skipped, computed, dropped, world.rank, world.size)


# --- jobs that fill a store (embed, features) ---------------------------------------------------


def check_batch_memory(model: ESMC, index: RecordIndex, batch_tokens: int, fasta, hidden_states: bool) -> None:
    """ScoringError, before anything is written, when the longest record alone, or a batch of
    ``batch_tokens`` padded tokens, would not fit in memory (``scoring.check_forward_memory``)."""
    if not len(index.lengths):
        return
    longest = int(np.argmax(index.lengths))
    residues = int(index.lengths[longest])
    width = -(-(residues + 2) // PAD_MULTIPLE) * PAD_MULTIPLE
    if width > batch_tokens:
        check_forward_memory(
            model.config,
            1,
            width,
            f"{fasta}: record {index.ids[longest]!r} ({residues:,} residues)",
            "attention grows with the square of the length: split the record (into domains, or "
            "overlapping pieces) before running it",
            hidden_states=hidden_states,
        )
    check_forward_memory(
        model.config,
        max(1, batch_tokens // width),
        width,
        f"--batch-tokens {batch_tokens:,}",
        "give a smaller --batch-tokens",
        hidden_states=hidden_states,
    )


def check_fasta_file(fasta: str | Path, job: str) -> None:
    """JobError for a FASTA that is not a regular file (a store job reads it twice)."""
    if Path(fasta).exists() and not Path(fasta).is_file():  # iter_fasta names a missing one
        raise JobError(
            f"{fasta}: not a regular file. {job} reads its FASTA twice (every record checked before the model "
            "loads, then computed), and a pipe can be read only once: write it to a file first (a gzip-compressed "
            "FASTA is read as it is)"
        )


@dataclasses.dataclass
class RecordIndex:
    """Compact per-record metadata (~70 bytes a record with IdIndex): ID, residues, sha1."""

    ids: IdList
    lengths: np.ndarray
    hashes: np.ndarray

    @classmethod
    def read(cls, records) -> RecordIndex:
        ids, lengths, hashes = IdList(), array("q"), bytearray()
        for r in records:
            ids.append(r.id)
            lengths.append(len(r.sequence))
            hashes += sequence_hash(r.sequence).encode()
        return cls(ids, np.frombuffer(lengths, dtype=np.int64), np.frombuffer(bytes(hashes), dtype="S40"))


def open_store(
    store: EmbeddingStore | None,
    world: World,
    settings: dict,
    index: RecordIndex,
    *,
    force: bool,
    drop_missing: bool,
    source,
    moot: tuple[str, ...] = (),
) -> tuple[np.ndarray, IdIndex | None]:
    """Rank 0 opens the store (``store``; None on the other ranks) with ``settings``; every rank
    learns which records are done (bool per record) or that rank 0 failed. Also returns rank 0's
    IdIndex of the records. ``moot``: settings that change nothing for these records, not
    compared. Raises JobError for a store holding other settings, another sequence under a
    record's ID, or records ``source`` lacks (unless ``drop_missing``)."""
    status, failure, id_index = np.zeros(len(index.ids) + 1, dtype=np.int32), None, None
    if store is not None:
        kind, out = store.KIND, store.out
        try:
            store.open(settings, force, moot)
            id_index = IdIndex(index.ids)
            done, changed, missing = store.status(id_index, index.hashes)
            if changed:
                raise JobError(
                    f"{out} holds {kind} of another sequence under the ID {changed[0]!r} "
                    f"({len(changed)} such IDs); use another output directory or --force"
                )
            if missing and not drop_missing:  # computed results are not thrown away unasked
                raise JobError(
                    f"{out} holds {kind} of {plural(len(missing), 'ID')} that {source} lacks ({min(missing)!r} ...); "
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
    return status[1:].astype(bool), id_index


def fill_store(
    store: EmbeddingStore | None,
    world: World,
    records,
    index: RecordIndex,
    is_done: np.ndarray,
    compute,
    pack,
    unpack,
    *,
    every: int,
    batch_tokens: int,
    chunk_records: int,
    flush_every: int,
    flush_seconds: float,
    progress: bool,
    desc: str,
) -> int:
    """Compute every record not ``is_done`` and write it into ``store`` in parts (rank 0);
    returns how many records all ranks computed. ``records()``: a fresh iterator over the
    records (read again here, ``chunk_records`` at a time, sorted by length within a chunk).
    ``compute(encoded, batches)`` yields (rows, values) per batch; ``pack(list of values)`` makes
    one 2-D array of several batches' values for ``World.gather`` (an empty list: no rows) and
    ``unpack(array, residue lengths)`` the {array name: rows} that ``store.write_part`` takes.
    Ranks gather every ``every`` batches."""
    ids, lengths, hashes = index.ids, index.lengths, index.hashes
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
                {name: np.concatenate([b[1][name] for b in buffer]) for name in buffer[0][1]},
            )
        buffer, buffered, buffered_bytes, last_flush = [], 0, 0, time.monotonic()

    from tqdm.auto import tqdm

    bar = tqdm(
        total=int((~is_done).sum()),
        unit="seq",
        desc=desc,
        disable=not (progress and world.is_root),
        dynamic_ncols=True,
    )
    try:
        for first, chunk in _chunks(records(), chunk_records):
            pending = [k for k in range(len(chunk)) if not is_done[first + k]]
            if not pending:
                continue
            record_of = np.array([first + k for k in pending], dtype=np.int64)
            # a checked FASTA sequence holds residues only: one token each, plus <cls> and <eos>
            token_lengths = np.array([len(chunk[k].sequence) + 2 for k in pending])
            # The batches one process would run, dealt out round-robin (longest first, so every
            # rank gets a similar mix): each sequence is computed in the same batch, padded to
            # the same width, whatever the number of ranks, so the outputs are the same.
            batches = world.shard(length_batches(token_lengths, batch_tokens, PAD_MULTIPLE))
            encoded = [None] * len(pending)  # this rank tokenizes its own batches only
            for b in batches:
                for i, e in zip(b, encode([chunk[pending[i]].sequence for i in b])):
                    encoded[i] = e
            results = compute(encoded, batches)
            rounds, held = world.max(len(batches)), []  # held: batches not yet gathered
            for step in range(rounds):
                rows, values = next(results, (np.zeros(0, np.int64), None))
                held.append((record_of[rows], values))
                if (step + 1) % every and step + 1 < rounds:
                    continue
                rows = np.concatenate([r for r, _ in held])
                flat = pack([v for _, v in held if v is not None])
                held = []
                ints = world.gather(rows.astype(np.int64))
                packed = world.gather(flat)
                for got_rows, block in zip(ints, packed):
                    n = len(got_rows)
                    computed += n
                    if n and store is not None:
                        buffer.append((got_rows, unpack(block, lengths[got_rows])))
                        buffered += n
                        buffered_bytes += block.nbytes
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
    return computed


def gather_every(batch_tokens: int, d: int, names: dict) -> int:
    """Batches each rank embeds between two gathers: as many as fit ``GATHER_BYTES`` (at most
    ``GATHER_ROUNDS``), the same number on every rank. Every gather makes the ranks wait for
    each other and for rank 0's writing; a gather per batch kept them in lockstep."""
    per_residue = sum(1 for key in names if key[1] == "per_residue")
    pooled = len(names) - per_residue
    # rows per batch: at most batch_tokens residues, at most batch_tokens / PAD_MULTIPLE sequences
    round_bytes = 4 * d * (per_residue * batch_tokens + pooled * max(1, batch_tokens // PAD_MULTIPLE))
    return max(1, min(GATHER_ROUNDS, GATHER_BYTES // round_bytes))


def _merge(parts: list[dict], names: dict) -> dict | None:
    """Several batches' values as one batch's (None for none)."""
    if not parts:
        return None
    merged = {}
    for key in names:
        if key[1] == "per_residue":
            merged[key] = [a for v in parts for a in v[key]]
        else:
            merged[key] = np.concatenate([v[key] for v in parts])
    return merged


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
    scanned: list[tuple[str, int, int, float]]  # (name, residues, forward passes, seconds) per protein
    rank: int = 0
    world_size: int = 1
    skipped: list[str] = dataclasses.field(default_factory=list)  # names already scanned in out


@guarded("out", "scan", "folder", inputs=("model", "fasta", "sequence"), when=_rank_zero, agree=agree_on_output)
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
    keep_nonstandard: bool = False,
    group=None,
    progress: bool = False,
    force: bool = False,
) -> ScanSummary:
    """Scan ``sequence`` (literal, or a FASTA file with one record; its files named ``name``,
    default the record's ID, else ``sequence``) or every record of ``fasta`` (named by their IDs)
    and write each protein's files into ``out`` (see ``Scan.write``); rank 0 writes.
    ``keep_nonstandard``: scan X B Z U O positions too (see ``tasks.scan.scan``).

    Resumes: a protein that ``out`` already holds, scanned from the same sequence with the same
    settings and model weights (``out/scan-manifest.json``; ``ESMC.fingerprint``), is skipped
    unless ``force``.
    Raises FastaError, ScoringError, JobError (matplotlib missing with ``plot``, a manifest of
    another tool)."""
    records = input_records(sequence, fasta, name)  # all checked before the model loads
    check_stems([ident for ident, _ in records], fasta, "{}_*")
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
        scan_settings(
            seq,
            method=method,
            window=window,
            offset=offset,
            model=weights,
            plot=plot,
            per_row=per_row,
            keep_nonstandard=keep_nonstandard,
        )
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
        started = time.perf_counter()
        result = run_scan(
            model,
            seq,
            method=method,
            batch_size=batch_size,
            window=window,
            offset=offset,
            name=ident,
            keep_nonstandard=keep_nonstandard,
            group=world.group,
            progress=progress,
        )
        seconds = time.perf_counter() - started  # the scoring, not the writing
        if manifest is not None:
            manifest.record(safe_name(ident), entry, result.write(out, plot=plot, per_row=per_row))
        scanned.append((ident, len(result.positions), result.passes, seconds))
    return ScanSummary(Path(out), scanned, world.rank, world.size, skipped)


def check_input_options(sequence, fasta, name) -> None:
    """JobError unless exactly one of --sequence and --fasta is given, and --name only with --sequence."""
    if (sequence is None) == (fasta is None):
        raise JobError("give exactly one of --sequence and --fasta")
    if fasta is not None and name is not None:  # it would be ignored: say so instead
        raise JobError(f"--name {name!r} names --sequence's files; with --fasta each record's ID names its files")


def input_records(sequence: str | None, fasta, name: str | None) -> list[tuple[str, str]]:
    """(name, sequence) of ``sequence`` (a protein or a FASTA file of one; named ``name``, default
    ``sequence``) or of every record of ``fasta``, all checked. Raises JobError, FastaError."""
    check_input_options(sequence, fasta, name)
    if fasta is not None:
        return [(r.id, r.sequence) for r in iter_fasta(fasta)]
    ident, seq = read_sequence_option(sequence)  # a FASTA file's record is named by its ID
    return [(name or ident or "sequence", seq)]


def check_stems(ids, fasta, pattern: str) -> None:
    """JobError when two IDs would name the same files (``pattern``: how a stem names them, e.g.
    ``{}_*``), case-blind as macOS's file system is."""
    stems: dict[str, str] = {}
    for ident in ids:
        other = stems.setdefault(safe_name(ident).lower(), ident)
        if other != ident:
            raise JobError(
                f"{fasta}: the IDs {other!r} and {ident!r} would both be written as "
                f"{pattern.format(safe_name(ident))}; rename one of them"
            )


# --- esmc-mlx score ---------------------------------------------------------------------------


@dataclasses.dataclass
class ScoreSummary:
    out: Path | None
    count: int  # mutants scored (rows written with scores)
    methods: list[str]
    spearman: dict[str, tuple[float, int]]  # method -> (rho, rows with a DMS value)
    dms_column: str | None
    wt_pppl: float | None
    passes: int
    rank: int = 0
    world_size: int = 1
    rejected: list[Rejected] = dataclasses.field(default_factory=list)  # with skip_invalid
    rejects_out: Path | None = None  # where they were written
    skipped: int = 0  # rows at non-standard residues, written with empty scores
    seconds: float = 0.0  # scoring, the model's loading excluded


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
    return read_sequence_option(text)[1]


def read_sequence_option(text: str) -> tuple[str | None, str]:
    """``--sequence``: (the record's FASTA ID, its sequence) for a FASTA file holding one record;
    (None, the sequence checked) for a sequence given literally."""
    path = Path(text).expanduser()
    if _names_input(path):
        records = read_fasta(path)
        if len(records) != 1:
            raise JobError(f"{path}: holds {len(records)} records; --sequence takes a file of one record")
        return records[0].id, records[0].sequence
    stripped = text.strip()
    if "/" in stripped or stripped.lower().endswith(FASTA_SUFFIXES):
        raise JobError(f"--sequence {text}: no such file (give a protein sequence or an existing FASTA file)")
    return None, check_sequence(stripped, "--sequence", label="sequence")


def _names_input(path: Path) -> bool:
    """Whether ``path`` names something to read: a file, or a pipe (``<(zcat wt.fa.gz)``); False
    for a directory, and for text no file system accepts as a name (a protein of more than ~255
    residues given literally raises OSError "File name too long")."""
    try:
        return path.exists() and not path.is_dir()
    except (OSError, ValueError):
        return False


def _rejects_out(args: dict) -> Path | None:
    """Where ``score_csv``'s call ``args`` writes the rows it rejects (``rejects_path``), if anywhere."""
    out = args["out"]
    return rejects_path(out) if args["skip_invalid"] and out is not None and not written_in_place(out) else None


_SCORE_INPUTS = ("model", "mutations_csv", "sequence")


@guarded("out", "scores", "file", inputs=_SCORE_INPUTS, when=_rank_zero, agree=agree_on_output)
@guarded(_rejects_out, "rejects", "file", inputs=_SCORE_INPUTS, when=_rank_zero, agree=agree_on_output)
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
    skip_invalid: bool = False,
    keep_nonstandard: bool = False,
    group=None,
    progress: bool = False,
) -> ScoreSummary:
    """Score the mutants of a CSV and write it back (to ``out``) with one column per method.
    ``sequence``: the wild type, or a FASTA file holding it. ``model``: a loaded ESMC, or a
    path / Hub id to load once the input has been checked.

    Every row is checked before the model loads (``scoring.check_mutants``: malformed, wrong
    wild type, out of range, a joint mutant wider than the window, a ``mutated_sequence`` column
    that disagrees). Rows that fail are all reported at once (JobError, MutationError or
    ScoringError); with ``skip_invalid`` the others are scored and the rejected rows, with their
    line and reason, are written to ``rejects_path(out)``. Rows at a non-standard residue (X B
    Z U O) are written with empty scores, with a warning, unless ``keep_nonstandard``.

    With a ``dms_column`` present, reports Spearman's rho of each method against it (rows with
    an empty or non-numeric value, or no score, left out).
    """
    world = World.of(group)
    methods = resolve_methods(methods)
    check_multi_window(multi, window, methods)
    rejects_out = _rejects_out({"out": out, "skip_invalid": skip_invalid})  # (checked by its guard)
    wt = resolve_sequence(sequence)
    columns, rows, where = read_mutants_csv(mutations_csv, mutant_column)
    mutants = [row[mutant_column] or "" for row in rows]
    joint = "masked_marginal" in methods and multi == "joint"
    _, rejected = check_mutants(  # before loading a model: bad input fails fast, every bad row named
        mutants,
        wt,
        offset,
        where,
        joint_window=window if joint else False,
        mutated_sequences=[row["mutated_sequence"] for row in rows] if "mutated_sequence" in columns else None,
    )
    if rejected and not skip_invalid:
        error = rejection_error(rejected, len(rows))
        hint = "--skip-invalid scores the other rows" + (
            f" and writes these to {rejects_path(out)}" if out is not None and not written_in_place(out) else ""
        )
        raise type(error)(f"{error}{chr(10) if len(rejected) > 1 else '; '}{hint}")
    if len(rejected) == len(rows):
        raise rejection_error(rejected, len(rows))
    bad = {r.index for r in rejected}
    rejected_rows = [rows[r.index] for r in rejected]
    rows, where, mutants = ([x for i, x in enumerate(v) if i not in bad] for v in (rows, where, mutants))
    model, _ = _model(model, None)
    started = time.perf_counter()
    result = score_mutations(
        model,
        wt,
        mutants,
        methods=methods,
        batch_size=batch_size,
        offset=offset,
        multi=multi,
        window=window,
        keep_nonstandard=keep_nonstandard,
        group=world.group,
        progress=progress,
        where=where,
    )
    seconds = time.perf_counter() - started
    correlations = {}
    if dms_column in columns:
        measured = np.array([_float(row[dms_column]) for row in rows])
        for method, values in result.scores.items():
            keep = ~np.isnan(measured) & ~np.isnan(values)
            correlations[method] = (spearman(values[keep], measured[keep]), int(keep.sum()))
    out_path = Path(out) if out is not None else None
    if world.is_root and out_path is not None:
        header = columns + [m for m in result.scores if m not in columns]
        with atomic_file(out_path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
            writer.writeheader()
            for i, row in enumerate(rows):
                writer.writerow({**row, **{m: _fmt(v[i]) for m, v in result.scores.items()}})
        if rejects_out is not None:
            write_rejects(rejects_out, columns, rejected, rejected_rows)
    return ScoreSummary(
        out_path,
        len(rows) - len(result.skipped),
        list(result.scores),
        correlations,
        dms_column if dms_column in columns else None,
        result.wt_pppl,
        result.passes,
        world.rank,
        world.size,
        rejected,
        rejects_out if world.is_root else None,
        len(result.skipped),
        seconds,
    )


def rejects_path(out: str | Path) -> Path:
    """Where ``score --skip-invalid`` writes the rows it could not score: beside ``out``,
    ``scored.csv`` -> ``scored.rejected.csv``."""
    out = Path(out)
    return out.with_name(out.name.removesuffix(".csv") + ".rejected.csv")


def write_rejects(path: Path, columns: list[str], rejected: Sequence[Rejected], rows: Sequence[dict]) -> None:
    """The rejected ``rows`` as a CSV: ``line`` (of the input) and ``reason``, then the row as it was."""
    with atomic_file(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["line", "reason", *columns], extrasaction="ignore")
        writer.writeheader()
        for r, row in zip(rejected, rows):
            line = re.search(r"line (\d+): $", r.where)  # read_mutants_csv's prefix
            writer.writerow({**row, "line": line.group(1) if line else "", "reason": r.reason})


def _float(text: str | None) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _fmt(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.8g}"
