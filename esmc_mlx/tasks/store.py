"""The embeddings directory that ``esmc-mlx embed`` writes and resumes (rank 0 only).

Layout (see docs/scoring.md)::

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

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from ..errors import JobError
from .fasta import Record

FORMAT = "esmc-mlx-embeddings"
FORMAT_VERSION = 1
FLUSH_BYTES = 256 << 20  # also flush once this much is buffered (per-residue outputs of big models)
SETTINGS_KEYS = ("layer", "per_residue", "dtype", "hidden_size", "num_hidden_layers")


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
