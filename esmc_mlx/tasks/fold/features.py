"""Protein chains -> the fold's input features, as numpy arrays.

One chain gives exactly what transformers' ``protein_utils.prepare_protein_features`` gives: the
same keys, dtypes and values, each with a leading batch dim of 1. Several chains (a complex) take
AlphaFold 3's token conventions, which are what the reference's modules read:

- ``asym_id``: the chain's index, 0, 1, ... in the order given. The language-model input is built
  per chain from it ([BOS] chain 0 [EOS][BOS] chain 1 ... [EOS], in ascending asym_id, attention
  kept within a chain); the relative position encoding reads residue offsets only within one
  asym_id; pTM, ipTM and interface pLDDT count chains by it.
- ``entity_id``: one id per distinct sequence, from 1 in first-seen order (a lone chain is entity 1,
  as in the reference); identical chains share it (the encoding's same-entity feature).
- ``sym_id``: the copy number of the chain's entity, 0, 1, ...: the chains of a homodimer are 0
  and 1, the offset the encoding reads between two chains.
- ``residue_index``: restarts at 0 in each chain (the LM collapses tokens by (asym_id, residue_index)).
- ``token_index`` and ``ref_space_uid``: global, 0 .. N-1.
- atoms: concatenated in chain order and padded to a multiple of 32 as the reference pads one
  chain; ``atom_to_token`` and ``distogram_atom_idx`` index the global axes.

What folds: the 20 amino acids and X, an unknown residue (its backbone N CA C O at the origin of
its frame, ``<unk>`` in the LM input: how the reference reads X). B Z U O are in ESMC's vocabulary,
and ``protein_features`` takes them as the tokenizer does, but the fold has no atoms for them
(no selenocysteine or pyrrolysine side chain, no half-Asp half-Asn): they fold as X, which is what
the reference does with any letter it does not know, with a NonstandardResidueWarning naming them.

Refused with a FoldError naming the chain (A, B, ... as the structure files name it) and the
1-based position in it: an empty chain; anything but a string of upper-case one-letter codes
(a ligand, a nucleic-acid record); lower case (the reference would fold a lower-case letter as an
unknown residue; ``chains_from_text`` reads text as every esmc-mlx input does, lower case as
upper case); gaps ``-`` ``.``, a ``|`` inside a chain, a stop ``*``, digits and any other
character; a chain of 10 or more letters that holds only A C G T/U N with each of A, C, G and T or
U present (a nucleic acid, which this release does not fold).

Text: ``chains_from_text("MKT...|GSH...")`` -> two chains. ``|`` is ESMC's chain break token,
which a FASTA record of esmc-mlx and ``ESMCTokenizer`` already read as a chain boundary; ``:``
(ESMFold's and ColabFold's separator) is refused with a message that names ``|``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from ...errors import FoldError
from ...vocab import TOKEN_TO_ID, nonstandard_text, nucleotide_share
from ..scoring import NonstandardResidueWarning
from .residues import ATOMIC_NUMBER, CHARGED_ATOMS, ONE_TO_THREE, RESIDUE_ATOMS, RESIDUE_TYPE

FOLDED = frozenset(ONE_TO_THREE)  # the 20 amino acids and X
READ_AS_X = "BZUO"
ATOM_PADDING = 32  # the atom axis is padded to a multiple of this (the atom encoder's block)
MOL_TYPE_PROTEIN = 0
# The PDB chain identifiers, indexed by asym_id (transformers' output_to_pdb uses this table).
CHAIN_TAGS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_GAPS = "-."
_FOLDS_ONLY = (
    "the fold takes the 20 amino acids and X (B Z U O are read as X); this release folds protein "
    "chains only: no nucleic acids, ligands or modified residues"
)


def chain_tag(asym_id: int) -> str:
    """The chain's name in messages and structure files: A-Z, a-z, 0-9, then two characters
    (``AA``, ``AB``, ...; mmCIF only, PDB's chain column holds one)."""
    if asym_id < len(CHAIN_TAGS):
        return CHAIN_TAGS[asym_id]
    high, low = divmod(asym_id, len(CHAIN_TAGS))
    return chain_tag(high - 1) + CHAIN_TAGS[low]


def _encode_atom_name(name: str) -> list[int]:
    return [ord(c) - 32 if c != " " else 0 for c in name.ljust(4)[:4]]


class _Residue:
    """One residue type's atoms as arrays, built once."""

    def __init__(self, three: str):
        atoms = RESIDUE_ATOMS[three]
        names = [a[0] for a in atoms]
        self.size = len(atoms)
        self.ref_pos = np.array([a[1:] for a in atoms], dtype=np.float32)
        self.element = np.array([ATOMIC_NUMBER[n[0]] for n in names], dtype=np.int64)
        self.charge = np.array([1 if (three, n) in CHARGED_ATOMS else 0 for n in names], dtype=np.int8)
        self.name_chars = np.array([_encode_atom_name(n) for n in names], dtype=np.int64)
        self.representative = names.index("CB" if "CB" in names else "CA")  # the distogram's atom
        self.res_type = RESIDUE_TYPE[three]


_RESIDUES = {one: _Residue(three) for one, three in ONE_TO_THREE.items()}
# The LM reads X as <unk>, as the reference's fold vocabulary does (ESMC's own X token is not used).
_INPUT_ID = {one: TOKEN_TO_ID[one] for one in ONE_TO_THREE if one != "X"} | {"X": TOKEN_TO_ID["<unk>"]}


def _bad_character(char: str, position: int) -> tuple[str, str]:
    """(what the character is, how to fix it) for one refused character."""
    shown = f"{char!r} at position {position}"
    if len(char) == 1 and char.isascii() and char.isalpha() and char.upper() in FOLDED | set(READ_AS_X):
        return f"lower-case {shown}", "write residues in upper case (chains_from_text reads lower case as upper case)"
    if char in _GAPS:
        return f"gap {shown}", "remove alignment gaps"
    if char == "|":
        return f"chain break {shown}", "give the chains as a list (chains_from_text splits text at '|')"
    if char == "*":
        return f"stop {shown}", "remove stop codons (chains_from_text drops one at the end of a chain)"
    return shown, _FOLDS_ONLY


def check_chain(chain, asym_id: int, where: str = "") -> str:
    """``chain`` if the fold can take it, else FoldError naming chain ``chain_tag(asym_id)`` and
    each refused position (1-based, within the chain). ``where`` prefixes the message (a record)."""
    named = f"{where}chain {chain_tag(asym_id)}"
    if not isinstance(chain, str):
        raise FoldError(
            f"{named}: expected a string of one-letter amino acids, got {type(chain).__name__}; {_FOLDS_ONLY}"
        )
    if not chain:
        raise FoldError(f"{named} is empty")
    bad = [_bad_character(c, p + 1) for p, c in enumerate(chain) if c not in FOLDED and c not in READ_AS_X]
    if bad:
        shown = ", ".join(what for what, _ in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        hints = "; ".join(dict.fromkeys(hint for _, hint in bad))
        raise FoldError(f"{named}: cannot fold {shown}: {hints}")
    share = nucleotide_share(chain)
    if share is not None:
        raise FoldError(
            f"{named} reads as DNA or RNA ({len(chain)} letters, {share:.0%} of them A C G T U N): this release "
            "folds protein chains only"
        )
    return chain


def chains_from_text(text: str, name: str | None = None) -> list[str]:
    """The chains of ``text``, split at ``|`` (ESMC's chain break): ``"MKTAYIAK|GSHMSL"`` -> two
    chains. As every esmc-mlx text input: surrounding blanks ignored, lower case read as upper case,
    one trailing ``*`` (a stop codon) dropped, here per chain. Raises FoldError naming ``name``
    (a FASTA record's ID, say), the chain and the position: ``:`` is not a separator here, an empty
    chain or a character ``check_chain`` refuses."""
    where = f"{name}, " if name else ""
    if not isinstance(text, str):
        raise FoldError(f"{where}expected the chains as text, got {type(text).__name__}")
    text = text.strip(" \t\r\n")
    if ":" in text:
        raise FoldError(
            f"{where}':' at position {text.index(':') + 1}: esmc-mlx separates chains with '|' (ESMC's chain break "
            "token), e.g. 'MKTAYIAK|GSHMSL'"
        )
    chains = []
    for asym_id, chain in enumerate(text.split("|")):
        chain = "".join(c.upper() if c.isascii() else c for c in chain).removesuffix("*")
        chains.append(check_chain(chain, asym_id, where))
    return chains


def atom_counts(chains: Sequence[str]) -> tuple[int, int]:
    """(real atoms, atoms on the padded axis) of checked ``chains``, without featurizing them: what
    a fold of them holds per atom (memory estimates, PDB's atom limit)."""
    real = sum(_RESIDUES[c if c in FOLDED else "X"].size for chain in chains for c in chain)
    return real, math.ceil(real / ATOM_PADDING) * ATOM_PADDING


def protein_features(chains: str | Sequence[str]) -> dict[str, np.ndarray]:
    """The fold's features of one protein chain (a string) or a complex (a list of chains), as
    numpy arrays with a leading batch dim of 1: the keys, dtypes and, for one chain, the values of
    transformers' ``prepare_protein_features`` (the module docstring gives the complex's
    conventions). Raises FoldError for what the fold cannot take; warns for B Z U O (read as X)."""
    if isinstance(chains, str):
        chains = [chains]
    elif isinstance(chains, (bytes, bytearray)) or not isinstance(chains, Sequence):
        raise FoldError(f"expected a chain (a string) or a list of chains, got {type(chains).__name__}")
    if not chains:
        raise FoldError("no chains to fold")
    chains = [check_chain(chain, asym_id) for asym_id, chain in enumerate(chains)]
    for asym_id, chain in enumerate(chains):
        odd = [p for p, c in enumerate(chain) if c in READ_AS_X]
        if odd:
            warnings.warn(
                f"chain {chain_tag(asym_id)} holds {len(odd)} residue{'s' if len(odd) > 1 else ''} the fold reads "
                f"as X, an unknown residue with backbone atoms only ({nonstandard_text(chain, odd)}; B Z are "
                "ambiguity codes, U O rare residues the fold has no atoms for)",
                NonstandardResidueWarning,
                stacklevel=2,
            )

    entity_of: dict[str, int] = {}
    copies: dict[str, int] = {}
    asym_id, entity_id, sym_id, residue_index = [], [], [], []
    for chain_index, chain in enumerate(chains):
        entity = entity_of.setdefault(chain, len(entity_of) + 1)
        copy = copies.get(chain, 0)
        copies[chain] = copy + 1
        asym_id.append(np.full(len(chain), chain_index, dtype=np.int64))
        entity_id.append(np.full(len(chain), entity, dtype=np.int64))
        sym_id.append(np.full(len(chain), copy, dtype=np.int64))
        residue_index.append(np.arange(len(chain), dtype=np.int64))

    letters = "".join(c if c in FOLDED else "X" for c in "".join(chains))
    residues = [_RESIDUES[c] for c in letters]
    num_tokens = len(residues)
    sizes = np.array([r.size for r in residues], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    num_real = int(sizes.sum())
    num_atoms = math.ceil(num_real / ATOM_PADDING) * ATOM_PADDING

    def atoms(values: list[np.ndarray], dtype, tail: tuple[int, ...] = ()) -> np.ndarray:
        out = np.zeros((num_atoms, *tail), dtype=dtype)
        out[:num_real] = np.concatenate(values)
        return out

    token = np.arange(num_tokens, dtype=np.int64)
    atom_to_token = atoms([np.repeat(token, sizes)], np.int64)
    res_type = np.array([r.res_type for r in residues], dtype=np.int64)
    features = {
        "token_index": token,
        "residue_index": np.concatenate(residue_index),
        "asym_id": np.concatenate(asym_id),
        "sym_id": np.concatenate(sym_id),
        "entity_id": np.concatenate(entity_id),
        "mol_type": np.full(num_tokens, MOL_TYPE_PROTEIN, dtype=np.int64),
        "res_type": res_type,
        "input_ids": np.array([_INPUT_ID[c] for c in letters], dtype=np.int64),
        "token_bonds": np.zeros((num_tokens, num_tokens, 1), dtype=np.float32),
        "attention_mask": np.ones(num_tokens, dtype=bool),
        "ref_pos": atoms([r.ref_pos for r in residues], np.float32, (3,)),
        "ref_element": atoms([r.element for r in residues], np.int64),
        "ref_charge": atoms([r.charge for r in residues], np.int8),
        "ref_atom_name_chars": atoms([r.name_chars for r in residues], np.int64, (4,)),
        "ref_space_uid": atom_to_token.copy(),
        "atom_attention_mask": np.arange(num_atoms) < num_real,
        "atom_to_token": atom_to_token,
        "distogram_atom_idx": starts + np.array([r.representative for r in residues], dtype=np.int64),
        # No MSA: depth 1, the sequence itself.
        "msa": res_type[None],
        "msa_attention_mask": np.ones((1, num_tokens), dtype=bool),
        "has_deletion": np.zeros((1, num_tokens), dtype=bool),
        "deletion_value": np.zeros((1, num_tokens), dtype=np.float32),
        "deletion_mean": np.zeros(num_tokens, dtype=np.float32),
    }
    return {key: value[None] for key, value in features.items()}
