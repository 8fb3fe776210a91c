"""Saturation scan: every single substitution of a protein scored, with the entropy of the
model's prediction at each position (``esmc-mlx scan``, ``ProteinModel.scan``).

Conventions (docs/scoring.md): scores are the masked-marginal (default) or wild-type-marginal
log-likelihood ratios ``log p(mut) - log p(wt)`` of ``tasks.scoring``; the matrix columns are
the 20 amino acids in alphabetical order (``AMINO_ACIDS_20``), the wild-type cell is 0. The
entropy is that of the predicted distribution over the 20 amino acids, renormalised, in nats
(0 .. ln 20 = 3.00), read from the same row as the scores.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import numbers
import re
from pathlib import Path

import numpy as np

from ..errors import JobError, ScoringError
from ..outputs import OutputFolder, guard
from ..readers import read_json
from ..runtime.model import ESMC
from ..vocab import check_sequence
from .distributed import World
from .heatmap import plot_heatmap
from .mutations import AMINO_ACIDS_20
from .scoring import (
    _TOKENIZER,
    DEFAULT_BATCH_SIZE,
    DEFAULT_WINDOW,
    _Jobs,
    _residue_positions,
    check_length,
    warn_nonstandard,
)
from .store import sequence_hash

SCAN_METHODS = ("masked_marginal", "wt_marginal")
_AA_IDS = np.array([_TOKENIZER.token_to_id[a] for a in AMINO_ACIDS_20])


@dataclasses.dataclass
class Scan:
    """One protein's scan. ``positions``: 0-based indices of the residues scanned (gaps and
    chain breaks are skipped); ``scores`` (n, 20) float32 in ``AMINO_ACIDS_20`` columns;
    ``entropy`` (n,) float32 nats; ``offset`` numbers the first residue."""

    sequence: str
    method: str
    positions: np.ndarray
    scores: np.ndarray
    entropy: np.ndarray
    offset: int = 1
    passes: int = 0
    name: str = "sequence"

    @property
    def wild_type(self) -> str:
        return "".join(self.sequence[p] for p in self.positions)

    def variants(self) -> list[tuple[int, str, str, float, float]]:
        """(position in the offset numbering, wt, mut, score, entropy) for every substitution."""
        out = []
        for k, p in enumerate(self.positions):
            wt = self.sequence[p]
            for j, aa in enumerate(AMINO_ACIDS_20):
                if aa != wt:
                    out.append((int(p) + self.offset, wt, aa, float(self.scores[k, j]), float(self.entropy[k])))
        return out

    def write(self, out_dir: str | Path, plot: bool = True, per_row: int = 100) -> dict[str, Path]:
        """Write ``<name>_scan.csv`` (tidy: one row per variant), ``<name>_matrix.npy`` (n x 20
        float32), ``<name>_matrix.csv`` (position, wt, 20 columns, entropy) and, with ``plot``,
        ``<name>_heatmap.png`` into the scan folder ``out_dir`` (``outputs.OutputFolder``: a new or
        empty folder, or one esmc-mlx made for scans). The files are written aside and go into
        place together, or none of them."""
        stem = safe_name(self.name)
        names = {"csv": f"{stem}_scan.csv", "npy": f"{stem}_matrix.npy", "matrix_csv": f"{stem}_matrix.csv"}
        if plot:
            names["png"] = f"{stem}_heatmap.png"
        with guard(out_dir, "scan", "folder") as folder, folder.files() as staged:
            with staged.open(names["csv"], "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["mutant", "position", "wt", "mut", self.method, "entropy"])
                for pos, wt, mut, score, ent in self.variants():
                    w.writerow([f"{wt}{pos}{mut}", pos, wt, mut, f"{score:.6g}", f"{ent:.6g}"])
            with staged.open(names["npy"], "wb") as f:
                np.save(f, self.scores.astype(np.float32))
            with staged.open(names["matrix_csv"], "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["position", "wt", *AMINO_ACIDS_20, "entropy"])
                for k, p in enumerate(self.positions):
                    w.writerow(
                        [
                            int(p) + self.offset,
                            self.sequence[p],
                            *(f"{v:.6g}" for v in self.scores[k]),
                            f"{self.entropy[k]:.6g}",
                        ]
                    )
            if plot:
                plot_heatmap(self, staged.path(names["png"]), per_row=per_row)
        return {key: Path(out_dir) / name for key, name in names.items()}


class ScanManifest:
    """``OUT/scan-manifest.json``: for each protein written into OUT (by file stem), the sha1 of
    its sequence, the settings that shape its files (method, window, offset, model, plot) and
    each file's size. A rerun skips a protein whose entry matches and whose files are all there
    at those sizes: a FASTA of many proteins stopped half-way resumes where it stopped, and
    nothing is computed twice. A protein's files go into place before the entry that names them,
    so an entry never vouches for a file that was cut short. Only names the folder's marker
    records as esmc-mlx's are read from the manifest (a planted one names nothing else)."""

    NAME = "scan-manifest.json"
    FORMAT = "esmc-mlx-scan/1"
    TOOL = "scan"  # the command that writes it (a subclass's manifest is another command's)

    def __init__(self, folder: OutputFolder):
        self.folder = folder
        self.path = folder.path / self.NAME
        self.proteins: dict[str, dict] = {}
        if not self.path.exists():
            return
        if not folder.owns(self.NAME):
            raise JobError(f"{self.path} was not written by esmc-mlx scan; use another output directory")
        try:
            data = read_json(self.path, JobError)
        except JobError as e:
            raise JobError(f"{e}; remove it to scan everything again") from None
        if (
            not isinstance(data, dict)
            or data.get("format") != self.FORMAT
            or not isinstance(data.get("proteins"), dict)
        ):
            raise JobError(f"{self.path} was not written by esmc-mlx {self.TOOL}; use another output directory")
        self.proteins = data["proteins"]

    def _files(self, stem: str) -> dict[str, int]:
        """The files ``stem``'s entry names that are esmc-mlx's in this folder, with their sizes."""
        entry = self.proteins.get(stem)
        files = entry.get("files") if isinstance(entry, dict) else None
        if not isinstance(files, dict):
            return {}
        return {n: size for n, size in files.items() if self.folder.owns(n) and isinstance(size, int)}

    def done(self, stem: str, settings: dict) -> bool:
        """Whether OUT already holds ``stem``'s files, made with ``settings``."""
        entry = self.proteins.get(stem)
        if not isinstance(entry, dict) or entry.get("settings") != settings or not isinstance(entry.get("files"), dict):
            return False
        files = self._files(stem)
        folder = self.folder.path
        return len(files) == len(entry["files"]) and all(
            (folder / name).is_file() and not (folder / name).is_symlink() and (folder / name).stat().st_size == size
            for name, size in files.items()
        )

    def record(self, stem: str, settings: dict, paths: dict[str, Path], **extra) -> None:
        """Enter ``stem``'s new files (and ``extra``, kept in its entry as given). A file of its
        previous entry that this run did not write (the heatmap of a scan now run with --no-plot)
        would describe the old scores: it is removed if esmc-mlx wrote it in this folder and it is
        still that file (same size)."""
        files = {p.name: p.stat().st_size for p in paths.values()}
        for name, size in self._files(stem).items():
            stale = self.folder.path / name
            if name not in files and stale.is_file() and not stale.is_symlink() and stale.stat().st_size == size:
                stale.unlink()
        self.proteins[stem] = {"settings": settings, "files": files, **extra}
        with self.folder.file(self.NAME) as f:
            json.dump({"format": self.FORMAT, "proteins": self.proteins}, f, indent=1, sort_keys=True)
        self.folder.commit()


def scan_settings(
    sequence: str,
    *,
    method: str,
    window: int | None,
    offset: int,
    model: str,
    plot: bool,
    per_row: int,
    keep_nonstandard: bool = False,
) -> dict:
    """What a scan's files depend on (the batch size only changes how the work is split). An
    entry without ``keep_nonstandard`` predates the residue policy and the shared wt-marginal
    windows: it never matches, so such a protein is scanned again."""
    return {
        "sequence_sha1": sequence_hash(sequence),
        "method": method,
        "window": window,
        "offset": offset,
        "keep_nonstandard": keep_nonstandard,
        "model": model,
        "plot": plot,
        "per_row": per_row if plot else None,
    }


def safe_name(name: str) -> str:
    """A FASTA ID as a file name stem (``sp|P69905|HBA_HUMAN`` -> ``sp_P69905_HBA_HUMAN``, ``αβ`` ->
    ``αβ``: letters of any script stay, so ``--name αβ`` does not become ``sequence``)."""
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "sequence"  # \w: letters of any script stay


def scan(
    model: ESMC,
    sequence: str,
    *,
    method: str = "masked_marginal",
    batch_size: int = DEFAULT_BATCH_SIZE,
    window: int | None = DEFAULT_WINDOW,
    offset: int = 1,
    name: str = "sequence",
    keep_nonstandard: bool = False,
    group=None,
    progress: bool = False,
    desc: str = "scan",
) -> Scan:
    """Score all 19 substitutions at every residue of ``sequence`` (``desc``: the progress
    bar's label).

    ``masked_marginal``: one masked copy per residue (``batch_size`` copies a pass, so an
    L-residue protein costs ceil(L / B) passes), each copy's row giving all 19 scores and the
    entropy; longer than ``window`` residues, each copy is the window centred on its residue.
    ``wt_marginal``: one unmasked pass; longer than ``window``, the few overlapping windows of
    ``scoring.unmasked_window`` (each residue read from the one whose centre is nearest).
    Non-standard residues (X B Z U O) are left out of the scan, with a warning, unless
    ``keep_nonstandard``; the model still reads them as context.
    Under ``mlx.launch`` pass ``group=mx.distributed.init()``: ranks split the passes, every
    rank gets the whole scan.
    """
    if method not in SCAN_METHODS:
        raise ScoringError(f"unknown scan method {method!r}; choose from {', '.join(SCAN_METHODS)}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):  # "1" failed in write, 1.5 wrote M1.5A
        raise ScoringError(f"offset must be an integer (the number of the first residue), got {offset!r}")
    sequence = check_sequence(sequence, name, label="sequence")
    check_length(sequence, window, name)
    skip = (
        [] if keep_nonstandard else warn_nonstandard(sequence, name, "their positions are left out of the scan", offset)
    )
    positions = _residue_positions(sequence, name, skip)
    jobs = _Jobs()
    for p in positions:
        jobs.site(sequence, [p], masked=method == "masked_marginal", window=window)
    rows, passes = jobs.run(model, batch_size=batch_size, world=World.of(group), progress=progress, desc=desc)
    logp = np.concatenate(rows).astype(np.float64)  # (n, vocab), row k <-> positions[k]
    wt_ids = np.array([_TOKENIZER.token_to_id[sequence[p]] for p in positions])
    scores = logp[:, _AA_IDS] - logp[np.arange(len(positions)), wt_ids][:, None]
    aa = logp[:, _AA_IDS]
    aa = aa - np.logaddexp.reduce(aa, axis=1, keepdims=True)  # renormalised over the 20
    entropy = -(np.exp(aa) * aa).sum(axis=1)
    return Scan(
        sequence, method, positions, scores.astype(np.float32), entropy.astype(np.float32), offset, passes, name
    )
