"""Structure files: the PDB is transformers' output_to_pdb byte for byte; the mmCIF holds the same
atoms, coordinates and B-factors."""

from __future__ import annotations

import shlex
import warnings

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[torch]' in the clone")

from transformers.models.esmfold2.protein_utils import _rank_samples, output_to_pdb, prepare_protein_features

from esmc_mlx.errors import FoldError
from esmc_mlx.tasks.fold.features import protein_features
from esmc_mlx.tasks.fold.structure import rank_samples, to_mmcif, to_pdb

COMPLEX = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMX", "MKTAYIAKQRQISFVKSHFSRQ", "WCYPH"]


def fold_output(features: dict, samples: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """What a fold returns for ``features``, with random numbers: coordinates, pLDDT in [0, 1], pTM."""
    rng = np.random.default_rng(seed)
    num_atoms, num_tokens = features["atom_to_token"].shape[1], features["res_type"].shape[1]
    return {
        "sample_atom_coords": (rng.standard_normal((samples, num_atoms, 3)) * 40).astype(np.float32),
        "plddt": rng.uniform(0, 1, (samples, num_tokens)).astype(np.float32),
        "ptm": rng.uniform(0, 1, samples).astype(np.float32),
    }


def reference_pdb(output: dict, features: dict, **kw) -> str:
    as_torch = {k: torch.tensor(v) for k, v in output.items()}
    return output_to_pdb(as_torch, {k: torch.tensor(v) for k, v in features.items()}, **kw)


@pytest.mark.parametrize("sequence", ["MKTAYIAKQRQISFVKSHFSRQ", "ACDEFGHIKLMNPQRSTVWYX", "G", "XXXW"])
def test_pdb_of_one_chain_is_transformers_byte_for_byte(sequence):
    features = {k: v.numpy() for k, v in prepare_protein_features(sequence).items()}
    output = fold_output(features)
    best = rank_samples(output)
    mine = to_pdb(features, output["sample_atom_coords"][best], output["plddt"][best])
    assert mine == reference_pdb(output, features)
    assert mine.splitlines()[0] == "PARENT N/A" and mine.endswith("\nEND\n")
    for sample in range(3):
        assert to_pdb(features, output["sample_atom_coords"][sample], output["plddt"][sample]) == reference_pdb(
            output, features, sample_idx=sample
        )


def test_pdb_of_a_complex_is_transformers_byte_for_byte():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # X is folded without a warning
        features = protein_features(COMPLEX)
    output = fold_output(features, seed=1)
    best = rank_samples(output)
    mine = to_pdb(features, output["sample_atom_coords"][best], output["plddt"][best])
    assert mine == reference_pdb(output, features)
    lines = mine.splitlines()
    assert [line[:3] for line in lines if line.startswith("TER")] == ["TER"] * 4
    assert [line[21] for line in lines if line.startswith("TER")] == ["A", "B", "C", "D"]
    assert lines.count("PARENT N/A") == 4
    first_of_b = next(line for line in lines if line.startswith("ATOM") and line[21] == "B")
    assert first_of_b[17:26] == "GLY B   1"  # residues numbered from 1 in each chain


def test_rank_samples_is_transformers_ranking():
    rng = np.random.default_rng(3)
    ptm, complex_plddt, plddt = rng.uniform(size=5), rng.uniform(size=5), rng.uniform(size=(5, 30))
    assert len({int(ptm.argmax()), int(complex_plddt.argmax()), int(plddt.mean(-1).argmax())}) == 3
    for output in ({"ptm": ptm, "plddt": plddt}, {"complex_plddt": complex_plddt, "plddt": plddt}, {"plddt": plddt}):
        theirs = _rank_samples({k: torch.tensor(v) for k, v in output.items()})
        assert rank_samples(output) == theirs
        assert rank_samples({k: mx.array(v) for k, v in output.items()}) == theirs  # MLX arrays as well
    with pytest.raises(FoldError, match="no ptm, complex_plddt or plddt"):
        rank_samples({})


def cif_tokens(text: str) -> list[str]:
    """The values of a CIF text in order: quoted strings, ;-delimited text fields and bare words."""
    tokens, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(";"):
            field = [line[1:]]
            i += 1
            while not lines[i].startswith(";"):
                field.append(lines[i])
                i += 1
            tokens.append("\n".join(field))
        elif not line.startswith("#"):
            tokens += shlex.split(line, comments=False)
        i += 1
    return tokens


def cif_loops(text: str) -> dict[str, list[dict[str, str]]]:
    """Each loop_ category of a CIF text as a list of rows (field -> value)."""
    tokens, loops, i = cif_tokens(text), {}, 0
    while i < len(tokens):
        if tokens[i] != "loop_":
            i += 1
            continue
        i += 1
        fields = []
        while i < len(tokens) and tokens[i].startswith("_"):
            fields.append(tokens[i])
            i += 1
        values = []
        while i < len(tokens) and not tokens[i].startswith("_") and tokens[i] != "loop_":
            values.append(tokens[i])
            i += 1
        assert len(values) % len(fields) == 0, fields
        category = fields[0].split(".")[0][1:]
        loops[category] = [
            {f.split(".")[1]: v for f, v in zip(fields, values[r : r + len(fields)])}
            for r in range(0, len(values), len(fields))
        ]
    return loops


def pdb_atoms(text: str) -> list[tuple]:
    return [
        (
            line[12:16].strip(),
            line[17:20],
            line[21],
            int(line[22:26]),
            float(line[30:38]),
            float(line[38:46]),
            float(line[46:54]),
            float(line[60:66]),
            line[76:78].strip(),
        )
        for line in text.splitlines()
        if line.startswith("ATOM")
    ]


@pytest.mark.parametrize("per_atom", [False, True])
def test_mmcif_holds_the_pdbs_atoms(per_atom):
    features = protein_features(COMPLEX)
    output = fold_output(features, samples=1, seed=2)
    coords = output["sample_atom_coords"][0]
    plddt = output["plddt"][0]
    if per_atom:
        plddt = np.random.default_rng(4).uniform(0, 100, coords.shape[0]).astype(np.float32)
    pdb = to_pdb(features, coords, plddt)
    cif = to_mmcif(features, coords, plddt, name="my fold")
    assert cif.startswith("data_my_fold\n")
    loops = cif_loops(cif)
    sites = loops["atom_site"]
    assert len(sites) == int(features["atom_attention_mask"].sum())
    assert [int(s["id"]) for s in sites] == list(range(1, len(sites) + 1))
    for s in sites:  # label_ and auth_ agree: numbering from 1 per chain, chains A, B, ...
        assert (s["label_asym_id"], s["label_seq_id"], s["label_comp_id"], s["label_atom_id"]) == (
            s["auth_asym_id"],
            s["auth_seq_id"],
            s["auth_comp_id"],
            s["auth_atom_id"],
        )
    from_cif = [
        (
            s["label_atom_id"],
            s["label_comp_id"],
            s["label_asym_id"],
            int(s["label_seq_id"]),
            float(s["Cartn_x"]),
            float(s["Cartn_y"]),
            float(s["Cartn_z"]),
            float(s["B_iso_or_equiv"]),
            s["type_symbol"],
        )
        for s in sites
    ]
    assert from_cif == pdb_atoms(pdb)
    if per_atom:  # B-factors per atom, padding atoms left out
        kept = np.flatnonzero(features["atom_attention_mask"][0])
        np.testing.assert_allclose([a[7] for a in from_cif], np.round(plddt[kept], 2), atol=1e-9)
    # two copies of one sequence are one entity; its residues listed once
    entity_of = {s["label_asym_id"]: s["label_entity_id"] for s in sites}
    assert entity_of == {"A": "1", "B": "2", "C": "1", "D": "3"}
    assert [(r["id"], r["entity_id"]) for r in loops["struct_asym"]] == list(entity_of.items())
    assert [r["pdbx_strand_id"] for r in loops["entity_poly"]] == ["A,C", "B", "D"]
    seq = [r["mon_id"] for r in loops["entity_poly_seq"] if r["entity_id"] == "2"]
    assert seq == ["GLY", "SER", "HIS", "MET", "UNK"]
    assert len(loops["entity_poly_seq"]) == len(COMPLEX[0]) + len(COMPLEX[1]) + len(COMPLEX[3])


def test_pdb_refuses_what_its_columns_cannot_hold_and_mmcif_writes_it():
    features = protein_features(["G"] * 63)
    coords = np.zeros((features["atom_to_token"].shape[1], 3), dtype=np.float32)
    plddt = np.full(63, 0.5, dtype=np.float32)
    with pytest.raises(FoldError, match="63 chains: PDB names at most 62; write mmCIF instead"):
        to_pdb(features, coords, plddt)
    sites = cif_loops(to_mmcif(features, coords, plddt))["atom_site"]
    assert [s["label_asym_id"] for s in sites[-8:]] == ["9"] * 4 + ["AA"] * 4


def test_writers_check_shapes():
    features = protein_features("MKT")
    with pytest.raises(FoldError, match=r"coordinates of shape \(3, 32, 3\): the features have 32 atoms"):
        to_pdb(features, np.zeros((3, 32, 3)), np.zeros(3))
    with pytest.raises(FoldError, match=r"pLDDT of shape \(4,\): expected one value per residue \(3,\) or per atom"):
        to_mmcif(features, np.zeros((32, 3)), np.zeros(4))
