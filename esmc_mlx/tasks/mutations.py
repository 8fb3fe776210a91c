"""ProteinGym-style mutant strings: ``A23G`` (wild type, 1-based position, mutant) and
multi-mutants joined by ``:`` (``A23G:L40P``). ``WT``/``_wt``/empty is the wild type itself.

Positions are 1-based and counted from ``offset`` (the number of the sequence's first
residue; 1 unless the sequence is a fragment of a longer numbering, as some DMS sets use).
"""

from __future__ import annotations

import dataclasses
import numbers
import re

from ..errors import MutationError
from ..vocab import AMINO_ACIDS

AMINO_ACIDS_20 = "".join(sorted(AMINO_ACIDS))  # alphabetical, as DMS tables list them
WILD_TYPE_NAMES = frozenset({"", "wt", "_wt", "wildtype", "wild_type", "wild-type"})
_SITE_RE = re.compile(r"^([A-Za-z])(-?\d+)([A-Za-z])$")
MAX_DIGITS = 18  # a position fits a 64-bit integer: far past any protein


def _shown(text: str) -> str:
    """A mutant in a message, cut short when it is long."""
    return repr(text) if len(text) <= 60 else repr(text[:40] + "...")


@dataclasses.dataclass(frozen=True)
class Substitution:
    wt: str
    position: int  # 1-based, in the user's numbering (offset applied)
    mut: str
    index: int  # 0-based index into the sequence

    def __str__(self) -> str:
        return f"{self.wt}{self.position}{self.mut}"


def parse_mutant(text: str, sequence: str, offset: int = 1, where: str = "") -> list[Substitution]:
    """Parse one mutant string against ``sequence``; raise MutationError naming the problem.

    ``where`` prefixes messages (e.g. ``"mutations.csv, line 7: "``).
    """
    if not isinstance(text, str):
        raise MutationError(f"{where}{text!r}: a mutant is a string like A23G, not a {type(text).__name__}")
    text = text.strip()
    if text.lower() in WILD_TYPE_NAMES:
        return []
    subs: list[Substitution] = []
    seen: set[int] = set()
    for part in text.split(":"):
        part = part.strip()
        match = _SITE_RE.match(part)
        if not match:
            raise MutationError(
                f"{where}{text!r}: {part!r} is not a substitution like A23G (wild type, 1-based "
                "position, mutant; join several with ':')"
            )
        digits = match.group(2)
        pos = int(digits) if len(digits) <= MAX_DIGITS else None  # Python reads no more than 4,300 digits
        index = None if pos is None else pos - offset
        if index is None or not 0 <= index < len(sequence):
            last = offset + len(sequence) - 1
            shown = digits if pos is not None else f"{digits[:8]}... ({len(digits):,} digits)"
            raise MutationError(
                f"{where}{_shown(text)}: position {shown} is out of range (the sequence spans {offset}..{last})"
            )
        wt, mut = match.group(1).upper(), match.group(3).upper()
        if sequence[index] != wt:
            raise MutationError(
                f"{where}{text!r}: wild-type residue {wt} at position {pos} does not match the "
                f"sequence, which has {sequence[index]} there"
            )
        if mut not in AMINO_ACIDS_20:
            raise MutationError(f"{where}{text!r}: mutant residue {mut!r} is not one of the 20 amino acids")
        if index in seen:
            raise MutationError(f"{where}{text!r}: position {pos} is mutated twice")
        seen.add(index)
        subs.append(Substitution(wt, pos, mut, index))
    return subs


def parse_mutants(
    mutants: list[str], sequence: str, offset: int = 1, where: list[str] | None = None
) -> list[list[Substitution]]:
    """Parse many mutant strings; ``where[i]`` prefixes the message for ``mutants[i]``."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise MutationError(f"offset must be an integer (the number of the first residue), got {offset!r}")
    return [
        parse_mutant(m, sequence, offset, where[i] if where else f"mutant {i + 1}: ") for i, m in enumerate(mutants)
    ]


def apply(sequence: str, subs: list[Substitution]) -> str:
    """The mutated sequence."""
    chars = list(sequence)
    for s in subs:
        chars[s.index] = s.mut
    return "".join(chars)


def all_singles(sequence: str, offset: int = 1) -> list[str]:
    """Every single substitution to another of the 20 amino acids, position by position."""
    return [f"{wt}{i + offset}{aa}" for i, wt in enumerate(sequence) for aa in AMINO_ACIDS_20 if aa != wt]
