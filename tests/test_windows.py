"""Windows over long sequences: each distinct window computed once (scan, score, pppl), the
wt-marginal windows shared by all sites (``unmasked_window``), and the scores those windows give
against a forward pass of the model over the window itself. No torch: the packaged esmc-tiny."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from esmc_mlx import load
from esmc_mlx.convert import convert
from esmc_mlx.runtime.tokenizer import ESMCTokenizer
from esmc_mlx.tasks.mutations import AMINO_ACIDS_20, all_singles
from esmc_mlx.tasks.scan import scan
from esmc_mlx.tasks.scoring import (
    DEFAULT_WINDOW,
    pseudo_perplexity,
    score_mutations,
    unmasked_window,
    window_bounds,
)
from esmc_mlx.testing import random_sequences
from tests.test_scoring import Counting, StubModel

TOK = ESMCTokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(convert("tiny", tmp_path_factory.mktemp("tiny") / "fp32", progress=False))[0]


def logp_rows(model, sequence: str, masked=()) -> np.ndarray:
    """(L, 64) log_softmax rows of one forward pass over ``sequence`` with ``masked`` masked."""
    ids = TOK.encode_array(sequence)[None].copy()
    for p in masked:
        ids[0, p + 1] = TOK.mask_token_id
    logits = model(mx.array(ids)).logits.astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0, 1:-1].astype(np.float64)


def ratios(rows: np.ndarray, wt: str) -> np.ndarray:
    aa = [TOK.token_to_id[a] for a in AMINO_ACIDS_20]
    return rows[aa] - rows[TOK.token_to_id[wt]]


@pytest.mark.parametrize("length, width", [(3000, 2046), (100, 20), (61, 20), (21, 20), (50, 3), (40, 1)])
def test_unmasked_windows_hold_their_site_with_context_on_both_sides(length, width):
    starts = set()
    for site in range(length):
        start, end = unmasked_window(site, length, width)
        assert 0 <= start <= site < end <= length and end - start == width
        # at least width // 4 residues either side, or the sequence's end
        assert site - start >= min(site, width // 4) and end - 1 - site >= min(length - 1 - site, width // 4)
        starts.add(start)
    stride = max(1, width // 2)
    assert len(starts) == math.ceil((length - width) / stride) + 1  # windows every width/2 residues
    assert unmasked_window(5, length, length) == unmasked_window(5, length, None) == (0, length)


@pytest.mark.filterwarnings("ignore::esmc_mlx.tasks.scoring.LongSequenceWarning")
def test_a_long_wt_marginal_scan_runs_each_window_once():
    wt = random_sequences(1, 3000, 3000, seed=1)[0]
    stub = StubModel()
    result = scan(stub, wt, method="wt_marginal")  # default window: 2046
    assert stub.rows == 2 and stub.calls == result.passes == 1  # windows at 0 and 954, one pass
    assert result.scores.shape == (3000, 20)
    stub = StubModel()
    scan(stub, wt, method="wt_marginal", window=500)
    assert stub.rows == math.ceil((3000 - 500) / 250) + 1  # 11 windows
    stub = StubModel()
    scan(stub, wt, method="masked_marginal", batch_size=64)
    assert stub.rows == 3000 and stub.calls == math.ceil(3000 / 64)  # a masked copy per residue
    # score: the unmasked windows that the mutated sites need, each once
    stub = StubModel()
    mutants = [f"{wt[p]}{p + 1}A" for p in (3, 10, 1500, 2990, 2999) if wt[p] != "A"]
    score_mutations(stub, wt, mutants, methods=["wt_marginal"])
    assert stub.rows == len({unmasked_window(int(m[1:-1]) - 1, 3000, DEFAULT_WINDOW) for m in mutants}) == 2


def test_a_sequence_given_twice_is_computed_once(model):
    seqs = random_sequences(2, 12, 12, seed=2)
    counting = Counting(model)
    twice = pseudo_perplexity(counting, [seqs[0], seqs[1], seqs[0]], batch_size=64)
    assert counting.rows == 24  # 12 masked copies of each distinct sequence
    np.testing.assert_allclose(twice[0], twice[2], rtol=0, atol=0)
    np.testing.assert_allclose(twice[:2], pseudo_perplexity(model, seqs), rtol=1e-6)


@pytest.mark.slow  # a forward pass per masked site: over 5 s on the 2-core host
def test_windowed_scans_read_the_window_they_name(model):
    """Each row of a windowed scan is the model's own output over that row's window: masked
    copies over the window centred on their site, wt-marginal over the shared
    window; where the shared window is the centred one (the ends), the scores are the ones a
    window centred on each site gives."""
    wt = random_sequences(1, 40, 40, seed=3)[0]
    width = 16
    masked = scan(model, wt, method="masked_marginal", window=width, batch_size=16)
    unmasked = scan(model, wt, method="wt_marginal", window=width)
    assert unmasked.passes == 1
    centred_same = 0
    for p in range(len(wt)):
        s, e = window_bounds(p, len(wt), width)
        want = ratios(logp_rows(model, wt[s:e], [p - s])[p - s], wt[p])
        np.testing.assert_allclose(masked.scores[p], want, atol=1e-5)
        s, e = unmasked_window(p, len(wt), width)
        want = ratios(logp_rows(model, wt[s:e])[p - s], wt[p])
        np.testing.assert_allclose(unmasked.scores[p], want, atol=1e-5)
        if (s, e) == window_bounds(p, len(wt), width):
            centred_same += 1
    assert centred_same >= width  # the first and last width/2 sites, and the shared windows' centres
    # within one window the scan is the whole sequence's one-pass scan
    short = wt[:width]
    np.testing.assert_allclose(
        scan(model, short, method="wt_marginal", window=width).scores,
        scan(model, short, method="wt_marginal", window=None).scores,
        atol=0,
    )
    # score_mutations reads the same rows as the scan
    singles = all_singles(wt)[::13]
    got = score_mutations(model, wt, singles, methods=["wt_marginal"], window=width)["wt_marginal"]
    by_variant = {f"{w}{p}{m}": v for p, w, m, v, _ in unmasked.variants()}
    np.testing.assert_allclose(got, [by_variant[m] for m in singles], atol=1e-5)
