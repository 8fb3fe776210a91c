"""ESMC's vocabulary: the 33 tokens, the residue alphabet, the one sequence validator, and the
tokenizer files that transformers' ``AutoTokenizer`` loads.

Ids are those of transformers' ``EsmcTokenizer`` (tests compare them). Everything that reads a
sequence (the tokenizer, the FASTA reader, ``--sequence`` options) checks it with
``check_sequence`` and so gets the same error for the same bad residue.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from .errors import SequenceError

VOCAB = (
    "<cls>",
    "<pad>",
    "<eos>",
    "<unk>",
    "L",
    "A",
    "G",
    "V",
    "S",
    "E",
    "R",
    "T",
    "I",
    "D",
    "P",
    "K",
    "Q",
    "N",
    "F",
    "Y",
    "M",
    "H",
    "W",
    "C",
    "X",
    "B",
    "U",
    "Z",
    "O",  # ambiguity codes and the rare residues
    ".",
    "-",
    "|",  # gap, insertion, chain break
    "<mask>",
)
TOKEN_TO_ID = {t: i for i, t in enumerate(VOCAB)}
SPECIAL_TOKENS = ("<cls>", "<pad>", "<eos>", "<unk>", "|", "<mask>")
AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"  # the 20 standard residues, in vocabulary order
# In the vocabulary but not one of the 20: the ambiguity codes X (any), B (D or N), Z (E or Q) and
# the rare U (selenocysteine), O (pyrrolysine). ESMC saw them seldom in training; scores read at
# them are not scores of a residue (``score``, ``scan`` and ``embed`` skip them unless asked).
NONSTANDARD = "XBZUO"
STOP = "*"  # one trailing stop codon (translated genomes) is dropped wherever a sequence is read
# One-letter tokens that may appear in a sequence read from a file: the 20 amino acids, the
# ambiguity/rare codes X B Z U O, gaps '.' '-' and the chain break '|'.
RESIDUE_ALPHABET = frozenset("LAGVSERTIDPKQNFYMHWCXBUZO.-|")
ALLOWED_TEXT = "the 20 amino acids, X B Z U O, '.', '-', '|' (chain break)"
_TOKEN_RE = re.compile(r"<[a-z]+>|.", re.DOTALL)
# The common case, one regex call instead of a Python step per character (~2.5 us a residue:
# ~14 s for 20,000 proteins of 50-500 residues, paid by every rank of a launched embed). On ASCII
# text str.upper() is exactly split_tokens' per-character rule (no allowed character is a
# lower-case letter), so the answer is the same; anything else takes the slow path and its errors.
_RESIDUES_RE = re.compile("[" + re.escape("".join(sorted(RESIDUE_ALPHABET))) + "]+")


def split_tokens(
    sequence: str, name: str | None = None, where: str = "", label: str = "sequence", special_tokens: bool = False
) -> list[str]:
    """The tokens of ``sequence`` (lower-case ASCII residues read as upper case; one trailing
    ``*``, a stop codon, dropped).

    ``special_tokens``: also accept ``<mask>`` and the other ``<...>`` vocabulary tokens (the
    tokenizer does; a FASTA file does not). Raises SequenceError naming the sequence and each
    bad character with its 1-based position, or an empty sequence.
    """
    named = f"{where}{label}" + (f" {name!r}" if name else "")
    if not isinstance(sequence, str):
        raise SequenceError(f"{named}: expected a string of residues, got {type(sequence).__name__}")
    sequence = sequence.removesuffix(STOP)
    allowed = TOKEN_TO_ID if special_tokens else RESIDUE_ALPHABET
    tokens, bad = [], []
    for match in _TOKEN_RE.finditer(sequence):
        token = match.group()
        if len(token) == 1 and token.isascii() and token not in allowed and token.upper() in allowed:
            token = token.upper()
        if token not in allowed:
            bad.append(f"{token!r} at position {match.start() + 1}")
        tokens.append(token)
    if bad:
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        extra = ", <mask>" if special_tokens else ""
        raise SequenceError(f"{named}: invalid character {shown}. Allowed: {ALLOWED_TEXT}{extra}.")
    if not tokens:
        raise SequenceError(f"{named}: empty sequence")
    return tokens


def as_sequences(sequences) -> list:
    """``sequences`` as a list: one string is one sequence. SequenceError for anything that is
    not a string or a collection of them (None, a number, bytes); the items are checked later,
    each naming itself."""
    if isinstance(sequences, str):
        return [sequences]
    if isinstance(sequences, (bytes, bytearray)) or not isinstance(sequences, Iterable):
        raise SequenceError(f"sequences: expected a string or a list of strings, got {type(sequences).__name__}")
    return list(sequences)


def item_names(sequences: list, names=None) -> list | None:
    """What each sequence's errors call it: ``names`` when given, else its 1-based position
    when there are several (a lone sequence needs no name)."""
    if names is not None:
        return list(names)
    return [str(i + 1) for i in range(len(sequences))] if len(sequences) > 1 else None


def check_sequence(sequence: str, name: str | None = None, where: str = "", label: str = "record") -> str:
    """``sequence`` upper-cased, or SequenceError naming ``name`` and each bad position, or
    saying that it reads as DNA or RNA (``nucleotide_share``)."""
    upper = None
    if isinstance(sequence, str) and sequence.isascii():
        upper = sequence.upper()
        if not _RESIDUES_RE.fullmatch(upper):
            upper = None
    if upper is None:
        upper = "".join(split_tokens(sequence, name, where, label))
    share = nucleotide_share(upper)
    if share is not None:
        named = f"{where}{label}" + (f" {name!r}" if name else "")
        raise SequenceError(
            f"{named}: reads as DNA or RNA, not protein ({share:.0%} of its {residue_count(upper):,} letters are "
            "A, C, G, T, U or N); esmc-mlx reads protein sequences: translate it first (e.g. seqkit translate)"
        )
    return upper


# A record is read as nucleotides, and refused, when at least NUCLEOTIDE_LENGTH of its letters are
# there, NUCLEOTIDE_SHARE of them are A C G T U N (ambiguity codes aside) and at least three of
# the bases A, C, G, T/U occur. Those five residues make ~25% of a protein (UniProt's composition):
# a protein of 15 such letters is a 1-in-10^9 draw, and a low-complexity one (poly-A, GAGA
# repeats, poly-N) holds fewer than three of the bases. No flag turns it off: nothing a protein
# model computes from a DNA string means anything.
NUCLEOTIDES = "ACGTUN"
NUCLEOTIDE_LENGTH = 15
NUCLEOTIDE_SHARE = 0.9


def residue_count(sequence: str) -> int:
    """Letters of a checked sequence: gaps and chain breaks aside."""
    return len(sequence) - sum(sequence.count(c) for c in ".-|")


def nucleotide_share(sequence: str) -> float | None:
    """The share of A C G T U N among the letters of the checked (upper-case) ``sequence`` when it
    reads as DNA or RNA (see ``NUCLEOTIDE_SHARE``), else None."""
    letters = residue_count(sequence)
    if letters < NUCLEOTIDE_LENGTH:
        return None
    share = sum(sequence.count(c) for c in NUCLEOTIDES) / letters
    bases = sum(c in sequence for c in "ACG") + ("T" in sequence or "U" in sequence)
    return share if share >= NUCLEOTIDE_SHARE and bases >= 3 else None


_NONSTANDARD_RE = re.compile(f"[{NONSTANDARD}]")


def nonstandard_positions(sequence: str) -> list[int]:
    """0-based positions of the non-standard residues (``NONSTANDARD``) of a checked sequence."""
    return [m.start() for m in _NONSTANDARD_RE.finditer(sequence)]


def nonstandard_text(sequence: str, positions: list[int], offset: int = 1, limit: int = 5) -> str:
    """``X at 9, B at 14`` (numbered from ``offset``), the first ``limit`` of them and a count."""
    shown = ", ".join(f"{sequence[p]} at {p + offset}" for p in positions[:limit])
    return shown + (f" and {len(positions) - limit} more" if len(positions) > limit else "")


def write_tokenizer_files(directory: str | Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json (loadable by ``AutoTokenizer``)."""
    directory = Path(directory)
    specials = [
        {
            "id": TOKEN_TO_ID[t],
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    ]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<cls>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<eos>", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {t: {"id": t, "ids": [TOKEN_TO_ID[t]], "tokens": [t]} for t in ("<cls>", "<eos>")},
        },
        "decoder": None,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(TOKEN_TO_ID),
            "merges": [],
        },
    }
    config = {
        "tokenizer_class": "EsmcTokenizer",
        "backend": "tokenizers",
        "bos_token": "<cls>",
        "cls_token": "<cls>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "chain_break_token": "|",
        "extra_special_tokens": [],
        "model_max_length": 1000000000000000019884624838656,
    }
    paths = [directory / "tokenizer.json", directory / "tokenizer_config.json"]
    for path, payload in zip(paths, (tokenizer_json, config)):
        path.write_text(json.dumps(payload, indent=2) + "\n")
    return paths
