"""A small FASTA reader whose errors name the file, the record and the position.

A record's ID is its header up to the first whitespace (``>sp|P69905|HBA_HUMAN Hemoglobin``
-> ``sp|P69905|HBA_HUMAN``), as in Biopython and UniProt tools. Sequence lines are joined,
whitespace is dropped, lower case is read as upper case and one trailing ``*`` (a stop codon
from translated genomes) is removed. Anything else outside ESMC's residue alphabet is an
error, as are empty records, text before the first header and IDs seen twice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import FastaError
from ..vocab import check_sequence


@dataclasses.dataclass(frozen=True)
class Record:
    id: str
    sequence: str
    description: str = ""
    line: int = 0  # 1-based line of the header


def parse_fasta(text: str, source: str = "<string>") -> list[Record]:
    """Parse FASTA text; raise FastaError for anything that is not clean protein FASTA."""
    records: list[Record] = []
    header: str | None = None
    header_line = 0
    chunks: list[str] = []
    seen: dict[str, int] = {}

    def finish():
        if header is None:
            return
        ident, _, description = header.partition(" ")
        ident = ident.strip()
        if not ident:
            raise FastaError(f"{source}, line {header_line}: record header has no ID")
        sequence = "".join(chunks)
        if sequence.endswith("*"):
            sequence = sequence[:-1]
        if not sequence:
            raise FastaError(f"{source}, line {header_line}: record {ident!r} has no sequence")
        if ident in seen:
            raise FastaError(
                f"{source}, line {header_line}: duplicate ID {ident!r} (first seen on line {seen[ident]})"
            )
        seen[ident] = header_line
        sequence = check_sequence(sequence, ident, f"{source}, ")
        records.append(Record(ident, sequence, description.strip(), header_line))

    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith(";"):
            continue
        if line.startswith(">"):
            finish()
            header, header_line, chunks = line[1:].strip().replace("\t", " "), number, []
        elif header is None:
            raise FastaError(f"{source}, line {number}: text before the first '>' header (is this FASTA?)")
        else:
            chunks.append("".join(line.split()))
    finish()
    if not records:
        raise FastaError(f"{source}: no FASTA records")
    return records


def read_fasta(path: str | Path) -> list[Record]:
    """Read a FASTA file (plain or .gz). Raises FastaError; a missing file too."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            import gzip

            text = gzip.decompress(path.read_bytes()).decode()
        else:
            text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise FastaError(f"{path}: cannot read FASTA ({e})") from None
    return parse_fasta(text, str(path))
