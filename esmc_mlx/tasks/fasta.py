"""A small FASTA reader whose errors name the file, the record and the position.

A record's ID is its header up to the first whitespace (``>sp|P69905|HBA_HUMAN Hemoglobin``
-> ``sp|P69905|HBA_HUMAN``), as in Biopython and UniProt tools. Lines are cut and decoded by
``readers.text_lines`` (only ``\n`` and ``\r`` end a line); sequence lines are joined, ASCII
spaces and tabs are dropped, lower case is read as upper case and one trailing ``*`` (a stop
codon from translated genomes) is removed, as ``vocab.check_sequence`` does for every sequence.
Anything else outside ESMC's residue alphabet is an
error, as are empty records, text before the first header and IDs seen twice.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import FastaError
from ..readers import open_binary, split_lines, text_lines
from ..vocab import check_sequence

BLANK = " \t\v\f\r\n"  # the whitespace a FASTA line may hold: ASCII only (U+2028, U+0085 are not)
_BLANKS = re.compile(f"[{re.escape(BLANK)}]+")


@dataclasses.dataclass(frozen=True)
class Record:
    id: str
    sequence: str
    description: str = ""
    line: int = 0  # 1-based line of the header


class _Parser:
    """Line-by-line FASTA state machine shared by ``parse_fasta`` and ``iter_fasta``."""

    def __init__(self, source: str):
        self.source = source
        self.header: str | None = None
        self.header_line = 0
        self.chunks: list[str] = []
        self.seen: dict[str, int] = {}

    def line(self, number: int, line: str) -> Record | None:
        line = line.strip(BLANK)
        if not line or line.startswith(";"):
            return None
        if line.startswith(">"):
            done = self.finish()
            self.header, self.header_line, self.chunks = line[1:].replace("\t", " ").strip(BLANK), number, []
            return done
        if self.header is None:
            raise FastaError(f"{self.source}, line {number}: text before the first '>' header (is this FASTA?)")
        self.chunks.append(_BLANKS.sub("", line))
        return None

    def finish(self) -> Record | None:
        if self.header is None:
            return None
        source, header_line = self.source, self.header_line
        ident, _, description = self.header.partition(" ")
        if not ident:
            raise FastaError(f"{source}, line {header_line}: record header has no ID")
        sequence = "".join(self.chunks)
        self.chunks = []
        if not sequence:
            raise FastaError(f"{source}, line {header_line}: record {ident!r} has no sequence")
        if ident in self.seen:
            raise FastaError(
                f"{source}, line {header_line}: duplicate ID {ident!r} (first seen on line {self.seen[ident]})"
            )
        self.seen[ident] = header_line
        sequence = check_sequence(sequence, ident, f"{source}, ")
        return Record(ident, sequence, description.strip(BLANK), header_line)


def _records(lines: Iterable[str], source: str) -> Iterator[Record]:
    parser, count = _Parser(source), 0
    for number, line in enumerate(lines, start=1):
        record = parser.line(number, line)
        if record is not None:
            count += 1
            yield record
    record = parser.finish()
    if record is not None:
        count += 1
        yield record
    if not count:
        raise FastaError(f"{source}: no FASTA records")


def parse_fasta(text: str, source: str = "<string>") -> list[Record]:
    """Parse FASTA text; raise FastaError for anything that is not clean protein FASTA."""
    if not isinstance(text, str):
        raise FastaError(f"{source}: expected FASTA text as a string, got {type(text).__name__}")
    return list(_records(split_lines(text), source))


def iter_fasta(path: str | Path) -> Iterator[Record]:
    """Records of a FASTA file one at a time, read as a stream (memory holds one record and the
    IDs seen, to refuse duplicates): plain or gzip-compressed whatever its name (by gzip's magic
    number), with or without a byte-order mark. Raises FastaError; a missing file too."""
    path = Path(path)
    try:
        stream = open_binary(path)
    except OSError as e:
        raise FastaError(f"{path}: cannot read FASTA ({e})") from None
    with stream:
        try:
            yield from _records(text_lines(stream, path, FastaError), str(path))
        except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise FastaError(f"{path}: cannot read FASTA ({e})") from None


def read_fasta(path: str | Path) -> list[Record]:
    """Read a whole FASTA file into a list (see ``iter_fasta``). Raises FastaError."""
    return list(iter_fasta(path))


# --- a --sequence option: a protein, or a FASTA file of one record ------------------------------------
# A value that holds a path separator, starts with '~' or ends in a file extension ('.' then 1-10
# letters or digits: try.fsta, wt3.fa, x.fa.gz) is a file name, never a protein: "TRY.FSTA" would
# read as one ('.' is a gap, F S T A residues). A sequence with '.' gaps comes in a FASTA file.
_EXTENSION = re.compile(r".*[^.\s]\.[A-Za-z0-9]{1,10}")
SEQUENCE_OPTION = (
    "A protein sequence, or a FASTA file holding one record. A value naming an existing file is read "
    "as FASTA; one holding '/', starting with '~' or ending in a file extension (.fasta, .fa.gz, .txt) "
    "is a file name, and an error when no such file exists."
)


def looks_like_path(text: str) -> bool:
    """Whether ``text`` reads as a file name rather than a protein (see ``SEQUENCE_OPTION``)."""
    text = text.strip()
    return "/" in text or "\\" in text or text.startswith("~") or _EXTENSION.fullmatch(text) is not None


def _names_input(path: Path) -> bool:
    """Whether ``path`` names something to read: a file, or a pipe (``<(zcat wt.fa.gz)``); False
    for a directory, and for text no file system accepts as a name (a protein of more than ~255
    residues given literally raises OSError "File name too long")."""
    try:
        return path.exists() and not path.is_dir()
    except (OSError, ValueError):
        return False


def read_sequence_option(text: str, option: str = "--sequence") -> tuple[str | None, str]:
    """What a ``--sequence`` option gives, the same for every command (``SEQUENCE_OPTION``):
    (the record's FASTA ID, its sequence) for a FASTA file holding one record; (None, the
    sequence checked) for a protein given literally. FastaError for a value that reads as a
    file name and names no file (or a folder), a file of several records; SequenceError for a
    sequence that is not a protein's."""
    if not isinstance(text, str):
        raise FastaError(f"{option}: expected a sequence or a FASTA file name, got {type(text).__name__}")
    path = Path(text).expanduser()
    if _names_input(path):
        records = read_fasta(path)
        if len(records) != 1:
            raise FastaError(f"{path}: holds {len(records)} records; {option} takes a file of one")
        return records[0].id, records[0].sequence
    try:
        folder = bool(text.strip()) and path.is_dir()
    except (OSError, ValueError):  # no file system takes it as a name: a long protein
        folder = False
    if folder:
        raise FastaError(f"{option} {text}: a folder, not a FASTA file or a protein sequence")
    if looks_like_path(text):
        raise FastaError(
            f"{option} {text}: no such file (a value holding '/' or ending in a file extension is a file name; "
            "give a protein sequence, or a FASTA file that exists)"
        )
    return None, check_sequence(text.strip(), option, label="sequence")
