"""``esmc-mlx predict``: an adapter's predictions for one sequence, a FASTA file or a CSV,
written as a CSV through the output guard (``outputs.guard``: checked before the model loads,
replaced whole)."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

from ..outputs import guarded, held
from .adapter import found_inputs, load_adapter
from .data import prediction_inputs


@dataclasses.dataclass
class PredictSummary:
    out: Path
    count: int
    task: str


@guarded(
    "out",
    "predictions",
    "file",
    inputs=("adapter", "fasta", "csv_path", "sequence", "base"),
    found=lambda arguments: found_inputs(arguments["adapter"], arguments["base"]),
)
def predict_csv(
    adapter: str | Path,
    out: str | Path,
    *,
    sequence: str | None = None,
    fasta: str | Path | None = None,
    csv_path: str | Path | None = None,
    sequence_column: str = "sequence",
    batch_tokens: int = 4096,
    base: str | Path | None = None,
    force: bool = False,
) -> PredictSummary:
    """Predict with the adapter ``adapter`` (directory or Hub repo) for exactly one of
    ``sequence``, ``fasta`` (one row per record, ``id`` its ID) and ``csv_path`` (its rows and
    columns kept), and write ``out``: the CSV with a ``prediction`` column, and for
    classification one ``p_CLASS`` column per class. Inputs are checked before the model loads;
    the longest record and a batch against the memory before the first forward; an existing
    ``out`` esmc-mlx did not write is replaced only with ``force``. Raises JobError,
    SequenceError, ScoringError (memory), ConfigError (a damaged adapter), HubError, OutputError."""
    ids, sequences, table = prediction_inputs(sequence, fasta, csv_path, sequence_column)
    if table is not None:
        names = [where.rstrip(": ") for where in table.where]
    elif fasta is not None:
        names = [f"{fasta}: record {i!r}" for i in ids]
    else:
        names = ["--sequence"]
    model = load_adapter(adapter, base)
    result = model.predict(sequences, batch_tokens=batch_tokens, names=names)
    extra = [f"p_{c}" for c in result.classes] if result.probabilities is not None else []
    if table is not None:
        rows = [dict(r) for r in table.rows]
        header = [c for c in table.columns if c not in ("prediction", *extra)] + ["prediction", *extra]
    else:
        rows = [{"id": i, "sequence": s} for i, s in zip(ids, sequences)]
        header = ["id", "sequence", "prediction", *extra]
    for k, row in enumerate(rows):
        value = result.values[k]
        row["prediction"] = f"{value:.8g}" if isinstance(value, float) else value
        if result.probabilities is not None:
            row.update({name: f"{p:.6g}" for name, p in zip(extra, result.probabilities[k])})
    with held(out).open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return PredictSummary(Path(out), len(rows), result.task)
