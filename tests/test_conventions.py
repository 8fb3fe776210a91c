"""Scoring conventions against a direct torch computation with transformers' EsmcForMaskedLM:
joint masking of multi-mutants, ProteinGym-style windows over long sequences, the warning past
the trained length, pseudo-perplexity of several sequences sharing passes."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
from transformers import EsmcTokenizer

from esmc_mlx import load
from esmc_mlx.errors import ScoringError
from esmc_mlx.tasks.scoring import pseudo_perplexity, score_mutations, unmasked_window, window_bounds
from esmc_mlx.testing import random_sequences

HF_TOK = EsmcTokenizer()
WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"


@pytest.fixture(scope="module")
def model(converted):
    return load(converted)[0]


def aa(c):
    return HF_TOK.convert_tokens_to_ids(c)


def torch_logp(ref, sequence, masked=()):
    """(L, 64) log_softmax rows of ``sequence`` with residues ``masked`` (0-based) masked."""
    ids = torch.tensor(HF_TOK(sequence)["input_ids"]).long()[None]
    for p in masked:
        ids[0, p + 1] = HF_TOK.mask_token_id
    with torch.no_grad():
        return torch.log_softmax(ref(input_ids=ids).logits.float(), -1)[0, 1 : len(sequence) + 1].numpy()


def parse(m):
    return [(s[0], int(s[1:-1]) - 1, s[-1]) for s in m.split(":")]


def test_joint_masking_matches_torch(model, reference_model):
    mutants = ["K2P:Q11W", "Q33A:E24F:R10C", "A4G", "WT"]
    got = score_mutations(model, WT, mutants, methods=["masked_marginal"], multi="joint", batch_size=3)
    summed = score_mutations(model, WT, mutants, methods=["masked_marginal"], multi="sum")
    for k, m in enumerate(mutants):
        subs = [] if m == "WT" else parse(m)
        rows = torch_logp(reference_model, WT, [p for _, p, _ in subs])
        want = sum(rows[p, aa(b)] - rows[p, aa(a)] for a, p, b in subs)
        assert got["masked_marginal"][k] == pytest.approx(want, abs=1e-4)
    assert got["masked_marginal"][2] == pytest.approx(summed["masked_marginal"][2], abs=1e-6)  # single site
    assert abs(got["masked_marginal"][1] - summed["masked_marginal"][1]) > 1e-3  # joint is not the sum


def test_window_bounds_follow_proteingym():
    assert window_bounds(5, 100, 200) == (0, 100)
    assert window_bounds(5, 100, 40) == (0, 40)  # near the start: slid inwards
    assert window_bounds(97, 100, 40) == (60, 100)  # near the end
    assert window_bounds(50, 100, 40) == (30, 70)  # centred
    assert window_bounds(50, 100, None) == (0, 100)


def test_windows_match_torch_on_the_window(model, reference_model):
    wt = random_sequences(1, 60, 60, seed=11)[0]
    mutants = [f"{wt[3]}4A", f"{wt[30]}31C", f"{wt[58]}59W", f"{wt[29]}30D:{wt[35]}36E"]
    width = 20
    got = score_mutations(model, wt, mutants, methods=["masked_marginal", "wt_marginal"], window=width)
    joint = score_mutations(model, wt, mutants, methods=["masked_marginal"], window=width, multi="joint")
    for k, m in enumerate(mutants):
        subs = parse(m)
        mm = wtm = 0.0
        for a, p, b in subs:
            s, e = window_bounds(p, len(wt), width)
            rows = torch_logp(reference_model, wt[s:e], [p - s])
            mm += rows[p - s, aa(b)] - rows[p - s, aa(a)]
            s, e = unmasked_window(p, len(wt), width)  # wt-marginal: the shared windows
            rows = torch_logp(reference_model, wt[s:e])
            wtm += rows[p - s, aa(b)] - rows[p - s, aa(a)]
        assert got["masked_marginal"][k] == pytest.approx(mm, abs=1e-4)
        assert got["wt_marginal"][k] == pytest.approx(wtm, abs=1e-4)
    # joint: one window centred on the middle of the sites (30 and 36 -> 33)
    s, e = window_bounds((29 + 35) // 2, len(wt), width)
    rows = torch_logp(reference_model, wt[s:e], [29 - s, 35 - s])
    want = rows[29 - s, aa("D")] - rows[29 - s, aa(wt[29])] + rows[35 - s, aa("E")] - rows[35 - s, aa(wt[35])]
    assert joint["masked_marginal"][3] == pytest.approx(want, abs=1e-4)
    # a window changes the scores (the test is not vacuous), and wider than the sequence does not
    whole = score_mutations(model, wt, mutants, methods=["masked_marginal"], window=None)
    assert np.abs(whole["masked_marginal"] - got["masked_marginal"]).max() > 1e-3
    same = score_mutations(model, wt, mutants, methods=["masked_marginal"], window=60)
    np.testing.assert_allclose(same["masked_marginal"], whole["masked_marginal"], atol=1e-6)
    with pytest.raises(ScoringError, match="span more than the window"):
        score_mutations(model, wt, [f"{wt[0]}1A:{wt[50]}51A"], methods=["masked_marginal"], window=20, multi="joint")


def test_pppl_in_windows_matches_torch(model, reference_model):
    seqs = random_sequences(2, 30, 30, seed=12)
    width = 16
    got = pseudo_perplexity(model, seqs, window=width, batch_size=7)
    for seq, value in zip(seqs, got):
        logp = []
        for p in range(len(seq)):
            s, e = window_bounds(p, len(seq), width)
            logp.append(torch_logp(reference_model, seq[s:e], [p - s])[p - s, aa(seq[p])])
        assert value == pytest.approx(math.exp(-np.mean(logp)), rel=1e-4)


def test_pppl_of_several_sequences_shares_passes(model):
    from tests.test_scoring import Counting

    seqs = random_sequences(3, 10, 10, seed=13)
    counting = Counting(model)
    together = pseudo_perplexity(counting, seqs, batch_size=15)
    assert counting.calls == 2  # 30 masked copies of 3 sequences, 15 a pass
    alone = [pseudo_perplexity(model, s)[0] for s in seqs]
    np.testing.assert_allclose(together, alone, rtol=1e-5)


def test_warning_past_the_trained_length():
    from tests.test_scoring import StubModel

    wt = random_sequences(1, 2100, 2100, seed=14)[0]
    with pytest.warns(UserWarning, match="longer than the 2048 tokens"):
        r = score_mutations(
            StubModel(), wt, [f"{wt[5]}6A", f"{wt[2000]}2001A"], methods=["masked_marginal"], batch_size=4
        )
    assert r.passes == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score_mutations(StubModel(), wt[:2046], [f"{wt[5]}6A"], methods=["masked_marginal"])
