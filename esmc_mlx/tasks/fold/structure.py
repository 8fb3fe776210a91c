"""Structure files of a fold: PDB as transformers' ``protein_utils.output_to_pdb`` writes it, and
mmCIF; the choice of the sample to write (``rank_samples``).

The writers take the features the fold ran on (``protein_features``' dict of numpy arrays), one
sample's atom coordinates (A, 3) on the features' atom axis, and a confidence per residue (L,) or
per atom (A,) for the B-factor column, written as given with two decimals. Padding atoms are left
out; atoms keep the featurization order (N, CA, C, O, then the side chain), chains are named by
``features.chain_tag`` of their ``asym_id`` (A, B, ...) and residues are numbered from 1 in each chain.

The pLDDT scale: ESMFold2's pLDDT is in [0, 1] and ``output_to_pdb`` writes it so (``  0.87``).
AlphaFold 2 and 3, ESMFold and the viewers' pLDDT colourings read 0-100 in that column; a caller
that wants 0-100 passes ``100 * plddt``.

PDB holds one character of chain id, five digits of atom serial and four of residue number:
``to_pdb`` refuses a structure past those (more than 62 chains, ...) with a FoldError that names
mmCIF, which has no such limits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from ...errors import FoldError
from .features import CHAIN_TAGS, chain_tag
from .residues import TYPE_TO_RESIDUE

_PDB_MAX_SERIAL = 99_999
_PDB_MAX_RESIDUE = 9_999


def _score(output, key: str) -> np.ndarray | None:
    value = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
    if value is None:
        return None
    if isinstance(value, mx.array):
        value = value.astype(mx.float32)
    return np.asarray(value, dtype=np.float32)


def rank_samples(output) -> int:
    """The index of the best of a fold's samples, as transformers' ``_rank_samples``: the highest
    ``ptm``, else the highest ``complex_plddt``, else the highest mean ``plddt`` (S, L). ``output``
    is a mapping or an object with those fields (numpy or MLX arrays)."""
    for key in ("ptm", "complex_plddt"):
        score = _score(output, key)
        if score is not None:
            return int(np.argmax(score))
    plddt = _score(output, "plddt")
    if plddt is None:
        raise FoldError("no ptm, complex_plddt or plddt to rank the samples by")
    return int(np.argmax(plddt.mean(axis=-1)))


class _Atoms:
    """The atoms to write, in order, with what each file says of them."""

    def __init__(self, features: Mapping, coords, confidence):
        # The features of one structure, with the batch dim of 1 protein_features gives or without it.
        batched = np.ndim(features["atom_to_token"]) == 2

        def row(key: str, default: int = 0) -> np.ndarray:
            if key not in features:  # a single-chain fold may leave out its chain and entity ids
                return np.full(num_tokens, default, dtype=np.int64)
            value = np.asarray(features[key])
            return value[0] if batched else value

        token_mask = row("attention_mask").astype(bool)
        num_tokens = len(token_mask)
        atom_to_token, atom_mask = row("atom_to_token"), row("atom_attention_mask").astype(bool)
        num_atoms = len(atom_to_token)
        coords = np.asarray(coords, dtype=np.float32)
        if coords.shape != (num_atoms, 3):
            raise FoldError(
                f"coordinates of shape {coords.shape}: the features have {num_atoms} atoms, (A, 3) expected"
            )
        confidence = np.asarray(confidence, dtype=np.float32)
        if confidence.shape not in {(num_tokens,), (num_atoms,)}:
            raise FoldError(
                f"pLDDT of shape {confidence.shape}: expected one value per residue ({num_tokens},) or per atom "
                f"({num_atoms},)"
            )
        self.index = np.flatnonzero(atom_mask & token_mask[atom_to_token])
        self.token = atom_to_token[self.index]
        self.coords = coords[self.index]
        self.b_factors = confidence[self.index] if confidence.shape == (num_atoms,) else confidence[self.token]
        chars = row("ref_atom_name_chars")[self.index].tolist()
        self.names = ["".join(chr(c + 32) if c else " " for c in name).strip() for name in chars]
        self.residue_names = [TYPE_TO_RESIDUE.get(t, "UNK") for t in row("res_type").tolist()]
        self.residue_numbers = row("residue_index") + 1  # per token, 1-based
        self.asym_id = row("asym_id")
        self.entity_id = row("entity_id", default=1)


def pdb_problem(num_chains: int, num_atoms: int, longest_chain: int) -> str | None:
    """Why PDB's fixed columns cannot hold a structure of ``num_chains`` chains, ``num_atoms`` real
    atoms and a longest chain of ``longest_chain`` residues (naming mmCIF, which can), or None."""
    if num_chains > len(CHAIN_TAGS):
        return f"{num_chains} chains: PDB names at most {len(CHAIN_TAGS)}; write mmCIF instead"
    if num_atoms + num_chains > _PDB_MAX_SERIAL:
        return f"{num_atoms:,} atoms: PDB numbers at most {_PDB_MAX_SERIAL:,}; write mmCIF instead"
    if longest_chain > _PDB_MAX_RESIDUE:
        return f"a chain of more than {_PDB_MAX_RESIDUE:,} residues: too long for PDB; write mmCIF instead"
    return None


def to_pdb(features: Mapping, coords, plddt) -> str:
    """A PDB string of one sample, byte for byte what transformers' ``output_to_pdb`` writes for
    the same features, coordinates and per-residue pLDDT: ``PARENT N/A``, ``ATOM`` records, a
    ``TER`` closing each chain (numbered as the next atom) and ``PARENT N/A`` opening the next,
    ``END``. ``plddt`` may also be per atom. FoldError when PDB's columns cannot hold it."""
    atoms = _Atoms(features, coords, plddt)
    chains = np.unique(atoms.asym_id[atoms.token])
    longest = int(atoms.residue_numbers[atoms.token].max()) if len(atoms.index) else 0
    problem = pdb_problem(int(chains.max()) + 1 if len(chains) else 0, len(atoms.index), longest)
    if problem:
        raise FoldError(problem)

    lines = ["PARENT N/A"]
    serial, tag, previous = 1, CHAIN_TAGS[0], None
    for name, token, position, b_factor in zip(atoms.names, atoms.token.tolist(), atoms.coords, atoms.b_factors):
        residue, number = atoms.residue_names[token], int(atoms.residue_numbers[token])
        next_tag = CHAIN_TAGS[int(atoms.asym_id[token])]
        if previous is not None and next_tag != tag:
            lines.append(_pdb_ter(serial, *previous, tag))
            serial += 1
            lines.append("PARENT N/A")
        tag = next_tag
        lines.append(_pdb_atom(serial, name, residue, tag, number, position, float(b_factor)))
        serial += 1
        previous = residue, number
    if previous is not None:
        lines.append(_pdb_ter(serial, *previous, tag))
    return "\n".join([*lines, "END", ""])


def _pdb_atom(serial: int, name: str, residue: str, tag: str, number: int, position, b_factor: float) -> str:
    """One ATOM record; PDB is columnar, every space counts. Names of fewer than four characters
    start in column 14, the element in its usual column."""
    padded = name if len(name) == 4 else f" {name}"
    x, y, z = position
    return (
        f"ATOM  {serial:>5} {padded:<4} {residue:>3} {tag}{number:>4}    "
        f"{x:>8.3f}{y:>8.3f}{z:>8.3f}{1.0:>6.2f}{b_factor:>6.2f}          {name[:1]:>2}  "
    )


def _pdb_ter(serial: int, residue: str, number: int, tag: str) -> str:
    return f"TER   {serial:>5}      {residue:>3} {tag}{number:>4}"


_ATOM_SITE = (
    "group_PDB",
    "id",
    "type_symbol",
    "label_atom_id",
    "label_alt_id",
    "label_comp_id",
    "label_asym_id",
    "label_entity_id",
    "label_seq_id",
    "pdbx_PDB_ins_code",
    "Cartn_x",
    "Cartn_y",
    "Cartn_z",
    "occupancy",
    "B_iso_or_equiv",
    "auth_seq_id",
    "auth_comp_id",
    "auth_asym_id",
    "auth_atom_id",
    "pdbx_PDB_model_num",
)


def _loop(category: str, fields: tuple[str, ...], rows: list[tuple]) -> list[str]:
    return ["loop_", *(f"_{category}.{f}" for f in fields), *(" ".join(map(str, row)) for row in rows), "#"]


def to_mmcif(features: Mapping, coords, plddt, name: str = "esmfold2") -> str:
    """An mmCIF string of one sample: the entities (one per distinct chain sequence, with their
    residues in ``_entity_poly_seq``), the chains (``_struct_asym``) and ``_atom_site`` with label_
    and auth_ fields alike (chain A, B, ... as in the PDB; residues from 1 in each chain), the
    pLDDT in ``B_iso_or_equiv``. ``name`` is the data block's name (characters other than letters,
    digits, ``.``, ``_`` and ``-`` become ``_``)."""
    atoms = _Atoms(features, coords, plddt)
    block = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "esmfold2"
    chains: dict[int, int] = {}  # asym_id -> entity_id, in order of appearance
    entities: dict[int, list[str]] = {}  # entity_id -> the residue names of its first chain
    first_chain: dict[int, int] = {}
    for token in np.unique(atoms.token).tolist():
        asym, entity = int(atoms.asym_id[token]), int(atoms.entity_id[token])
        chains.setdefault(asym, entity)
        if first_chain.setdefault(entity, asym) == asym:
            entities.setdefault(entity, []).append(atoms.residue_names[token])

    lines = [f"data_{block}", "#", f"_entry.id {block}", "#"]
    lines += _loop("entity", ("id", "type"), [(e, "polymer") for e in entities])
    lines += _loop(
        "entity_poly",
        ("entity_id", "type", "nstd_linkage", "pdbx_strand_id"),
        [(e, "polypeptide(L)", "no", ",".join(chain_tag(a) for a, x in chains.items() if x == e)) for e in entities],
    )
    lines += _loop(
        "entity_poly_seq",
        ("entity_id", "num", "mon_id", "hetero"),
        [(e, n, residue, "n") for e, names in entities.items() for n, residue in enumerate(names, start=1)],
    )
    lines += _loop("struct_asym", ("id", "entity_id"), [(chain_tag(a), e) for a, e in chains.items()])
    rows = []
    for serial, (atom, token, (x, y, z), b_factor) in enumerate(
        zip(atoms.names, atoms.token.tolist(), atoms.coords, atoms.b_factors), start=1
    ):
        residue, number = atoms.residue_names[token], int(atoms.residue_numbers[token])
        chain, entity = chain_tag(int(atoms.asym_id[token])), int(atoms.entity_id[token])
        rows.append(
            ("ATOM", serial, atom[:1], atom, ".", residue, chain, entity, number, "?")
            + (f"{x:.3f}", f"{y:.3f}", f"{z:.3f}", "1.00", f"{float(b_factor):.2f}", number, residue, chain, atom, 1)
        )
    lines += _loop("atom_site", _ATOM_SITE, rows)
    return "\n".join(lines) + "\n"
