"""Fold featurization: one chain is transformers' prepare_protein_features exactly; a complex
follows AlphaFold 3's chain conventions; what the fold cannot take is refused by name."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[torch]' in the clone")

from transformers import EsmFold2Config, EsmFold2Model
from transformers.models.esmfold2 import protein_utils

from esmc_mlx.errors import FoldError
from esmc_mlx.tasks.fasta import parse_fasta
from esmc_mlx.tasks.fold.features import chains_from_text, protein_features
from esmc_mlx.tasks.fold.residues import CHARGED_ATOMS, ONE_TO_THREE, RESIDUE_ATOMS, RESIDUE_TYPE
from esmc_mlx.tasks.scoring import NonstandardResidueWarning
from esmc_mlx.testing import tiny_fold_config
from esmc_mlx.vocab import TOKEN_TO_ID

EVERY_RESIDUE = "ACDEFGHIKLMNPQRSTVWYX"


def reference(sequence: str) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in protein_utils.prepare_protein_features(sequence).items()}


def assert_same(mine: dict, theirs: dict):
    assert list(mine) == list(theirs)
    for key in theirs:
        assert mine[key].dtype == theirs[key].dtype, key
        assert mine[key].shape == theirs[key].shape, key
        np.testing.assert_array_equal(mine[key], theirs[key], err_msg=key)


def test_residue_tables_are_transformers_tables():
    assert {r: [a[0] for a in atoms] for r, atoms in RESIDUE_ATOMS.items()} == protein_utils.PROTEIN_HEAVY_ATOMS
    assert {r: {a[0]: a[1:] for a in atoms} for r, atoms in RESIDUE_ATOMS.items()} == protein_utils.PROTEIN_REF_POS
    assert ONE_TO_THREE == protein_utils.PROTEIN_1TO3
    assert RESIDUE_TYPE == {**protein_utils.PROTEIN_RESIDUE_TO_RES_TYPE, "UNK": protein_utils.PROTEIN_UNK_RES_TYPE}
    assert CHARGED_ATOMS == set(protein_utils.PROTEIN_CHARGED_ATOMS)
    assert set(protein_utils.PROTEIN_CHARGED_ATOMS.values()) == {1}
    # the LM ids: ESMC's tokens, X read as <unk>
    assert protein_utils.ESM_PROTEIN_VOCAB == {c: TOKEN_TO_ID[c] for c in EVERY_RESIDUE[:-1]} | {"X": 3}


def random_chain(rng, length: int) -> str:
    return "".join(rng.choice(list(EVERY_RESIDUE), length))


@pytest.mark.parametrize(
    "sequence",
    [
        EVERY_RESIDUE,
        EVERY_RESIDUE[::-1] * 3,
        "M",
        "X",
        "GGGGGGGG",  # 32 atoms: no padding
        "GGGGGGGGA",  # 37 atoms: padded to 64
        "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRLSPLHSVYVDQWDWERVMGDGERQFSTLKSTVEAIWAGIKATEAAVSEEFGLAPFLPDQIHFVHSQELLSRYPDLDAKGRERAIAKDLGAVFLVGIGGKLSDGHRHDVRAPDYDDWSTPSELGHAGLNGDILVWNPVLEDAFELSSMGIRVDADTLKHQLALTGDEDRLELEWHQALLRGEMPQTIGGGIGQSRLTMLLLQLPHIGQVQAGVWPAACRERVAEWGVL",
    ],
)
def test_one_chain_is_transformers_featurization(sequence):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # X needs no warning
        assert_same(protein_features(sequence), reference(sequence))
        assert_same(protein_features([sequence]), reference(sequence))


def test_random_chains_are_transformers_featurization():
    rng = np.random.default_rng(0)
    for length in (2, 7, 31, 64, 150):
        sequence = random_chain(rng, length)
        assert_same(protein_features(sequence), reference(sequence))


def test_b_z_u_o_fold_as_x_as_in_transformers_with_a_warning():
    sequence = "MKBTZAUYOX"
    with pytest.warns(
        NonstandardResidueWarning,
        match=r"chain A holds 4 residues the fold reads as X, .*\(B at 3, Z at 5, U at 7, O at 9;",
    ):
        mine = protein_features(sequence)
    assert_same(mine, reference(sequence))
    assert_same(mine, reference("MKXTXAXYXX"))


def test_a_complex_follows_alphafold3_chain_conventions():
    chains = ["MKTAYIAK", "GSHM", "MKTAYIAK", "WCYPHX", "GSHM", "MKTAYIAK"]
    features = protein_features(chains)
    sizes = [len(c) for c in chains]
    row = {k: v[0] for k, v in features.items()}
    assert row["asym_id"].tolist() == np.repeat(np.arange(6), sizes).tolist()
    assert row["entity_id"].tolist() == np.repeat([1, 2, 1, 3, 2, 1], sizes).tolist()
    assert row["sym_id"].tolist() == np.repeat([0, 0, 1, 0, 1, 2], sizes).tolist()
    assert row["residue_index"].tolist() == [i for n in sizes for i in range(n)]
    assert row["token_index"].tolist() == list(range(sum(sizes)))
    # each chain's atoms are its own featurization's, shifted along the global axes
    tokens, atoms = 0, 0
    for chain in chains:
        alone = {k: v[0] for k, v in reference(chain).items()}
        n = int(alone["atom_attention_mask"].sum())
        span = slice(atoms, atoms + n)
        for key in ("ref_pos", "ref_element", "ref_charge", "ref_atom_name_chars"):
            np.testing.assert_array_equal(row[key][span], alone[key][:n], err_msg=key)
        np.testing.assert_array_equal(row["atom_to_token"][span], alone["atom_to_token"][:n] + tokens)
        np.testing.assert_array_equal(row["ref_space_uid"][span], alone["ref_space_uid"][:n] + tokens)
        np.testing.assert_array_equal(
            row["distogram_atom_idx"][tokens : tokens + len(chain)], alone["distogram_atom_idx"] + atoms
        )
        for key in ("res_type", "input_ids", "mol_type"):
            np.testing.assert_array_equal(row[key][tokens : tokens + len(chain)], alone[key], err_msg=key)
        tokens, atoms = tokens + len(chain), atoms + n
    assert row["atom_attention_mask"].sum() == atoms and len(row["atom_attention_mask"]) == -(-atoms // 32) * 32
    assert not row["atom_attention_mask"][atoms:].any() and not row["atom_to_token"][atoms:].any()
    assert row["msa"].tolist() == [row["res_type"].tolist()] and row["token_bonds"].shape == (tokens, tokens, 1)
    assert {k: (v.dtype, v.shape[0]) for k, v in features.items()} == {
        k: (v.dtype, 1) for k, v in reference(chains[0]).items()
    }


def test_the_reference_builds_the_lm_input_chain_by_chain():
    """transformers' _compute_lm_hidden_states on a complex's features: [BOS] chain [EOS] per
    chain, in the order given, attention kept within a chain, each token's LM state its own."""
    chains = ["MKTA", "GS", "MKTA"]
    features = {k: torch.tensor(v) for k, v in protein_features(chains).items()}
    config = EsmFold2Config.from_dict(tiny_fold_config())
    seen = {}

    class Backbone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, output_hidden_states, **masks):
            seen.update(input_ids=input_ids, **masks)
            positions = torch.arange(input_ids.shape[1], dtype=torch.float32)
            return types.SimpleNamespace(hidden_states=(positions[None, :, None].expand(1, -1, 2),))

    model = types.SimpleNamespace(config=config, esmc=Backbone(), device=torch.device("cpu"))
    states = EsmFold2Model._compute_lm_hidden_states(
        model,
        features["input_ids"],
        features["asym_id"],
        features["residue_index"],
        features["mol_type"],
        features["attention_mask"],
    )
    bos, eos = config.esmc_config.bos_token_id, config.esmc_config.eos_token_id
    ids = [[bos, *(TOKEN_TO_ID[c] for c in chain), eos] for chain in chains]
    assert seen["input_ids"][0].tolist() == [i for chain in ids for i in chain]
    assert seen["sequence_id"][0].tolist() == [n for n, chain in enumerate(ids) for _ in chain]
    # token t of chain c reads the LM position after its chain's BOS
    expected = [start + 1 + i for start, chain in zip(np.cumsum([0, 6, 4]), chains) for i in range(len(chain))]
    assert states[0, :, 0, 0].tolist() == expected


@pytest.mark.parametrize(
    "chains,message",
    [
        ("", "chain A is empty"),
        (["MKT", ""], "chain B is empty"),
        ([], "no chains to fold"),
        (b"MKT", "expected a chain .* got bytes"),
        ("mkt", "chain A: cannot fold lower-case 'm' at position 1, .*write residues in upper case"),
        ("MK1T", "chain A: cannot fold '1' at position 3: the fold takes the 20 amino acids and X .*no nucleic acids"),
        (["MKT", "GS-HM"], "chain B: cannot fold gap '-' at position 3: remove alignment gaps"),
        ("MKT|GSH", r"chain A: cannot fold chain break '\|' at position 4: give the chains as a list"),
        ("MKT*", r"chain A: cannot fold stop '\*' at position 4"),
        (
            ["MKT", {"ccd": "ATP"}],
            "chain B: expected a string of one-letter amino acids, got dict.*no nucleic acids, ligands",
        ),
        (
            ["MKT", "ACGTTGCAACGTTGCA"],
            "chain B reads as DNA or RNA .16 letters, 100% of them A C G T U N.: this release folds protein",
        ),
        ("ACGUUGCAACGNNAG", "chain A reads as DNA or RNA"),
        ("M" + "1" * 12, "and 2 more"),
    ],
)
def test_what_the_fold_cannot_take_is_refused_by_chain_and_position(chains, message):
    with pytest.raises(FoldError, match=message):
        protein_features(chains)


@pytest.mark.parametrize("chain", ["AAAAAAAAAAAAAAA", "GAGAGAGAGAGAGAGS", "ACGT", "ACGTACGTAQ"])
def test_protein_like_chains_of_nucleotide_letters_fold(chain):
    assert protein_features(chain)["res_type"].shape == (1, len(chain))


def test_chains_from_text_splits_at_esmcs_chain_break():
    assert chains_from_text("MKTAYIAK|GSHM") == ["MKTAYIAK", "GSHM"]
    assert chains_from_text(" mktayiak*|gshmX*\n") == ["MKTAYIAK", "GSHMX"]  # as every esmc-mlx input reads text
    (record,) = parse_fasta(">dimer\nMKTAYIAK|\nmktayiak\n")
    assert chains_from_text(record.sequence, record.id) == ["MKTAYIAK", "MKTAYIAK"]
    with pytest.raises(FoldError, match=r"':' at position 9: esmc-mlx separates chains with '\|'"):
        chains_from_text("MKTAYIAK:GSHM")
    with pytest.raises(FoldError, match="dimer, chain B is empty"):
        chains_from_text("MKT|", "dimer")
    with pytest.raises(FoldError, match="chain C: cannot fold '1' at position 2"):
        chains_from_text("MKT|GSH|W1")
    with pytest.raises(FoldError, match="expected the chains as text, got list"):
        chains_from_text(["MKT"])
