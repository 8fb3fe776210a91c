from __future__ import annotations

import random

import pytest
from conftest import requires_torch

from esmc_mlx import ESMCTokenizer, TokenizerError
from esmc_mlx.errors import EsmcMlxError
from esmc_mlx.tasks.scoring import encode
from esmc_mlx.testing import random_sequences
from esmc_mlx.vocab import TOKEN_TO_ID, check_sequence, split_tokens


def test_ids_equal_transformers_on_200_random_sequences():
    requires_torch()
    from transformers import EsmcTokenizer

    theirs, mine = EsmcTokenizer(), ESMCTokenizer()
    alphabet = "ACDEFGHIKLMNPQRSTVWYXBZUO.-|"
    seqs = random_sequences(200, 1, 300, seed=7, alphabet=alphabet)
    seqs = [s[:5] + "<mask>" + s[5:] if i % 3 == 0 else s for i, s in enumerate(seqs)]
    for s in seqs:
        assert mine.encode(s) == theirs(s)["input_ids"], s
    batch_theirs = theirs(seqs[:10], padding=True)
    batch_mine = mine(seqs[:10], return_tensors=None)
    assert batch_mine["input_ids"] == batch_theirs["input_ids"]
    assert batch_mine["attention_mask"] == batch_theirs["attention_mask"]


def test_vocabulary_matches_transformers():
    requires_torch()
    from transformers.models.esmc.tokenization_esmc import SEQUENCE_VOCAB

    assert list(ESMCTokenizer.vocab) == SEQUENCE_VOCAB


def test_lower_case_is_accepted():
    tok = ESMCTokenizer()
    assert tok.encode("mkv") == tok.encode("MKV")


def test_unknown_characters_are_named_with_positions():
    with pytest.raises(TokenizerError, match=r"'J' at position 3.*'1' at position 5"):
        ESMCTokenizer().encode("MKJV1", name="seq1")
    with pytest.raises(TokenizerError, match="<foo>"):
        ESMCTokenizer().encode("MK<foo>")


def test_saved_files_load_in_transformers(tmp_path):
    requires_torch()
    from transformers import AutoTokenizer

    ESMCTokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("MKV<mask>|A")["input_ids"] == ESMCTokenizer().encode("MKV<mask>|A")
    assert loaded.mask_token_id == 32


def test_fast_paths_agree_with_the_per_character_rule():
    """check_sequence and encode read plain ASCII sequences with one regex / one numpy lookup;
    every answer, error messages included, must be the per-character one of split_tokens."""

    def answer(f, s):
        try:
            return f(s)
        except EsmcMlxError as e:
            return str(e)

    tok = ESMCTokenizer()
    rng = random.Random(0)
    alphabet = "LAGVSERTIDPKQNFYMHWCXBUZO.-|lagvxbuzo*<>mask\n é\u0131ß1"
    cases = ["", "<mask>AK", "a<cls>", "\u0131A", "ßA", "MKV\n"]
    cases += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(5000)]
    for s in cases:
        assert answer(lambda x: check_sequence(x, "r"), s) == answer(
            lambda x: "".join(split_tokens(x, "r", label="record")), s
        )
        slow = answer(lambda x: [0, *(TOKEN_TO_ID[t] for t in split_tokens(x, "r", special_tokens=True)), 2], s)
        assert answer(lambda x: tok.encode(x, name="r"), s) == slow, s


def test_odd_inputs_are_tokenizer_errors():
    """Before: tok([]) failed in max(), tok([5]) with 'int' object has no attribute 'isascii',
    decode([100]) with IndexError and decode([-1]) returned the last token of the vocabulary."""
    tok = ESMCTokenizer()
    assert tok([], return_tensors="np")["input_ids"].shape == (0, 0)
    for call, message in (
        (lambda: tok(None), "got NoneType"),
        (lambda: tok([5]), "expected a string of residues, got int"),
        (lambda: tok.decode([100]), "token id 100 is not in the vocabulary"),
        (lambda: tok.decode([-1]), "token id -1 is not in the vocabulary"),
    ):
        with pytest.raises(TokenizerError, match=message):
            call()
    assert tok.decode([0, 20, 2]) == "<cls>M<eos>"


def test_a_bad_sequence_in_a_list_is_named_by_its_position():
    """Without names, the bad item of several is named by its 1-based position (it was only
    'sequence: empty sequence'); a lone sequence needs none; given names still win."""
    tok = ESMCTokenizer()
    with pytest.raises(TokenizerError, match=r"^sequence '3': invalid character '@' at position 2"):
        tok(["MKT", "MK", "M@K"])
    with pytest.raises(TokenizerError, match=r"^sequence '2': empty sequence"):
        encode(["MKV", ""])
    with pytest.raises(TokenizerError, match=r"^sequence: invalid character '@'"):
        tok("M@K")
    with pytest.raises(TokenizerError, match=r"^sequence 'b': empty sequence"):
        tok(["MKV", ""], names=["a", "b"])


def test_return_tensors_and_names_are_checked():
    """return_tensors="pt" (transformers' spelling) returned numpy arrays without a word; names
    shorter than the sequences failed with IndexError, pad_to_multiple_of=-4 in numpy."""
    tok = ESMCTokenizer()
    for call, message in (
        (lambda: tok(["MKT"], return_tensors="pt"), "return_tensors 'pt'"),
        (lambda: tok(["MKT", "MK"], names=["a"]), "1 names for 2 sequences"),
        (lambda: tok.pad([[0, 5, 2]], pad_to_multiple_of=-4), "pad_to_multiple_of must be"),
    ):
        with pytest.raises(TokenizerError, match=message):
            call()
    assert tok(["MKT"], return_tensors="np")["input_ids"].shape == (1, 5)


def test_non_ascii_letters_are_not_residues():
    """'ı' (dotless i) and 'ſ' (long s) upper-case to I and S in Python: a sequence holding
    them was read as those residues without a word (tokenizer, FASTA, scoring alike)."""
    tok = ESMCTokenizer()
    for text, bad in (("MKı", "'ı' at position 3"), ("Mſ", "'ſ' at position 2")):
        for call in (tok.encode, check_sequence, split_tokens):
            with pytest.raises(TokenizerError, match=bad):
                call(text)
    assert tok.encode("mkt") == [0, 20, 15, 11, 2]  # ASCII lower case still reads as upper
