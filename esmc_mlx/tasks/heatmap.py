"""The scan heatmap: positions along x, the 20 amino acids along y, wrapped into rows of
``per_row`` positions so that 30 to 2,000 residues stay readable (one row per 100 positions by
default: a 2,000-residue protein is 20 rows of the same width). Needs matplotlib
(``esmc-mlx[plot]``), imported only here and only when a heatmap is drawn.

The figure's size is fixed by the scan's length alone (``heatmap_size``), in inches at 100 dpi:
each position is a 0.14-inch column, each panel 20 cells high.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import JobError, install_hint
from ..outputs import atomic_file
from .mutations import AMINO_ACIDS_20

DPI = 100
CELL = 0.14  # inches per cell
LEFT, RIGHT, TOP, GAP, BOTTOM = 0.6, 1.1, 0.5, 0.75, 0.2  # inches
PANEL = 20 * CELL


def heatmap_size(n_positions: int, per_row: int = 100) -> tuple[int, int]:
    """(width, height) in pixels of the heatmap of ``n_positions`` residues."""
    width, height = _inches(n_positions, per_row)
    return round(width * DPI), round(height * DPI)


def _inches(n: int, per_row: int) -> tuple[float, float]:
    rows = math.ceil(n / per_row)
    return LEFT + min(n, per_row) * CELL + RIGHT, TOP + rows * (PANEL + GAP) + BOTTOM


def check_plotting() -> None:
    """Raise JobError now (before any model runs) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise JobError(f"drawing the heatmap needs matplotlib: {install_hint('plot')}, or pass --no-plot") from None


def colour_limit(scores: np.ndarray, wild_type: str) -> tuple[float, str]:
    """The symmetric colour limit (the 99th percentile of |score| over the rows of the 20
    standard residues: a kept X or B row, scored against no real residue, would stretch the
    scale and wash the real positions out) and matplotlib's ``extend`` for the colour bar:
    which ends have scores beyond the limit, drawn clipped."""
    standard = np.array([c in AMINO_ACIDS_20 for c in wild_type], dtype=bool)
    basis = scores[standard] if standard.any() else scores
    limit = float(np.percentile(np.abs(basis), 99)) if basis.size else 0.0
    limit = limit or 1.0
    low, high = (bool((scores < -limit).any()), bool((scores > limit).any())) if scores.size else (False, False)
    return limit, {(True, True): "both", (True, False): "min", (False, True): "max"}.get((low, high), "neither")


def plot_heatmap(scan, path: str | Path, per_row: int = 100) -> Path:
    """Draw ``scan`` (a ``tasks.scan.Scan``) to a PNG: blue above 0 (more likely than the wild
    type), red below, the colour scale from ``colour_limit`` (arrows on the colour bar mark the
    ends where scores go beyond it); a black
    dot marks each wild-type residue; wild-type letters along the top of each row and residue
    numbers (``scan.offset`` numbering) every 10 positions along the bottom."""
    check_plotting()
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    if per_row < 10:
        raise JobError(f"per_row must be at least 10 positions, got {per_row}")
    path = Path(path)
    n = len(scan.positions)
    width, height = _inches(n, per_row)
    fig = Figure(figsize=(width, height), dpi=DPI)
    scores = np.asarray(scan.scores, dtype=np.float32)
    limit, extend = colour_limit(scores, scan.wild_type)
    norm = Normalize(-limit, limit)
    wt = scan.wild_type
    numbers = np.asarray(scan.positions) + scan.offset
    image = None
    for r in range(math.ceil(n / per_row)):
        lo, hi = r * per_row, min(n, (r + 1) * per_row)
        bottom = height - TOP - r * (PANEL + GAP) - PANEL
        ax = fig.add_axes((LEFT / width, bottom / height, (hi - lo) * CELL / width, PANEL / height))
        image = ax.imshow(scores[lo:hi].T, cmap="RdBu", norm=norm, aspect="auto", interpolation="nearest")
        cols = [(k - lo, AMINO_ACIDS_20.index(wt[k])) for k in range(lo, hi) if wt[k] in AMINO_ACIDS_20]
        if cols:
            x, y = zip(*cols)
            ax.scatter(x, y, s=4, c="black", marker="o", linewidths=0)
        ax.set_yticks(range(20), list(AMINO_ACIDS_20), fontsize=5)
        ticks = [k - lo for k in range(lo, hi) if numbers[k] % 10 == 0]
        ax.set_xticks(ticks, [str(numbers[lo + t]) for t in ticks], fontsize=6)
        top = ax.secondary_xaxis("top")
        top.set_xticks(range(hi - lo), list(wt[lo:hi]), fontsize=5)
        top.tick_params(length=0, pad=1)
    cax = fig.add_axes(((width - RIGHT + 0.25) / width, (height - TOP - PANEL) / height, 0.12 / width, PANEL / height))
    bar = fig.colorbar(image, cax=cax, extend=extend)
    bar.set_label(f"{scan.method.replace('_', '-')}\nlog p(mut) - log p(wt)", fontsize=6)
    bar.ax.tick_params(labelsize=6)
    fig.text(
        LEFT / width,
        1 - 0.15 / height,
        f"{scan.name}: {n} residues, {scan.method.replace('_', '-')}",
        fontsize=8,
        va="top",
    )
    with atomic_file(path, "wb") as f:
        fig.savefig(f, dpi=DPI, format="png")
    return path
