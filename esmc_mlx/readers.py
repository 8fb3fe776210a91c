"""The two readers every input goes through (docs/reliability.md, "Inputs are read as they are").

* ``read_json`` / ``parse_json``: a JSON document (a config, an index, a manifest, a report, a
  safetensors header) whose size and nesting are checked before anything is built; every
  failure is one error naming the file (and ``json``'s own position).
* ``text_lines``: the lines of a text file (FASTA, CSV) with their bytes as they are: only
  ``\\n``, ``\\r`` and ``\\r\\n`` end a line (``str.splitlines`` also splits at U+2028 and at
  byte 0x85 read as Latin-1, and made words of a description into residues); a UTF-8
  byte-order mark is dropped; each line is UTF-8, else the Windows code page (cp1252), else
  Latin-1; a NUL byte means a binary file. ``open_binary`` reads gzip by its magic number.

Hand-written because neither ``json`` nor ``io`` bounds what it builds: ``json.loads`` of a
deeply nested document ends in RecursionError, and ``io``'s line reading gives no control over
which characters end a line once the bytes are decoded.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .errors import EsmcMlxError

MAX_JSON_BYTES = 100_000_000  # the safetensors library's own bound on a header
MAX_JSON_DEPTH = 64  # esmc-mlx's own files nest 4 deep; a config of transformers' 3
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(data: bytes) -> int:
    """How deep brackets nest in the JSON text ``data`` (strings skipped), without parsing it."""
    codes = np.frombuffer(_STRING.sub(b'""', data), np.uint8)
    if not codes.size:
        return 0
    steps = np.isin(codes, _OPEN).astype(np.int64) - np.isin(codes, _CLOSE)
    return int(np.cumsum(steps).max(initial=0))


def parse_json(data: bytes | str, what: str | Path, error: type[EsmcMlxError], max_depth: int = MAX_JSON_DEPTH):
    """``data`` parsed as JSON; ``error("{what}: ...")`` for text nested deeper than
    ``max_depth`` (checked first), text that is not UTF-8, or not JSON (a number of more than
    4,300 digits included: Python refuses to build it)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    depth = json_depth(raw)
    if depth > max_depth:
        raise error(f"{what}: JSON nested {depth} levels deep (at most {max_depth} are read); the file is damaged")
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise error(f"{what}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except ValueError as e:  # JSONDecodeError, and int() refusing a huge number
        raise error(f"{what}: not valid JSON ({e})") from None
    except RecursionError:  # (the depth check above makes this unreachable for esmc-mlx's bound)
        raise error(f"{what}: JSON nested too deep to read") from None


def read_json(
    path: str | Path, error: type[EsmcMlxError], max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
):
    """The JSON file ``path``, its size and nesting checked before it is parsed; ``error``
    naming the file for a missing, unreadable, oversized, non-UTF-8 or malformed one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise error(f"{path}: larger than {max_bytes:,} bytes, more than any esmc-mlx or model file holds")
    return parse_json(data, path, error, max_depth)


# --- text --------------------------------------------------------------------------------------------
GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
_ENDING = re.compile(rb"\r\n|\r|\n")
CHUNK = 1 << 20


def open_binary(path: str | Path) -> BinaryIO:
    """``path`` opened for reading bytes, gunzipped when it starts with gzip's magic number
    (whatever its name). Opened once and peeked at: a pipe (``<(zcat x.gz)``) reads only once."""
    raw = open(path, "rb")
    try:
        if raw.peek(2)[:2] == GZIP_MAGIC:
            return gzip.GzipFile(fileobj=raw, mode="rb")
    except BaseException:
        raw.close()
        raise
    return raw


def _raw_lines(stream: BinaryIO) -> Iterator[tuple[bytes, bytes]]:
    """(line, its ending) for every line of ``stream``, read in chunks; the last line's ending
    may be empty. A CR at a chunk's end waits for the next chunk: it may be half of CRLF. Linear
    in the file's size, however long a line is (a 50M-residue sequence on one line)."""
    parts, held = [], b""  # the current line's bytes so far; a CR kept back from the last chunk
    while chunk := stream.read(CHUNK):
        data, held = held + chunk, b""
        if data.endswith(b"\r"):
            data, held = data[:-1], b"\r"
        start = 0
        for m in _ENDING.finditer(data):
            parts.append(data[start : m.start()])
            yield b"".join(parts), m.group()
            parts, start = [], m.end()
        parts.append(data[start:])
    if held or any(parts):
        yield b"".join(parts), held


def decode_line(raw: bytes) -> str:
    """A line's bytes as text: UTF-8, else the Windows code page, else Latin-1 (never fails)."""
    for codec in ("utf-8", "cp1252"):
        try:
            return raw.decode(codec)
        except UnicodeDecodeError:
            pass
    return raw.decode("latin-1")


def text_lines(
    stream: BinaryIO, source: str | Path, error: type[EsmcMlxError], keepends: bool = False
) -> Iterator[str]:
    """The lines of the byte stream ``stream`` (module docstring): ``keepends`` keeps each
    line's ending (what the ``csv`` module needs for fields spanning lines). ``error`` naming
    ``source`` for a binary file."""
    for number, (line, ending) in enumerate(_raw_lines(stream)):
        if number == 0 and line.startswith(UTF8_BOM):
            line = line[len(UTF8_BOM) :]
        if b"\x00" in line:
            raise error(f"{source}: a binary file, not text (a NUL byte on line {number + 1})")
        text = decode_line(line)
        yield text + decode_line(ending) if keepends else text


def split_lines(text: str) -> list[str]:
    """``text`` cut at ``\\n``, ``\\r`` and ``\\r\\n`` only (what ``text_lines`` does to bytes)."""
    return re.split(r"\r\n|\r|\n", text)
