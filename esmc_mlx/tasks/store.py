"""The embeddings directory that ``esmc-mlx embed`` writes and resumes (rank 0 only).

Layout (see docs/scoring.md)::

    OUT/manifest.json        settings and state ({"complete": true} once merged)
    OUT/index.tsv            id, length, sha1 of the sequence; row i <-> row i of every array
    format npy (default):
      OUT/NAME.npy           (N, d) pooled arrays, FASTA order; (sum of lengths, d) per-residue
      OUT/offsets.npy        (N + 1,) int64: residues of sequence i are rows offsets[i]:offsets[i+1]
    format safetensors:
      OUT/embeddings-0000K-of-0000M.safetensors   the same arrays, split at record boundaries
      OUT/embeddings.safetensors.index.json       which records and residue rows each shard holds
      OUT/offsets.npy
    format h5 (esmc-mlx[h5]):
      OUT/embeddings.h5      one dataset per array, plus ``offsets`` and ``ids``
    OUT/parts/part-*.npz     results flushed while running (ids, sha1, lengths, arrays);
                             merged into the files above and deleted when every record is done

NAME is the pool (``mean``, ``max``, ``cls``, ``per_residue``) for one layer, or
``layer{i}_{pool}`` when several layers are stored. A rerun skips the IDs already in the
directory (merged or in a part), so an interrupted run resumes where it stopped, and a FASTA
that grew computes only its new records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import os
import re
import shutil
import time
import uuid
import zipfile
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..artifact import plural
from ..errors import JobError, install_hint
from ..outputs import OutputFolder, apply_umask, atomic_file, clean_leftovers, make_staging
from ..readers import read_json
from .scoring import of_layers

FORMAT = "esmc-mlx-embeddings"
FORMAT_VERSION = 2
FORMATS = ("npy", "safetensors", "h5")
FLUSH_BYTES = 256 << 20  # also flush once this much is buffered (per-residue outputs of big models)
SHARD_BYTES = 1 << 30  # largest safetensors shard
# what the stored arrays depend on: a rerun with other values is refused. model_weights is
# ``ESMC.fingerprint``; a manifest without it resumes (nothing there can tell which model
# wrote it) and records it from then on.
SETTINGS_KEYS = (
    "layers",
    "pools",
    "dtype",
    "hidden_size",
    "num_hidden_layers",
    "storage",
    "model_weights",
    "keep_nonstandard",
)
# A setting a manifest may lack, and what the embeddings it describes were made with: before the
# residue policy, mean and max pooled non-standard residues too.
SETTINGS_BEFORE = {"keep_nonstandard": True}
ST_INDEX = "embeddings.safetensors.index.json"
H5_FILE = "embeddings.h5"
COPY_ROWS = 1 << 16  # rows per copy when converting the merged arrays to safetensors / HDF5
# what an embeddings directory written before the .esmc-mlx marker holds of its own, besides the
# arrays its manifest names (``legacy_entries``)
_OURS = re.compile(
    r"manifest\.json|index\.tsv|offsets\.npy|embeddings-\d+-of-\d+\.safetensors"
    r"|embeddings\.safetensors\.index\.json|embeddings\.h5|parts"
)
_PART = re.compile(r"part-.+\.npz")
_ARRAY = re.compile(r"[A-Za-z0-9_]+\.npy")


def _array_layout(settings: dict, name: str, dtype, width: int, rows: int) -> tuple[np.dtype, tuple[int, int]]:
    """(dtype, shape) of a stored array: ``settings["array_layouts"][name]`` = [width, dtype]
    where given (arrays of other widths and dtypes than the embeddings'), else ``dtype``, ``width``."""
    layout = (settings.get("array_layouts") or {}).get(name)
    if layout is not None:
        width, dtype = layout[0], np.dtype(layout[1])
    return dtype, (rows, width)


def _shown(value) -> str:
    """A setting in an error message; a model's sha256 by its first 12 digits, as git shows commits."""
    return repr(value[:12] + "...") if isinstance(value, str) and len(value) == 64 else repr(value)


def reserved_memmap(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.memmap:
    """``np.lib.format.open_memmap(path, "w+")`` with the file's blocks reserved first. The file
    it makes is sparse: when the disk fills, a write through the map kills the process with
    SIGBUS (no exception, no cleanup; seen with a merge on a full 1 MiB tmpfs, rc 135). Reserved
    with ``posix_fallocate``, a full disk is an ``OSError`` (ENOSPC) before anything is copied.
    Where the call is missing (macOS) the file stays sparse, as before."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    if hasattr(os, "posix_fallocate"):
        with open(path, "r+b") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
            except OSError as e:
                del array
                raise OSError(e.errno, e.strerror, str(path)) from None
    return array


def sequence_hash(sequence: str) -> str:
    return hashlib.sha1(sequence.encode()).hexdigest()


class IdList:
    """Many IDs in one bytes buffer plus end offsets: about len(id) + 8 bytes an ID, where a list
    of Python strings costs ~60 more. Indexable and iterable like a list."""

    def __init__(self, ids=()):
        self._blob, self._ends = bytearray(), array("q")
        for i in ids:
            self.append(i)

    def append(self, ident: str) -> None:
        self._blob += ident.encode()
        self._ends.append(len(self._blob))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = int(i) + (len(self) if i < 0 else 0)
        return self._blob[self._ends[i - 1] if i else 0 : self._ends[i]].decode()

    def __iter__(self):
        start = 0
        for end in self._ends:
            yield self._blob[start:end].decode()
            start = end


class IdIndex:
    """Where each ID of a FASTA is, without a dict of Python strings: a sorted array of 64-bit
    keys (blake2b of the ID), each hit checked against the ID itself, so that a key collision
    can never mix two records up. About 16 bytes a record besides the ID list."""

    def __init__(self, ids: Sequence[str]):
        self.ids = ids
        keys = _keys(ids)
        self.order = np.argsort(keys, kind="stable")
        self.sorted = keys[self.order]
        if len(self.sorted) > 1 and (self.sorted[1:] == self.sorted[:-1]).any():
            raise JobError("two FASTA IDs share a 64-bit key; rename one of them")  # ~1e-5 at 30M records

    def find(self, ids: Sequence[str]) -> np.ndarray:
        """Positions of ``ids`` in the FASTA, -1 for an ID it does not hold."""
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        keys = _keys(ids)
        at = np.minimum(np.searchsorted(self.sorted, keys), len(self.sorted) - 1) if len(self.sorted) else None
        if at is None:
            return np.full(len(ids), -1, dtype=np.int64)
        pos = self.order[at].astype(np.int64)
        ok = self.sorted[at] == keys
        ok &= np.array([self.ids[p] == i for p, i in zip(pos, ids)], dtype=bool)
        return np.where(ok, pos, -1)


def _keys(ids: Sequence[str]) -> np.ndarray:
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "little") for i in ids),
        dtype=np.uint64,
        count=len(ids),
    )


def array_names(layers: Sequence[int], pools: Sequence[str]) -> dict[tuple[int, str], str]:
    """(layer, pool) -> stored array name: the pool alone for one layer, else layer{i}_{pool}."""
    return {(i, p): p if len(layers) == 1 else f"layer{i}_{p}" for i in layers for p in pools}


# Arrays with a row per residue (the rest have a row per record): embed's per_residue, and the
# sparse autoencoder features' indices and values (``tasks.features``).
PER_RESIDUE_SUFFIXES = ("per_residue", "_indices", "_values")


def is_per_residue(name: str) -> bool:
    return name.endswith(PER_RESIDUE_SUFFIXES)


def require_h5py():
    try:
        import h5py
    except ImportError:
        raise JobError(f"--format h5 needs h5py: {install_hint('h5')}") from None
    return h5py


# --- the embedding directory (rank 0 only) ---------------------------------------------------


def legacy_entries(out: Path) -> list[str] | None:
    """What an embeddings directory written before the .esmc-mlx marker holds of its own (its
    manifest.json says it is esmc-mlx's embeddings): the manifest, the index, the arrays the
    manifest names, the merged files, parts/ while it holds only part files. None for a folder
    without such a manifest."""
    try:
        data = read_json(Path(out) / "manifest.json", JobError)
    except JobError:
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    arrays = data.get("arrays")
    if data.get("version") == 1 and "layer" in data:  # one layer, mean (+ per_residue)
        arrays = ["mean"] + (["per_residue"] if data.get("per_residue") else [])
    arrays = {f"{n}.npy" for n in arrays if isinstance(n, str)} if isinstance(arrays, list) else set()
    ours = []
    for p in sorted(Path(out).iterdir()):
        if p.name in arrays or _OURS.fullmatch(p.name):
            if p.name == "parts" and not (p.is_dir() and all(_PART.fullmatch(q.name) for q in p.iterdir())):
                continue
            ours.append(p.name)
    return ours


class EmbeddingStore:
    """A directory of per-record arrays that a job fills in parts and merges. Subclasses for
    other jobs set what they write: FORMAT, KIND (its name in messages), COMMAND (what writes
    it) and SETTINGS_KEYS (the settings a rerun must share); the files a job adds to OUT go
    through its output guard (``folder.file``), which records them as esmc-mlx's."""

    FORMAT = FORMAT
    KIND = "embeddings"
    COMMAND = "embed"
    SETTINGS_KEYS = SETTINGS_KEYS

    def __init__(self, out: str | Path, folder: OutputFolder | None = None):
        """The directory ``out``; ``folder``: its output guard (held by the job that writes it;
        reading needs none)."""
        self.out = Path(out)
        self.folder = folder
        self.parts = self.out / "parts"
        self._existing: dict | None = None  # the manifest open() found
        self.manifest_path = self.out / "manifest.json"
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self._count = 0

    def manifest(self) -> dict | None:
        if not self.manifest_path.exists():
            return None
        try:
            data = read_json(self.manifest_path, JobError)
        except JobError as e:
            raise JobError(f"{e}; use --force to start over") from None
        if not isinstance(data, dict) or data.get("format") != self.FORMAT:  # another tool's manifest.json
            raise JobError(f"{self.out}: not an esmc-mlx {self.KIND} directory")
        if data.get("version") == 1 and "layer" in data:  # one layer, mean (+ per_residue), npy
            pools = ["mean"] + (["per_residue"] if data.get("per_residue") else [])
            data.update(layers=[data["layer"]], pools=pools, storage="npy", arrays=pools)
        return data

    def open(self, settings: dict, force: bool, moot: tuple[str, ...] = ()) -> None:
        """Check that an existing directory holds the same settings (a new one is made by
        ``begin``; ``moot``: settings that change nothing for these sequences, not compared). With
        ``force``, clear what esmc-mlx wrote there (``OutputFolder.clear``: never a folder holding
        anything else). Nothing else changes until ``begin``, which the job calls once its own
        checks pass."""
        existing = None
        if force:
            self.folder.clear()
        elif self.out.exists():
            existing = self.manifest()
        if existing is not None:
            differ = [
                f"{k}: {_shown(existing.get(k, SETTINGS_BEFORE.get(k)))} there, {_shown(settings[k])} now"
                for k in self.SETTINGS_KEYS
                if k not in moot
                and existing.get(k, SETTINGS_BEFORE.get(k)) != settings[k]
                and not (k == "model_weights" and k not in existing)
            ]
            if differ:
                raise JobError(
                    f"{self.out} holds {self.KIND} made with other settings ({'; '.join(differ)}); "
                    "use another output directory or --force to start over"
                )
        self._existing = existing

    def completed(self) -> tuple[dict, dict]:
        """(manifest, merged files) of a completed directory; JobError when it is not one."""
        manifest = self.manifest()
        merged = self._merged() if manifest else None
        if not manifest or not manifest.get("complete") or merged is None:
            raise JobError(f"{self.out}: no completed {self.KIND} (run esmc-mlx {self.COMMAND} again to finish it)")
        return manifest, merged

    def begin(self, settings: dict) -> None:
        """Mark the directory as being written (``complete: false``), made if new."""
        self.folder.record("parts", "manifest.json")
        self.parts.mkdir(exist_ok=True)
        clean_leftovers(folder=self.parts)  # parts being written by runs that were killed
        self._write_manifest(dict(self._existing or {}, **settings, complete=False))

    def _write_manifest(self, data: dict) -> None:
        with self.folder.file(self.manifest_path.name) as f:
            f.write(
                json.dumps(
                    dict(
                        format=self.FORMAT,
                        version=FORMAT_VERSION,
                        **{k: v for k, v in data.items() if k not in ("format", "version")},
                    ),
                    indent=2,
                )
                + "\n"
            )

    def _merged(self) -> dict | None:
        """The merged files, if present and consistent: ids, hashes, lengths, offsets, and
        ``arrays`` (name -> rows, read lazily: memory maps, HDF5 datasets, safetensors slices)."""
        manifest = self.manifest() or {}
        names, kind = manifest.get("arrays", []), manifest.get("storage", "npy")
        index = self.out / "index.tsv"
        if not index.exists() or not names:
            return None
        ids, lengths, hashes = [], [], []
        try:
            with open(index) as f:
                next(f)
                for line in f:
                    ident, length, digest = line.rstrip("\n").split("\t")
                    ids.append(ident)
                    lengths.append(int(length))
                    hashes.append(digest)
            arrays, offsets = _READERS[kind](self.out, names)
        except (OSError, JobError, KeyError, ValueError, TypeError, AttributeError, StopIteration):
            # a merge that was cut short, or merged files damaged since: what they held is computed
            # again (the parts they came from, if any, are still there)
            return None
        merged = {"ids": ids, "lengths": np.array(lengths, dtype=np.int64), "sha1": hashes}
        merged["arrays"], merged["offsets"] = arrays, offsets
        for name, rows in arrays.items():
            expect = int(offsets[-1]) if is_per_residue(name) else len(ids)
            if rows.shape[0] != expect:
                return None
        if offsets is not None and len(offsets) != len(ids) + 1:
            return None
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
            ids, digests = _part_ids(path)
            done.update(zip(ids, digests.tolist()))
        return done

    def status(self, index: IdIndex, hashes: np.ndarray) -> tuple[np.ndarray, list[str], set[str]]:
        """(done: bool per FASTA record, IDs stored here with another sequence's sha1, IDs stored
        here that the FASTA lacks), reading the merged index and the parts one at a time.
        ``hashes``: the FASTA's sha1s, bytes."""
        done = np.zeros(len(hashes), dtype=bool)
        changed: list[str] = []
        missing: set[str] = set()

        def visit(ids, digests):
            pos = index.find(ids)
            hit = pos >= 0
            same = np.asarray(digests, dtype="S40")[hit] == hashes[pos[hit]]
            ids = np.asarray(ids, dtype=object)
            changed.extend(ids[hit][~same].tolist())
            missing.update(ids[~hit].tolist())
            done[pos[hit][same]] = True

        merged = self._merged()
        if merged:
            visit(merged["ids"], merged["sha1"])
        for path in self._part_files():
            visit(*_part_ids(path))
        return done, changed, missing

    def write_part(self, ids: list[str], hashes: list[str], lengths: np.ndarray, arrays: dict[str, np.ndarray]) -> Path:
        """``arrays``: name -> (n, d) pooled, or (sum of lengths, d) per-residue rows."""
        self._count += 1
        path = self.parts / f"part-{self.run_id}-{self._count:06d}.npz"
        with atomic_file(path, "wb") as f:
            np.savez(f, ids=np.array(ids), sha1=np.array(hashes), lengths=lengths, **arrays)
        self.folder.commit()  # a result a rerun resumes from: kept if this run fails later
        return path

    def merge(self, ids: list[str], lengths: np.ndarray, hashes, settings: dict, index: IdIndex | None = None) -> int:
        """Write the merged files in FASTA order (``ids``, their residue ``lengths`` and sha1
        ``hashes``) from the old merged files and the parts; delete the parts. Returns how many
        stored embeddings were dropped (IDs not in the FASTA). Sources are copied in order
        (merged files, then parts oldest first), so a later result for an ID wins."""
        index = index or IdIndex(ids)
        merged = self._merged()
        if (
            merged
            and not self._part_files()
            and len(merged["ids"]) == len(ids)
            and all(a == b for a, b in zip(merged["ids"], ids))
        ):
            self._write_manifest(dict(self.manifest() or {}, **settings, complete=True, count=len(ids)))
            self._drop_empty_parts()  # made by begin()
            return 0  # nothing new: the merged files are already this FASTA's
        dtype, d, names = np.dtype(settings["dtype"]), settings["hidden_size"], settings["arrays"]
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        staging = make_staging(self.out, "merge", "partial")
        try:
            files, dropped = self._merge_into(
                staging, merged, ids, lengths, hashes, offsets, index, names, dtype, d, settings
            )
            apply_umask(staging)  # safetensors writes its files 0600 whatever the umask
        except BaseException:  # a full disk, Ctrl-C: the parts stay and a rerun merges again
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.folder.record(*files)
        for name in files:
            if name != "index.tsv":
                os.replace(staging / name, self.folder.claim(name))
        os.replace(staging / "index.tsv", self.folder.claim("index.tsv"))  # last: it makes the rest count
        for stale in self.out.glob("embeddings-*-of-*.safetensors"):  # shards of an earlier merge
            if stale.name not in files and self.folder.owns(stale.name):
                stale.unlink()
        shutil.rmtree(staging, ignore_errors=True)
        self._write_manifest(dict(self.manifest() or {}, **settings, complete=True, count=len(ids)))
        for path in self._part_files():
            path.unlink()
        self._drop_empty_parts()
        return len(dropped)

    def _merge_into(self, staging, merged, ids, lengths, hashes, offsets, index, names, dtype, d, settings):
        """Write the merged files into ``staging``; return their names and the IDs dropped."""
        out = {
            n: reserved_memmap(
                staging / f"{n}.npy",
                *_array_layout(settings, n, dtype, d, int(offsets[-1]) if is_per_residue(n) else len(ids)),
            )
            for n in names
        }
        filled = np.zeros(len(ids), dtype=bool)
        dropped: set[str] = set()
        sources = ([lambda: merged] if merged else []) + [lambda p=p: _load_part(p) for p in self._part_files()]
        for load_source in sources:
            src = load_source()
            src_ids = list(src["ids"]) if not isinstance(src["ids"], list) else src["ids"]
            dest = index.find(src_ids)
            dropped.update(i for i, p in zip(src_ids, dest) if p < 0)
            src_offsets = src.get("offsets")
            if src_offsets is None:
                src_offsets = np.concatenate([[0], np.cumsum(src["lengths"])])
            for row in np.nonzero(dest >= 0)[0]:
                at = dest[row]
                for n in names:
                    if is_per_residue(n):
                        out[n][offsets[at] : offsets[at + 1]] = src["arrays"][n][
                            src_offsets[row] : src_offsets[row + 1]
                        ]
                    else:
                        out[n][at] = src["arrays"][n][row]
            filled[dest[dest >= 0]] = True
            del src
        if not filled.all():
            missing = ids[int(np.argmin(filled))]
            raise JobError(
                f"cannot merge {self.out}: {int((~filled).sum())} records have no embedding yet (e.g. {missing!r})"
            )
        for stored in out.values():
            stored.flush()
        del out
        with open(staging / "index.tsv", "w") as f:
            f.write("id\tlength\tsha1\n")
            for ident, n, digest in zip(ids, lengths, hashes):
                f.write(f"{ident}\t{n}\t{digest.decode() if isinstance(digest, bytes) else digest}\n")
        return _WRITERS[settings["storage"]](staging, names, offsets), dropped

    def _drop_empty_parts(self) -> None:
        if self.parts.exists() and not any(self.parts.iterdir()):
            self.parts.rmdir()


# what np.load and a missing array raise for a part that is not what write_part wrote
_PART_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


def _unreadable_part(path: Path, error: Exception) -> JobError:
    # numpy's own text may advise loading pickled data: never repeat that
    return JobError(
        f"{path}: a damaged part, or not one esmc-mlx wrote ({type(error).__name__}); move it out of "
        f"{path.parent} and run again (its records are computed again)"
    )


def _part_ids(path: Path) -> tuple[list[str], np.ndarray]:
    """The IDs and sha1s a part holds; JobError naming a damaged part."""
    try:
        with np.load(path) as part:
            return part["ids"].tolist(), part["sha1"]
    except _PART_ERRORS as e:
        raise _unreadable_part(path, e) from None


def _load_part(path: Path) -> dict:
    try:
        with np.load(path) as part:
            data = {k: part[k] for k in part.files}
        data["ids"], data["sha1"], data["lengths"]  # noqa: B018  (all three, or the part is damaged)
    except _PART_ERRORS as e:
        raise _unreadable_part(path, e) from None
    meta = ("ids", "sha1", "lengths")
    return {
        "ids": data["ids"].tolist(),
        "sha1": data["sha1"],
        "lengths": data["lengths"],
        "arrays": {k: v for k, v in data.items() if k not in meta},
    }


# --- the three formats of the merged arrays ----------------------------------------------------


def _npy_read(out: Path, names):
    arrays = {n: np.load(out / f"{n}.npy", mmap_mode="r") for n in names}
    offsets = np.load(out / "offsets.npy") if any(map(is_per_residue, names)) else None
    return arrays, offsets


def _npy_write(staging: Path, names, offsets) -> list[str]:
    files = [f"{n}.npy" for n in names]
    if any(map(is_per_residue, names)):
        np.save(staging / "offsets.npy", offsets)
        files.append("offsets.npy")
    return files + ["index.tsv"]


class _Sharded:
    """Rows of one array spread over safetensors shards that split at record boundaries;
    ``rows[i]`` and ``rows[a:b]`` (within one record) read only those rows."""

    def __init__(self, out: Path, shards: list[dict], name: str, key: str, total: int, width: int, dtype):
        self.files = [out / s["file"] for s in shards]
        self.starts = np.array([s[key] for s in shards], dtype=np.int64)
        self.name, self.shape, self.dtype, self._open = name, (total, width), dtype, {}

    def _slice(self, k: int):
        from safetensors import safe_open

        if k not in self._open:
            self._open = {k: safe_open(str(self.files[k]), framework="numpy")}
        return self._open[k].get_slice(self.name)

    def __getitem__(self, item):
        a, b = (item.start, item.stop) if isinstance(item, slice) else (int(item), int(item) + 1)
        k = int(np.searchsorted(self.starts, a, side="right")) - 1
        rows = self._slice(k)[a - self.starts[k] : b - self.starts[k]]
        return rows if isinstance(item, slice) else rows[0]

    def __array__(self, dtype=None, copy=None):
        from safetensors.numpy import load_file

        whole = np.concatenate([load_file(str(f))[self.name] for f in self.files])
        return whole if dtype is None else whole.astype(dtype)


def _safetensors_read(out: Path, names):
    index = read_json(out / ST_INDEX, JobError)
    shards = index["shards"]
    if not all((out / s["file"]).exists() for s in shards):
        raise OSError("missing shard")
    offsets = np.load(out / "offsets.npy") if any(map(is_per_residue, names)) else None
    arrays = {}
    for n in names:
        total = index["residues"] if is_per_residue(n) else index["records"]
        arrays[n] = _Sharded(
            out,
            shards,
            n,
            "residue_start" if is_per_residue(n) else "start",
            total,
            index["hidden_size"],
            np.dtype(index["dtype"]),
        )
    return arrays, offsets


def _safetensors_write(staging: Path, names, offsets) -> list[str]:
    from safetensors.numpy import save_file

    arrays = {n: np.load(staging / f"{n}.npy", mmap_mode="r") for n in names}
    first = arrays[names[0]]
    width, itemsize = first.shape[1], first.dtype.itemsize
    lengths = np.diff(offsets)
    per_record = (
        width * itemsize * (sum(not is_per_residue(n) for n in names) + lengths * sum(map(is_per_residue, names)))
    )
    ranges, start, size = [], 0, 0
    for i, nbytes in enumerate(per_record):
        if size and size + nbytes > SHARD_BYTES:
            ranges.append((start, i))
            start, size = i, 0
        size += int(nbytes)
    ranges.append((start, len(lengths)))
    shards = []
    for k, (a, b) in enumerate(ranges):
        name = f"embeddings-{k + 1:05d}-of-{len(ranges):05d}.safetensors"
        tensors = {
            n: np.ascontiguousarray(arrays[n][offsets[a] : offsets[b]] if is_per_residue(n) else arrays[n][a:b])
            for n in names
        }
        save_file(tensors, str(staging / name), metadata={"format": FORMAT})
        shards.append(
            {
                "file": name,
                "start": a,
                "count": b - a,
                "residue_start": int(offsets[a]),
                "residues": int(offsets[b] - offsets[a]),
            }
        )
    del arrays
    (staging / ST_INDEX).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "records": len(lengths),
                "residues": int(offsets[-1]),
                "hidden_size": int(width),
                "dtype": first.dtype.name,
                "arrays": list(names),
                "shards": shards,
            },
            indent=1,
        )
        + "\n"
    )
    np.save(staging / "offsets.npy", offsets)
    for n in names:
        (staging / f"{n}.npy").unlink()
    return [s["file"] for s in shards] + [ST_INDEX, "offsets.npy", "index.tsv"]


def _h5_read(out: Path, names):
    h5py = require_h5py()
    f = h5py.File(out / H5_FILE, "r")  # kept open: the datasets read lazily
    arrays = {n: f[n] for n in names}
    return arrays, (f["offsets"][:] if "offsets" in f else None)


def _h5_write(staging: Path, names, offsets) -> list[str]:
    h5py = require_h5py()
    ids = [line.split("\t")[0] for line in (staging / "index.tsv").read_text().split("\n")[1:-1]]
    with h5py.File(staging / H5_FILE, "w") as f:
        f.attrs["format"] = FORMAT
        for n in names:
            src = np.load(staging / f"{n}.npy", mmap_mode="r")
            dset = f.create_dataset(
                n, shape=src.shape, dtype=src.dtype, chunks=(min(len(src), 1024) or 1, src.shape[1])
            )
            for a in range(0, len(src), COPY_ROWS):
                dset[a : a + COPY_ROWS] = src[a : a + COPY_ROWS]
            del src
            (staging / f"{n}.npy").unlink()
        f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
        if any(map(is_per_residue, names)):
            f.create_dataset("offsets", data=offsets)
    return [H5_FILE, "index.tsv"]


_READERS = {"npy": _npy_read, "safetensors": _safetensors_read, "h5": _h5_read}
_WRITERS = {"npy": _npy_write, "safetensors": _safetensors_write, "h5": _h5_write}


@dataclasses.dataclass(repr=False)
class StoredEmbeddings:
    """An embeddings directory, read back. ``arrays``: name -> rows (npy: memory maps; h5:
    h5py datasets; safetensors: lazily sliced shards, ``np.asarray`` loads one whole).
    ``get(pool, layer)`` reads one array (``layer`` may be left out when one layer was stored).
    ``mean`` and ``residues``: for one layer its array (None when that pool was not stored); for
    several, a ``ByLayer`` dict keyed by layer (``stored.mean[6]``, ``[-1]`` the final)."""

    ids: list[str]
    arrays: dict
    offsets: np.ndarray | None = None
    layers: tuple[int, ...] = ()
    pools: tuple[str, ...] = ()
    num_layers: int = 0

    def _key(self, pool: str, layer: int | None) -> tuple[int, str]:
        if not isinstance(pool, str):
            raise JobError(f"pool {pool!r}: give a pool name ({', '.join(self.pools)})")
        if layer is None:
            if len(self.layers) != 1:
                raise JobError(
                    f"get({pool!r}): this directory holds layers {', '.join(map(str, self.layers))}; say which "
                    "with layer= (one of them, or -1 for the final)"
                )
            layer = self.layers[0]
        elif isinstance(layer, numbers.Integral) and not isinstance(layer, bool) and layer < 0:
            layer += self.num_layers + 1  # -1 = final
        return layer, pool.replace("-", "_")

    def get(self, pool: str = "mean", layer: int | None = None):
        """The array of ``pool`` at hidden state ``layer`` (-1 = final; needed when several were stored)."""
        names = array_names(self.layers, self.pools)
        key = self._key(pool, layer)
        if key not in names:
            raise JobError(
                f"no {key[1]} embeddings of layer {key[0]} here (stored: layers {list(self.layers)}, "
                f"pools {list(self.pools)})"
            )
        return self.arrays[names[key]]

    def _of_layers(self, pool: str):
        names = array_names(self.layers, self.pools)
        arrays = {key: self.arrays[name] for key, name in names.items() if name in self.arrays}
        return of_layers(arrays, self.layers, pool, self.num_layers)

    @property
    def mean(self):
        return self._of_layers("mean")

    @property
    def residues(self):
        """Every record's per-residue rows, concatenated (``offsets`` cuts them by record)."""
        return self._of_layers("per_residue")

    def per_residue(self, key: int | str, layer: int | None = None) -> np.ndarray:
        """(L, d) rows of record ``key`` (an index, negative from the end, or an ID)."""
        if not any(map(is_per_residue, self.arrays)):
            raise JobError("this directory was written without per-residue embeddings")
        i = record_index(self.ids, key)
        return np.asarray(self.get("per_residue", layer)[self.offsets[i] : self.offsets[i + 1]])

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        first = next(iter(self.arrays.values()), None)
        width = first.shape[-1] if getattr(first, "shape", ()) else "?"
        return (
            f"StoredEmbeddings({plural(len(self.ids), 'record')}, hidden size {width}, layers "
            f"[{', '.join(map(str, self.layers))}], pools [{', '.join(self.pools)}])"
        )


def record_index(ids: list[str], key: int | str) -> int:
    """The position of record ``key`` (an ID, or an index, negative from the end) in ``ids``."""
    n = len(ids)
    if isinstance(key, str):
        if key not in ids:
            raise JobError(f"no record {key!r} here")
        return ids.index(key)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool) and -n <= key < n:
        return int(key) % n  # offsets has n + 1 entries: a raw -1 read the slice offsets[-1]:offsets[0]
    raise JobError(f"record {key!r}: give an ID or an index in {-n}..{n - 1} ({n} records)")


def read_embeddings(out: str | Path) -> StoredEmbeddings:
    """Open a completed ``esmc-mlx embed`` output directory (any of the three formats)."""
    manifest, merged = EmbeddingStore(out).completed()
    return StoredEmbeddings(
        merged["ids"],
        merged["arrays"],
        merged["offsets"],
        tuple(manifest["layers"]),
        tuple(manifest["pools"]),
        int(manifest.get("num_hidden_layers", 0)),
    )
