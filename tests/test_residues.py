"""One residue policy for score, scan, pseudo-perplexity and embed: the non-standard residues
X B Z U O are named in one warning and skipped (not scored, not pooled) unless kept; and one
trailing stop codon '*' is read wherever a sequence is. The packaged esmc-tiny, no torch."""

from __future__ import annotations

import csv
import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from esmc_mlx import load
from esmc_mlx.cli import main as cli
from esmc_mlx.convert import convert
from esmc_mlx.errors import JobError, SequenceError
from esmc_mlx.runtime.tokenizer import ESMCTokenizer
from esmc_mlx.tasks.heatmap import colour_limit
from esmc_mlx.tasks.jobs import embed_fasta
from esmc_mlx.tasks.scoring import NonstandardResidueWarning, pseudo_perplexity, score_mutations
from esmc_mlx.vocab import check_sequence

TOK = ESMCTokenizer()
# X at 9 and B at 14 (1-based), as a protein from a sequencing project has them
WT = "MKTAYIAKXRQISBVKSHFSRQ"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return convert("tiny", tmp_path_factory.mktemp("tiny") / "fp32", progress=False)


@pytest.fixture(scope="module")
def model(tiny):
    return load(tiny)[0]


def masked_logp(model, sequence: str) -> np.ndarray:
    """log p(x_i | x with i masked) for every residue, from one batch of L masked copies."""
    ids = np.tile(TOK.encode_array(sequence), (len(sequence), 1))
    ids[np.arange(len(sequence)), np.arange(len(sequence)) + 1] = TOK.mask_token_id
    logits = model(mx.array(ids)).logits.astype(mx.float32)
    logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return np.array([logp[i, i + 1, TOK.token_to_id[c]] for i, c in enumerate(sequence)], dtype=np.float64)


def test_score_skips_mutants_at_nonstandard_residues_and_says_so(model):
    mutants = ["X9A", "B14A", "K2A", "Q11W:S13A", "X9A:K2A"]
    with pytest.warns(
        NonstandardResidueWarning, match=r"the wild type holds 2 non-standard residues \(X at 9, B at 14"
    ):
        skipped = score_mutations(model, WT, mutants, methods=["masked_marginal", "wt_marginal"])
    assert skipped.skipped == [0, 1, 4]
    kept = score_mutations(model, WT, mutants, methods=["masked_marginal", "wt_marginal"], keep_nonstandard=True)
    assert kept.skipped == []
    for method in ("masked_marginal", "wt_marginal"):
        assert np.isnan(skipped[method][[0, 1, 4]]).all() and np.isfinite(kept[method]).all()
        # the others are what they were: X and B stay in the context either way
        np.testing.assert_allclose(skipped[method][[2, 3]], kept[method][[2, 3]], atol=1e-6)
    with pytest.warns(NonstandardResidueWarning, match=r"X at 108, B at 113"):  # numbered as the mutants are
        numbered = score_mutations(model, WT, ["K101A", "X108A"], methods=["wt_marginal"], offset=100)
    assert numbered.skipped == [1] and np.isfinite(numbered["wt_marginal"][0])


def test_pseudo_perplexity_leaves_nonstandard_residues_out(model):
    standard = [i for i, c in enumerate(WT) if c not in "XBZUO"]
    logp = masked_logp(model, WT)
    with pytest.warns(NonstandardResidueWarning, match="left out of its pseudo-perplexity"):
        skipped = pseudo_perplexity(model, WT)[0]
    kept = pseudo_perplexity(model, WT, keep_nonstandard=True)[0]
    assert skipped == pytest.approx(np.exp(-logp[standard].mean()), rel=1e-5)
    assert kept == pytest.approx(np.exp(-logp.mean()), rel=1e-5)
    # score's pppl of the wild type follows the same policy
    with pytest.warns(NonstandardResidueWarning):
        scored = score_mutations(model, WT, ["K2A"], methods=["pppl"])
    assert scored.wt_pppl == pytest.approx(skipped, rel=1e-5)
    with pytest.raises(SequenceError, match="only gaps or chain breaks, or non-standard residues"):
        with pytest.warns(NonstandardResidueWarning):
            pseudo_perplexity(model, "XX-B")


def test_scan_leaves_nonstandard_positions_out(model):
    with pytest.warns(NonstandardResidueWarning, match="their positions are left out of the scan"):
        skipped = model.scan(WT)
    kept = model.scan(WT, keep_nonstandard=True)
    assert [int(p) for p in kept.positions] == list(range(len(WT)))
    assert [int(p) for p in skipped.positions] == [p for p in range(len(WT)) if p not in (8, 13)]
    rows = {int(p): k for k, p in enumerate(kept.positions)}
    np.testing.assert_allclose(skipped.scores, kept.scores[[rows[int(p)] for p in skipped.positions]], atol=1e-6)
    assert "X9" not in {f"{w}{p}" for p, w, *_ in skipped.variants()}


def test_heatmap_scale_comes_from_standard_residues_with_arrows_when_clipped():
    rng = np.random.default_rng(0)
    scores = (0.5 * rng.choice([-1, 1], size=(30, 20))).astype(np.float32)
    wild_type = "M" * 10 + "X" + "A" * 19
    scores[10] = 9.0  # a kept X row, scored against no real residue
    limit, extend = colour_limit(scores, wild_type)
    assert limit == pytest.approx(0.5)  # not stretched by the X row
    assert extend == "max"  # the X row goes beyond the scale: an arrow at the top
    scores[3, 4] = -7.0
    assert colour_limit(scores, wild_type)[1] == "both"
    inside = np.full((5, 20), 0.5, np.float32)
    assert colour_limit(inside, "MKTAY") == (0.5, "neither")


def test_cli_warns_once_and_leaves_skipped_rows_empty(tiny, tmp_path):
    muts = tmp_path / "m.csv"
    muts.write_text("mutant,DMS_score\nX9A,1\nK2A,2\nQ11W,3\nS13A,4\n")
    args = ["score", str(tiny), "--sequence", WT, "--mutations", str(muts), "--method", "wt-marginal", "--no-progress"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    warning = [line for line in result.output.splitlines() if line.startswith("Warning:")]
    assert len(warning) == 1 and "X at 9, B at 14" in warning[0] and "--keep-nonstandard" in warning[0]
    assert "UserWarning" not in result.output and "warnings.warn" not in result.output  # no source line
    assert "Scored 3 mutants" in result.output and "Left 1 mutant at non-standard residues unscored" in result.output
    rows = list(csv.DictReader(open(tmp_path / "m.scored.csv")))
    assert rows[0]["wt_marginal"] == "" and all(r["wt_marginal"] for r in rows[1:])
    assert "Spearman wt_marginal vs DMS_score" in result.output and "(n=3)" in result.output
    result = CliRunner().invoke(cli, [*args, "--keep-nonstandard", "-o", str(tmp_path / "kept.csv")])
    assert result.exit_code == 0 and "Warning:" not in result.output, result.output
    assert all(r["wt_marginal"] for r in csv.DictReader(open(tmp_path / "kept.csv")))


@pytest.mark.filterwarnings("ignore::esmc_mlx.tasks.scoring.NonstandardResidueWarning")  # after the first
def test_embed_job_records_the_policy_and_resumes_only_with_it(model, tmp_path):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{WT}\n>b\nMKTAYIAK\n")
    with pytest.warns(NonstandardResidueWarning, match=r"1 of 2 sequences .*'a': X at 9, B at 14"):
        embed_fasta(model, fasta, tmp_path / "skip")
    manifest = json.loads((tmp_path / "skip" / "manifest.json").read_text())
    assert manifest["keep_nonstandard"] is False and "left out" in manifest["pooling"]
    with pytest.raises(JobError, match="keep_nonstandard: False there, True now"):
        embed_fasta(model, fasta, tmp_path / "skip", keep_nonstandard=True)
    # a store written before the policy pooled every residue: it resumes only keeping them
    del manifest["keep_nonstandard"]
    (tmp_path / "skip" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(JobError, match="keep_nonstandard: True there, False now"):
        embed_fasta(model, fasta, tmp_path / "skip")
    # sequences of standard residues pool the same either way: their store resumes with either setting
    fasta.write_text(">b\nMKTAYIAK\n>c\nGSHMSLFDKLG\n")
    embed_fasta(model, fasta, tmp_path / "plain")
    assert embed_fasta(model, fasta, tmp_path / "plain", keep_nonstandard=True).skipped == 2
    fasta.write_text(">none\nXXBZ\n")
    with pytest.raises(SequenceError, match="'none' holds only non-standard residues"):
        embed_fasta(model, fasta, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_trailing_stop_is_read_wherever_a_sequence_is(model, tiny, tmp_path):
    assert check_sequence("mktay*") == "MKTAY"
    assert TOK.encode("MKTAY*") == TOK.encode("MKTAY")
    np.testing.assert_array_equal(model.embed("MKTAYIAK*").mean, model.embed("MKTAYIAK").mean)
    with pytest.raises(SequenceError, match=r"'\*' at position 3"):  # only the last one is a stop
        check_sequence("MK*AY")
    with pytest.raises(SequenceError, match=r"'\*' at position 6"):  # one stop, not two
        check_sequence("MKTAY**")
    muts = tmp_path / "m.csv"
    muts.write_text("mutant\nK2A\n")
    result = CliRunner().invoke(
        cli, ["score", str(tiny), "--sequence", "MKTAYIAK*", "--mutations", str(muts), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    fasta = tmp_path / "stop.fa"
    fasta.write_text(">p\nMKTAYIAK*\n")
    result = CliRunner().invoke(cli, ["scan", str(tiny), "--sequence", "MKTAYIAK*", "-o", str(tmp_path / "s")])
    assert result.exit_code == 0 and "Scanned sequence: 8 residues" in result.output, result.output
