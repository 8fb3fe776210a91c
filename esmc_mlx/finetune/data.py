"""Labeled sequences for fine-tuning: the CSV reader, the three tasks' labels, and the inputs
``predict`` reads (one sequence, a FASTA file, a CSV).

Every error is one line naming the file, the line and the column at fault: a missing column,
an invalid sequence, a label that is not a number (regression), a per-residue label whose
length is not the sequence's, a training set with one class only.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import JobError, SequenceError
from ..tasks.fasta import read_fasta, read_sequence_option
from ..vocab import check_sequence

TASKS = ("classification", "regression", "per-residue")
# A per-residue label given as positions: 1-based residue numbers separated by commas,
# semicolons or spaces ("3,17,18"); those residues are class "1", the others "0".
_POSITIONS = re.compile(r"\s*\d+(?:\s*[,; ]\s*\d+)*\s*|\s*")
_SEPARATOR = re.compile(r"[,; ]")


@dataclasses.dataclass
class Table:
    """A CSV's rows: every column by name, and where each row is (``file, line N: ``)."""

    path: Path
    columns: list[str]
    rows: list[dict]
    where: list[str]

    def column(self, name: str, option: str) -> list[str]:
        if name not in self.columns:
            raise JobError(
                f"{self.path}: no {name!r} column (columns: {', '.join(self.columns) or 'none'}); "
                f"name the column with {option}"
            )
        return [(row.get(name) or "").strip() for row in self.rows]


def read_table(path: str | Path) -> Table:
    """The rows of a CSV file (a byte-order mark and CRLF line ends are read; rows of empty
    cells, which spreadsheets leave below the data, are skipped). JobError when it cannot be
    read or holds no rows."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            columns = [c for c in reader.fieldnames or [] if c is not None]
            rows, where = [], []
            for row in reader:
                if not any(isinstance(v, str) and v.strip() for v in row.values()):
                    continue
                rows.append(row)
                where.append(f"{path}, line {reader.line_num}: ")
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise JobError(f"{path}: cannot read CSV ({e})") from None
    if not rows:
        raise JobError(f"{path}: no rows")
    return Table(path, columns, rows, where)


def read_sequences(table: Table, column: str) -> list[str]:
    """The checked, upper-cased sequences of ``column``. Chain breaks are refused: a training
    batch has no chain ids."""
    sequences = []
    for text, where in zip(table.column(column, "--sequence-column"), table.where):
        sequence = check_sequence(text, where=where, label=f"{column} column")
        if "|" in sequence:
            raise SequenceError(f"{where}{column} column: chain breaks ('|') are not supported in fine-tuning")
        sequences.append(sequence)
    return sequences


@dataclasses.dataclass
class Labels:
    """What the model's outputs mean: the task, the classes (classification, per-residue) or the
    scaling of the targets (regression: the model learns ``(y - mean) / std``)."""

    task: str
    classes: list[str] | None = None
    mean: float | None = None
    std: float | None = None
    positions: bool = False  # per-residue labels given as positions (classes "0" and "1")

    @property
    def outputs(self) -> int:
        return 1 if self.task == "regression" else len(self.classes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Labels:
        return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})

    def encode(self, texts: Sequence[str], sequences: Sequence[str], table: Table, column: str) -> list:
        """Each row's target: a class index, a scaled float, or an int array (one class per residue)."""
        if self.task == "regression":
            values = _numbers(texts, table.where, column)
            with np.errstate(over="ignore"):
                scaled = ((values - self.mean) / self.std).astype(np.float32)  # what training reads
            far = np.flatnonzero(~np.isfinite(scaled))
            if len(far):
                raise JobError(
                    f"{table.where[far[0]]}{column} column: {values[far[0]]:g} is too far from the training labels "
                    f"(mean {self.mean:g}, standard deviation {self.std:g}) to scale; rescale the labels"
                )
            return list((values - self.mean) / self.std)
        index = {c: i for i, c in enumerate(self.classes)}
        targets = []
        for text, sequence, where in zip(texts, sequences, table.where):
            if self.task == "classification":
                if text not in index:
                    raise JobError(f"{where}{column} column: label {text!r} is not one of the training classes")
                targets.append(index[text])
                continue
            residues = _residue_labels(text, sequence, self.positions, where, column)
            unknown = sorted(set(residues) - set(index))
            if unknown:
                raise JobError(f"{where}{column} column: label {unknown[0]!r} is not one of the training classes")
            targets.append(np.array([index[c] for c in residues], dtype=np.int32))
        return targets


def labels_from_training(
    task: str, texts: Sequence[str], sequences: Sequence[str], table: Table, column: str
) -> Labels:
    """The label space the training CSV defines. JobError for an unknown task, an empty label,
    a non-numeric or constant regression target, or a single class."""
    if task not in TASKS:
        raise JobError(f"--task {task!r}: choose one of {', '.join(TASKS)}")
    for text, where in zip(texts, table.where):
        if not text and task != "per-residue":  # per-residue positions: empty = no positive residue
            raise JobError(f"{where}{column} column: empty label")
    if task == "regression":
        values = _numbers(texts, table.where, column)
        with np.errstate(over="ignore", invalid="ignore"):
            mean, std = float(values.mean()), float(values.std())
        if not (math.isfinite(mean) and math.isfinite(std)):
            low, high = int(values.argmin()), int(values.argmax())
            raise JobError(
                f"{table.path}: the {column} column spans {values[low]:g} ({table.where[low].rstrip(': ')}) to "
                f"{values[high]:g} ({table.where[high].rstrip(': ')}), too wide a spread to scale in float64 "
                "(its mean or standard deviation overflows); rescale the labels (divide them, or take their log)"
            )
        if not std > 0:
            raise JobError(
                f"{table.path}: every row of the {column} column is {values[0]:g}; regression needs targets that vary"
            )
        return Labels(task, mean=mean, std=std)
    if task == "classification":
        classes = sorted(set(texts))
        if len(classes) < 2:
            raise JobError(
                f"{table.path}: every row of the {column} column is {classes[0]!r}; classification needs at least two classes"
            )
        return Labels(task, classes=classes)
    positions = _are_positions(texts, sequences)
    residues = [_residue_labels(t, s, positions, w, column) for t, s, w in zip(texts, sequences, table.where)]
    classes = ["0", "1"] if positions else sorted(set("".join(residues)))
    if len(set("".join(residues))) < 2:
        raise JobError(
            f"{table.path}: every residue of the {column} column has the label {residues[0][0]!r}; "
            "per-residue classification needs at least two classes"
        )
    return Labels(task, classes=classes, positions=positions)


def _numbers(texts: Sequence[str], where: Sequence[str], column: str) -> np.ndarray:
    values = []
    for text, at in zip(texts, where):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise JobError(f"{at}{column} column: {text!r} is not a number (regression needs numeric labels)")
        values.append(value)
    return np.array(values, dtype=np.float64)


def _are_positions(texts: Sequence[str], sequences: Sequence[str]) -> bool:
    """Whether a per-residue column holds positions ("3,17"), not one label per residue:
    every label is integers and separators, and one has a separator or none is as long as its
    sequence (a label string of digits is as long as its sequence)."""
    if not all(_POSITIONS.fullmatch(t) for t in texts):
        return False
    return any(_SEPARATOR.search(t.strip()) for t in texts) or all(len(t) != len(s) for t, s in zip(texts, sequences))


def _residue_labels(text: str, sequence: str, positions: bool, where: str, column: str) -> str:
    """One label character per residue."""
    if not positions:
        if len(text) != len(sequence):
            raise JobError(
                f"{where}{column} column: the label has {len(text)} characters and the sequence {len(sequence)} "
                "residues; a per-residue label needs one character per residue (or a list of positions)"
            )
        return text
    marks = ["0"] * len(sequence)
    for token in _SEPARATOR.split(text.strip()) if text.strip() else []:
        if not token:
            continue
        position = int(token)
        if not 1 <= position <= len(sequence):
            raise JobError(
                f"{where}{column} column: position {position} is outside the sequence (residues 1..{len(sequence)})"
            )
        marks[position - 1] = "1"
    return "".join(marks)


@dataclasses.dataclass
class LabeledSet:
    """Sequences and their encoded targets, with where each came from."""

    sequences: list[str]
    targets: list
    table: Table


def read_labeled(
    path: str | Path, task: str, sequence_column: str, label_column: str, labels: Labels | None = None
) -> tuple[LabeledSet, Labels]:
    """A training (``labels`` None: they are defined here) or validation CSV, checked whole."""
    table = read_table(path)
    sequences = read_sequences(table, sequence_column)
    texts = table.column(label_column, "--label-column")
    if labels is None:
        labels = labels_from_training(task, texts, sequences, table, label_column)
    elif task != "per-residue":
        for text, where in zip(texts, table.where):
            if not text:
                raise JobError(f"{where}{label_column} column: empty label")
    return LabeledSet(sequences, labels.encode(texts, sequences, table, label_column), table), labels


def prediction_inputs(
    sequence: str | None, fasta: str | Path | None, csv_path: str | Path | None, sequence_column: str
) -> tuple[list[str], list[str], Table | None]:
    """(ids, sequences, the CSV's table or None) from exactly one of the three inputs."""
    given = [x for x in (sequence, fasta, csv_path) if x is not None]
    if len(given) != 1:
        raise JobError("give exactly one of --sequence, --fasta and --csv")
    if sequence is not None:  # a protein, or a FASTA file of one: as every command's --sequence
        ident, checked = read_sequence_option(sequence)
        return [ident or "sequence"], [checked], None
    if fasta is not None:
        records = read_fasta(fasta)
        return [r.id for r in records], [r.sequence for r in records], None
    table = read_table(csv_path)
    sequences = read_sequences(table, sequence_column)
    return [str(i + 1) for i in range(len(sequences))], sequences, table
