"""Variant scores, pseudo-perplexity and embeddings against the same computation in torch with
transformers' EsmcForMaskedLM; batching, resumable embedding jobs and bad input."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from esmc_mlx import load
from esmc_mlx.cli import main as cli
from esmc_mlx.errors import EsmcMlxError, FastaError, JobError, MutationError, ScoringError
from esmc_mlx.tasks.fasta import parse_fasta, read_fasta
from esmc_mlx.tasks.jobs import embed_fasta, score_csv
from esmc_mlx.tasks.mutations import all_singles, parse_mutant
from esmc_mlx.tasks.scoring import NonstandardResidueWarning, length_batches, pseudo_perplexity, score_mutations
from esmc_mlx.tasks.stats import spearman
from esmc_mlx.tasks.store import read_embeddings
from esmc_mlx.testing import random_sequences

WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
MUTANTS = ["A4G", "K2P:Q11W", "WT", "M1L", "Q33A:E24F:R10C", "T3T"]
try:  # the FASTA, mutation and batching tests run without torch; the rest skip (conftest)
    import torch
    from transformers import EsmcTokenizer

    HF_TOK = EsmcTokenizer()
except ImportError:
    torch = HF_TOK = None


@pytest.fixture(scope="module")
def model(converted):
    return load(converted)[0]


class Counting:
    """Counts forward passes and rows; optionally fails after ``fail_after`` passes."""

    def __init__(self, model, fail_after=None):
        self.model, self.fail_after, self.calls, self.rows = model, fail_after, 0, 0

    def __call__(self, input_ids, **kwargs):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls += 1
        self.rows += input_ids.shape[0]
        return self.model(input_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


# --- the torch reference: same formulas, written out plainly ---------------------------------


def torch_log_probs(ref, sequence, mask_positions=None):
    """log_softmax over all 64 logits. With mask_positions: one copy per position, that
    position masked, its row read -> (n, 64). Without: one unmasked pass -> (L, 64)."""
    ids = torch.tensor(HF_TOK(sequence)["input_ids"]).long()[None]
    with torch.no_grad():
        if mask_positions is None:
            return torch.log_softmax(ref(input_ids=ids).logits.float(), -1)[0, 1:-1].numpy()
        pos = torch.tensor(mask_positions) + 1
        batch = ids.repeat(len(pos), 1)
        batch[torch.arange(len(pos)), pos] = HF_TOK.mask_token_id
        return torch.log_softmax(ref(input_ids=batch).logits.float(), -1)[torch.arange(len(pos)), pos].numpy()


def torch_scores(ref, sequence, mutants):
    aa = HF_TOK.convert_tokens_to_ids
    masked = torch_log_probs(ref, sequence, list(range(len(sequence))))
    unmasked = torch_log_probs(ref, sequence)
    out = {"masked_marginal": [], "wt_marginal": [], "pppl": []}
    for m in mutants:
        sites = [] if m == "WT" else [(s[0], int(s[1:-1]) - 1, s[-1]) for s in m.split(":")]
        out["masked_marginal"].append(sum(masked[i, aa(b)] - masked[i, aa(a)] for a, i, b in sites))
        out["wt_marginal"].append(sum(unmasked[i, aa(b)] - unmasked[i, aa(a)] for a, i, b in sites))
        variant = list(sequence)
        for _, i, b in sites:
            variant[i] = b
        variant = "".join(variant)
        lp = torch_log_probs(ref, variant, list(range(len(variant))))
        out["pppl"].append(np.exp(-np.mean([lp[i, aa(c)] for i, c in enumerate(variant)])))
    return {k: np.array(v, dtype=np.float64) for k, v in out.items()}


# --- scores ----------------------------------------------------------------------------------


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_scores_match_torch(model, reference_model):
    got = model.score_mutations(WT, MUTANTS, methods=["masked_marginal", "wt_marginal", "pppl"], batch_size=7)
    want = torch_scores(reference_model, WT, MUTANTS)
    for method in want:
        np.testing.assert_allclose(got[method], want[method], rtol=1e-4, atol=1e-4, err_msg=method)
    assert got["masked_marginal"][2] == 0 and got["masked_marginal"][5] == 0  # WT, synonymous
    assert got.wt_pppl == pytest.approx(got["pppl"][2])
    # the scores are not trivially equal across methods
    assert np.abs(got["masked_marginal"] - got["wt_marginal"]).max() > 1e-2


def test_pseudo_perplexity_is_exp_of_transformers_mlm_loss(model, reference_model):
    """Full-vocabulary log_softmax: PPPL equals exp(loss) of transformers' MLM head on the
    L masked copies (CrossEntropy over all 64 logits)."""
    seqs = ["MKTAYIAKQRQISF", "GSHMSLFDKLGGLKVTEAQ"]
    got = pseudo_perplexity(model, seqs, batch_size=5)
    for seq, value in zip(seqs, got):
        ids = torch.tensor(HF_TOK(seq)["input_ids"]).long()[None].repeat(len(seq), 1)
        labels = torch.full_like(ids, -100)
        rows = torch.arange(len(seq))
        labels[rows, rows + 1] = ids[rows, rows + 1]
        ids[rows, rows + 1] = HF_TOK.mask_token_id
        with torch.no_grad():
            loss = reference_model(input_ids=ids, labels=labels).loss
        assert value == pytest.approx(float(torch.exp(loss)), rel=1e-4)


class StubModel:
    """Shapes of ESMC without its compute: counting passes of a 300-residue job stays cheap."""

    def __init__(self):

        import mlx.nn as nn

        from esmc_mlx.config import ESMCConfig

        self.config = ESMCConfig(hidden_size=8, num_attention_heads=1, num_hidden_layers=2, intermediate_size=32)
        self.lm_head = nn.Linear(8, 64)
        self.calls, self.rows = 0, 0

    def __call__(self, input_ids, **kwargs):
        from types import SimpleNamespace

        import mlx.core as mx

        self.calls += 1
        self.rows += input_ids.shape[0]
        return SimpleNamespace(last_hidden_state=mx.random.normal((*input_ids.shape, 8)))


def test_all_singles_of_300_residues_take_at_most_L_over_B_plus_1_passes():
    wt = random_sequences(1, 300, 300, seed=5)[0]
    singles = all_singles(wt)
    assert len(singles) == 300 * 19
    for batch_size in (1, 32, 64, 301):
        stub = StubModel()
        result = score_mutations(stub, wt, singles, methods=["masked_marginal", "wt_marginal"], batch_size=batch_size)
        assert stub.calls == result.passes <= 300 / batch_size + 1
        assert stub.rows == 301  # 300 masked copies and the unmasked wild type, in shared passes
        assert np.isfinite(result["masked_marginal"]).all() and np.isfinite(result["wt_marginal"]).all()


def test_batch_size_does_not_change_scores(model):
    wt = random_sequences(1, 40, 40, seed=6)[0]
    singles = all_singles(wt)[::7]
    a = score_mutations(model, wt, singles, methods=["masked_marginal", "wt_marginal"], batch_size=3)
    b = score_mutations(model, wt, singles, methods=["masked_marginal", "wt_marginal"], batch_size=64)
    assert (a.passes, b.passes) == (math.ceil((len({m[1:-1] for m in singles}) + 1) / 3), 1)
    for method in a.scores:
        np.testing.assert_allclose(a[method], b[method], atol=1e-5)


# --- embeddings --------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1, -1])
def test_embeddings_match_torch(model, reference_model, layer):
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "MK", "ACDEFGHIKLMNPQRSTVWYXBZUO", "GSHMSLFDKLG"]
    with pytest.warns(NonstandardResidueWarning, match=r"1 of 4 sequences .* '3': X at 21, B at 22, Z at 23"):
        got = model.embed(seqs, layer=layer, per_residue=True, batch_tokens=60)  # forces padded, mixed batches
    kept = model.embed(seqs, layer=layer, pools="mean,max", keep_nonstandard=True, batch_tokens=60)
    for i, seq in enumerate(seqs):
        with torch.no_grad():
            out = reference_model(
                input_ids=torch.tensor(HF_TOK(seq)["input_ids"]).long()[None], output_hidden_states=True
            )
        hidden = out.hidden_states[layer][0, 1:-1].numpy()
        standard = np.array([c not in "XBZUO" for c in seq])
        np.testing.assert_allclose(got.per_residue[i], hidden, rtol=1e-4, atol=1e-4)  # every residue's row
        np.testing.assert_allclose(got.mean[i], hidden[standard].mean(0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(kept.mean[i], hidden.mean(0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(kept.get("max")[i], hidden.max(0), rtol=1e-4, atol=1e-4)
    assert np.abs(got.mean[2] - kept.mean[2]).max() > 1e-3  # the policy changed the pooled value
    assert got.layer == (2 if layer == -1 else layer)
    with pytest.raises(ScoringError, match="out of range"):
        model.embed(seqs, layer=3)


def test_length_batches_bound_padded_tokens():
    lengths = [10, 300, 50, 52, 49, 8, 600]
    batches = length_batches(lengths, 200)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 200
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    # widths rounded up to a multiple of 32: 52, 50 and 49 count as 64 tokens each, so three
    # of them no longer fit 180 (3 x 52 = 156 did)
    groups = [[lengths[i] for i in b] for b in length_batches(lengths, 180)]
    assert groups == [[600], [300], [52, 50, 49], [10, 8]]
    groups = [[lengths[i] for i in b] for b in length_batches(lengths, 180, 32)]
    assert groups == [[600], [300], [52, 50], [49, 10], [8]]


def test_default_batch_tokens_follow_the_device(model, tmp_path, monkeypatch):
    """Without --batch-tokens, embedding batches hold 16384 padded tokens on a CUDA GPU and 4096
    elsewhere (docs/scoring.md has the measurements), in the API, the job and the CLI."""
    from esmc_mlx.tasks import jobs, scoring

    assert scoring.default_batch_tokens() == (16384 if scoring.backend() == "cuda" else 4096)
    seen, batches = [], scoring.length_batches

    def recorded(lengths, tokens, multiple=1):
        seen.append(tokens)
        return batches(lengths, tokens, multiple)

    monkeypatch.setattr(scoring, "length_batches", recorded)
    monkeypatch.setattr(jobs, "length_batches", recorded)
    seqs = random_sequences(3, 10, 20, seed=3)
    for device, expected in (("cpu", 4096), ("cuda", 16384), ("metal", 4096)):
        monkeypatch.setattr(scoring, "backend", lambda device=device: device)
        seen.clear()
        scoring.embed(model, seqs)
        embed_fasta(model, write_fasta(tmp_path / f"{device}.fa", seqs), tmp_path / device)
        assert seen == [expected, expected], device
        scoring.embed(model, seqs, batch_tokens=100)  # given: used as given
        assert seen[-1] == 100
    with pytest.raises(ScoringError, match="batch_tokens must be a positive integer"):
        scoring.embed(model, seqs, batch_tokens=0)  # refused, not replaced by the default


# --- resumable embedding job -------------------------------------------------------------------


def write_fasta(path, seqs, prefix="s"):
    path.write_text("".join(f">{prefix}{i} test record\n{s[:7]}\n{s[7:]}\n" for i, s in enumerate(seqs)))
    return path


def test_embed_job_resumes_without_recomputing(model, tmp_path):
    seqs = random_sequences(9, 4, 40, seed=11)
    fasta = write_fasta(tmp_path / "in.fa", seqs)
    full = embed_fasta(model, fasta, tmp_path / "full", per_residue=True, batch_tokens=64)
    assert (full.computed, full.skipped) == (9, 0)

    interrupted = Counting(model, fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        embed_fasta(interrupted, fasta, tmp_path / "resumed", per_residue=True, batch_tokens=64, flush_every=1)
    parts = list((tmp_path / "resumed" / "parts").glob("part-*.npz"))
    done = sum(len(np.load(p)["ids"]) for p in parts)
    # stored: the first batch; the second, queued while the first was copied out, is lost
    assert 0 < done < interrupted.rows < 9
    with pytest.raises(JobError, match="no completed"):
        read_embeddings(tmp_path / "resumed")

    counting = Counting(model)
    summary = embed_fasta(counting, fasta, tmp_path / "resumed", per_residue=True, batch_tokens=64)
    assert (summary.skipped, summary.computed) == (done, 9 - done)
    assert counting.rows == 9 - done  # no done ID computed again
    a, b = read_embeddings(tmp_path / "full"), read_embeddings(tmp_path / "resumed")
    assert a.ids == b.ids == [f"s{i}" for i in range(9)]
    np.testing.assert_allclose(b.mean, a.mean, atol=1e-5)
    np.testing.assert_allclose(b.residues, a.residues, atol=1e-5)
    assert b.per_residue("s3").shape == (len(seqs[3]), 128)
    assert not (tmp_path / "resumed" / "parts").exists()

    # done: nothing to do; a grown FASTA computes only its new record
    counting = Counting(model)
    assert embed_fasta(counting, fasta, tmp_path / "resumed", per_residue=True).computed == 0
    assert counting.calls == 0
    assert not (tmp_path / "resumed" / "parts").exists()  # was left behind, empty
    grown = write_fasta(tmp_path / "grown.fa", seqs + ["MKVLAAGIVG"])
    summary = embed_fasta(counting, grown, tmp_path / "resumed", per_residue=True)
    assert (summary.skipped, summary.computed, counting.rows) == (9, 1, 1)
    c = read_embeddings(tmp_path / "resumed")
    np.testing.assert_allclose(c.mean[:9], a.mean, atol=1e-5)
    np.testing.assert_allclose(c.mean[9], model.embed("MKVLAAGIVG").mean[0], atol=1e-5)

    # other settings, or another sequence under a done ID, are refused; --force starts over
    with pytest.raises(JobError, match="other settings"):
        embed_fasta(model, fasta, tmp_path / "resumed", per_residue=True, layer=1)
    changed = write_fasta(tmp_path / "changed.fa", ["MKVLAAGIVG"] + seqs[1:])
    with pytest.raises(JobError, match="another sequence under the ID 's0'"):
        embed_fasta(model, changed, tmp_path / "resumed", per_residue=True)
    summary = embed_fasta(model, changed, tmp_path / "resumed", layer=1, force=True)
    assert (summary.skipped, summary.computed) == (0, 9)
    assert read_embeddings(tmp_path / "resumed").residues is None


def test_embed_resumes_only_with_the_model_that_made_the_store(converted, tmp_path):
    """A model of the same shape passes the settings check, so the weights' fingerprint decides:
    a rerun with another checkpoint (or a folder converted again in place) must not add its
    embeddings to the first model's, wherever the model is loaded from."""
    import shutil

    import mlx.core as mx

    from esmc_mlx.testing import write_random_artifact

    seqs = random_sequences(6, 4, 30, seed=41)
    fasta = write_fasta(tmp_path / "in.fa", seqs)
    interrupted = Counting(load(converted)[0], fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        embed_fasta(interrupted, fasta, tmp_path / "out", batch_tokens=64, flush_every=1)
    kept = {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    other = write_random_artifact(tmp_path / "other", load(converted)[0].config, mx.float32, seed=5)
    with pytest.raises(JobError, match=r"other settings \(model_weights: '[0-9a-f]{12}\.\.\.' there"):
        embed_fasta(str(other), fasta, tmp_path / "out", batch_tokens=64)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == kept
    moved = shutil.copytree(converted, tmp_path / "moved")  # the same weights elsewhere resume
    summary = embed_fasta(str(moved), fasta, tmp_path / "out", batch_tokens=64)
    assert summary.skipped > 0 and summary.skipped + summary.computed == 6


def test_embed_refuses_foreign_directory(model, tmp_path):
    fasta = write_fasta(tmp_path / "in.fa", ["MKV"])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("precious")
    with pytest.raises(JobError, match="busy is a folder esmc-mlx did not make"):
        embed_fasta(model, fasta, tmp_path / "busy", force=True)
    assert (tmp_path / "busy" / "thesis.tex").exists()


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        (">a\nMKV\n>b x\nMKJVQ1\n", r"in.fa, record 'b': invalid character 'J' at position 3, '1' at position 6"),
        (">a\nMKV\n>b\nLL\n>a\nMKV\n", r"line 5: duplicate ID 'a' \(first seen on line 1\)"),
        (">a\n>b\nMKV\n", r"line 1: record 'a' has no sequence"),
        ("MKV\n>a\nMKV\n", r"line 1: text before the first '>'"),
        ("\n", r"no FASTA records"),
    ],
)
def test_bad_fasta(text, message):
    with pytest.raises(FastaError, match=message):
        parse_fasta(text, "in.fa")


def test_fasta_reading_conventions(tmp_path):
    records = read_fasta(write_fasta(tmp_path / "x.fa", ["mkvlaa*"]))
    assert records[0].id == "s0" and records[0].description == "test record" and records[0].sequence == "MKVLAA"
    with pytest.raises(FastaError, match="cannot read"):
        read_fasta(tmp_path / "missing.fa")


@pytest.mark.parametrize(
    "mutant, message",
    [
        ("G4A", r"wild-type residue G at position 4 does not match the sequence, which has A there"),
        ("A40G", r"position 40 is out of range \(the sequence spans 1..33\)"),
        ("M0A", r"position 0 is out of range"),
        ("A4", r"'A4' is not a substitution like A23G"),
        ("A4G;K2P", r"not a substitution"),
        ("A4G:A4C", r"position 4 is mutated twice"),
        ("A4X", r"mutant residue 'X' is not one of the 20 amino acids"),
    ],
)
def test_bad_mutants(mutant, message):
    with pytest.raises(MutationError, match=message):
        parse_mutant(mutant, WT, where="row 1: ")


def test_mutant_offset_and_case():
    subs = parse_mutant("a103g:k101p", WT, offset=100)
    assert [(s.wt, s.position, s.mut, s.index) for s in subs] == [("A", 103, "G", 3), ("K", 101, "P", 1)]
    assert parse_mutant(" _wt ", WT) == []


def test_score_csv_errors_name_file_and_line(model, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("mutant,DMS_score\nA4G,1\nK2P:Q11W,2\nL4G,3\n")
    with pytest.raises(MutationError, match=r"bad.csv, line 4: 'L4G': wild-type residue L at position 4"):
        score_csv(model, WT, bad, None)
    nocol = tmp_path / "nocol.csv"
    nocol.write_text("variant,score\nA4G,1\n")
    with pytest.raises(JobError, match=r"no 'mutant' column \(columns: variant, score\)"):
        score_csv(model, WT, nocol, None)
    mismatch = tmp_path / "mm.csv"
    mismatch.write_text(f"mutant,mutated_sequence\nA4G,{WT}\n")
    with pytest.raises(JobError, match="line 2: 'A4G': mutated_sequence does not match"):
        score_csv(model, WT, mismatch, None)
    with pytest.raises(FastaError, match=r"sequence '--sequence': invalid character 'J' at position 2"):
        score_csv(model, "MJK", bad, None)
    with pytest.raises(ScoringError, match="unknown scoring method"):
        score_csv(model, WT, bad, None, methods=["entropy"])


def test_score_csv_checks_joint_windows_before_the_model(tmp_path):
    # a joint mutant wider than --window and an unknown multi= fail before the model loads (here
    # a missing model's error would come instead), and the message names the mutant
    csv = tmp_path / "joint.csv"
    csv.write_text("mutant\nA4G\nM1A:Q33A\n")
    missing = tmp_path / "no-model"
    with pytest.raises(ScoringError, match=r"joint.csv, line 3: 'M1A:Q33A': its sites span more than the window of 20"):
        score_csv(missing, WT, csv, None, multi="joint", window=20)
    with pytest.raises(ScoringError, match="unknown multi-mutant convention 'both'"):
        score_csv(missing, WT, csv, None, multi="both")
    result = CliRunner().invoke(
        cli, ["score", str(missing), "--sequence", WT, "--mutations", str(csv), "--multi", "joint", "--window", "20"]
    )
    assert result.exit_code == 1 and "line 3: 'M1A:Q33A'" in result.output, result.output
    assert not (tmp_path / "joint.scored.csv").exists()


def test_embed_per_residue_adds_to_the_pools_given(model, tmp_path):
    # model.embed(S, pools="max", per_residue=True) stores both, as the CLI's --pool max
    # --per-residue does (per_residue is not dropped without a word)
    emb = model.embed([WT, "MKV"], pools="max", per_residue=True)
    assert emb.get("max").shape == (2, model.config.hidden_size)
    assert [r.shape[0] for r in emb.per_residue] == [len(WT), 3]
    alone = model.embed([WT, "MKV"], pools="per-residue")
    np.testing.assert_array_equal(emb.per_residue[0], alone.per_residue[0])
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{WT}\n")
    embed_fasta(model, fasta, tmp_path / "e", pools=["max"], per_residue=True)  # the job: the same
    assert set(read_embeddings(tmp_path / "e").pools) == {"max", "per_residue"}


def test_embed_layer_and_layers_together_are_refused(model, tmp_path):
    # model.embed(S, layer=2, layers="1") / embed_fasta(...) must not use layers=1 and ignore
    # layer=2 without a word (the CLI refuses --layer 2 --layers 1)
    with pytest.raises(ScoringError, match=r"give layer=2 or layers='1', not both"):
        model.embed([WT], layer=2, layers="1")
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">a\n{WT}\n")
    with pytest.raises(ScoringError, match="not both"):
        embed_fasta(model, fasta, tmp_path / "e", layer=2, layers=[1])
    assert not (tmp_path / "e").exists()
    assert model.embed([WT], layer=1).layer == 1 and model.embed([WT]).layer == model.config.num_hidden_layers


def test_spearman_matches_scipy():
    spearmanr = pytest.importorskip("scipy.stats").spearmanr

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 40).astype(float), rng.normal(size=40)  # ties in a
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))


# --- command line ----------------------------------------------------------------------------


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_cli_score_of_a_pipe_asks_for_an_output(tmp_path):
    """--mutations <(...) (a pipe) has no folder for the default <mutations>.scored.csv: one Error
    line naming the option and -o, before the model loads or the pipe is read."""
    pipe = tmp_path / "mutations"
    os.mkfifo(pipe)
    result = CliRunner().invoke(cli, ["score", str(tmp_path / "no-model"), "--sequence", WT, "--mutations", str(pipe)])
    assert result.exit_code == 2
    assert "--mutations" in result.output and "not a regular file" in result.output and "-o FILE" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mutations"]


def test_cli_score_and_embed(converted, model, tmp_path):
    csv_in = tmp_path / "dms.csv"
    csv_in.write_text("mutant,DMS_score\n" + "".join(f"{m},{i * 0.5}\n" for i, m in enumerate(MUTANTS)))
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "score",
            str(converted),
            "--sequence",
            WT,
            "--mutations",
            str(csv_in),
            "-B",
            "8",
            "--method",
            "masked-marginal",
            "--method",
            "pppl",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Spearman masked_marginal vs DMS_score" in result.output and "Wild-type pseudo-perplexity" in result.output
    scored = (tmp_path / "dms.scored.csv").read_text().splitlines()
    assert scored[0] == "mutant,DMS_score,masked_marginal,pppl" and len(scored) == len(MUTANTS) + 1
    want = model.score_mutations(WT, MUTANTS, methods=["masked_marginal"])["masked_marginal"]
    np.testing.assert_allclose([float(line.split(",")[2]) for line in scored[1:]], want, atol=1e-5)

    fasta = tmp_path / "bad.fa"
    fasta.write_text(">ok\nMKV\n>broken\nMK@V\n")
    result = runner.invoke(cli, ["embed", str(converted), str(fasta), "-o", str(tmp_path / "emb")])
    assert result.exit_code == 1
    assert "Error:" in result.output and "record 'broken': invalid character '@' at position 3" in result.output
    fasta.write_text(">ok\nMKV\n>fine\nMKLV\n")
    result = runner.invoke(
        cli,
        [
            "embed",
            str(converted),
            str(fasta),
            "-o",
            str(tmp_path / "emb"),
            "--layer",
            "1",
            "--per-residue",
            "--dtype",
            "float16",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    stored = read_embeddings(tmp_path / "emb")
    assert stored.ids == ["ok", "fine"] and stored.mean.dtype == np.float16
    np.testing.assert_allclose(stored.mean.astype(np.float32), model.embed(["MKV", "MKLV"], layer=1).mean, atol=2e-3)

    # one of a thing is not "1 things" (not "Scored 1 mutants (...; 1 forward passes)")
    (tmp_path / "one.csv").write_text(f"mutant\n{MUTANTS[0]}\n")
    args = ["score", str(converted), "--sequence", WT, "--mutations", str(tmp_path / "one.csv"), "--no-progress"]
    result = runner.invoke(cli, [*args, "--method", "wt-marginal"])
    assert result.exit_code == 0 and "Scored 1 mutant (wt_marginal; 1 forward pass, " in result.output, result.output
    fasta.write_text(">new\nMKVW\n>ok\nMKV\n>fine\nMKLV\n")
    emb = ["embed", str(converted), str(fasta), "-o", str(tmp_path / "emb"), "--layer", "1", "--per-residue"]
    result = runner.invoke(cli, [*emb, "--dtype", "float16", "--no-progress"])
    assert "Embedded 1 sequence (2 already done" in result.output, result.output


def test_errors_are_user_errors():
    for error in (FastaError, MutationError, JobError, ScoringError):
        assert issubclass(error, EsmcMlxError)


def test_runtime_imports_neither_torch_nor_transformers():
    code = (
        "import sys, esmc_mlx.tasks.scoring, esmc_mlx.tasks.jobs, esmc_mlx.tasks.fasta, "
        "esmc_mlx.tasks.mutations, esmc_mlx.tasks.distributed; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- the public API's arguments ------------------------------------------------------------------


def test_forward_refuses_ids_it_would_read_wrongly(model):
    """Before: id 100 gave NaN logits and id -1 another token's row, without a word; a mask of
    the wrong width that was all ones was dropped; float ids and an empty batch failed deep in
    MLX (gather dtype, ZeroDivisionError)."""
    import mlx.core as mx

    from esmc_mlx.errors import SequenceError

    ids = mx.array([[0, 20, 15, 2]])
    cases = [
        (mx.array([[0, 100, 2]]), {}, "token id 100 is outside the vocabulary"),
        (mx.array([[0, -1, 2]]), {}, "token id -1 is outside the vocabulary"),
        (mx.array([[0.0, 5.0, 2.0]]), {}, "token ids must be integers"),
        (mx.zeros((1, 0), dtype=mx.int32), {}, "non-empty"),
        (ids, {"attention_mask": mx.array([[1, 1]])}, r"attention_mask: shape \(1, 2\) does not match"),
        (ids, {"sequence_id": mx.zeros((2, 4), dtype=mx.int32)}, "sequence_id: shape"),
    ]
    for input_ids, kwargs, message in cases:
        with pytest.raises(SequenceError, match=message):
            model(input_ids, **kwargs)
    assert model(ids, attention_mask=mx.ones((1, 4))).logits.shape == (1, 4, 64)  # a right one still runs
    # one unbatched sequence with its unbatched mask, as before the check
    assert model(ids[0], attention_mask=mx.ones((4,))).logits.shape == (1, 4, 64)
    # the caller's own mx.compile still traces the forward (the id values are unknown there)
    compiled = mx.compile(lambda i: model(i).logits)
    assert mx.allclose(compiled(ids), model(ids).logits, atol=1e-5).item()


def test_api_arguments_of_the_wrong_type_are_named(model):
    """Before: TypeError / AttributeError tracebacks from numpy or str methods ('int' object has
    no attribute 'isascii'), a float layer truncated (1.5 -> 1), True read as layer 1, the
    letters of methods="wt_marginal" taken as five unknown methods."""
    from esmc_mlx.errors import SequenceError

    s = "MKTAYIAKQRQISFVK"
    refused = [
        (lambda: model.embed(None), SequenceError, "sequences: expected a string or a list of strings, got NoneType"),
        (lambda: model.embed(b"MKT"), SequenceError, "got bytes"),
        (lambda: model.embed(["MKT", 5]), SequenceError, "expected a string of residues, got int"),
        (lambda: model.embed(s, layer=1.5), ScoringError, "layer 1.5: give an integer"),
        (lambda: model.embed(s, layer=True), ScoringError, "layer True"),
        (lambda: model.embed(s, batch_tokens="4096"), ScoringError, "batch_tokens must be a positive integer"),
        (lambda: model.embed(s).get("max"), ScoringError, "no max embeddings at layer"),
        (lambda: model.score_mutations(None, ["M1A"]), SequenceError, "got NoneType"),
        (lambda: model.score_mutations(s, ["M1A"], batch_size=2.5), ScoringError, "batch_size must be"),
        (lambda: model.score_mutations(s, ["M1A"], window="5"), ScoringError, "window must be"),
        (lambda: model.pseudo_perplexity(5), SequenceError, "got int"),
        (lambda: model.pseudo_perplexity(s, window=0), ScoringError, "window must be a positive integer, got 0"),
        (lambda: model.scan(s, window=-3), ScoringError, "window must be a positive integer, got -3"),
    ]
    for call, error, message in refused:
        with pytest.raises(error, match=message):
            call()
    for call, error, message in (
        (lambda: model.score_mutations(s, None), MutationError, "mutations: expected a list of mutant strings"),
        (lambda: model.score_mutations(s, [5]), MutationError, "a mutant is a string like A23G, not a int"),
        (lambda: model.embed(s, pools=5), ScoringError, "pools 5: give pool names"),
    ):
        with pytest.raises(error, match=message):
            call()
    one = model.score_mutations(s, ["M1A"], methods="wt_marginal")  # one method, not its letters
    assert list(one.scores) == ["wt_marginal"]
    assert pseudo_perplexity(model, []).shape == (0,)  # was: numpy's "need at least one array"


def test_job_arguments_are_checked_before_anything_is_made(model, tmp_path):
    """embed_fasta(batch_tokens=1.5 or 0) failed only once its output folder was made (a
    manifest and an empty parts/ left behind); score_csv(methods="wt_marginal") took the letters
    as five methods; offset="1" and a short ``where`` failed with TypeError / IndexError;
    parse_fasta(bytes) with a TypeError from str.startswith."""
    fasta = write_fasta(tmp_path / "in.fa", ["MKTAYIAKQ", "MKTAYIAKQRQ"])
    (tmp_path / "m.csv").write_text("mutant\nM1A\n")
    for tokens in (1.5, 0):
        with pytest.raises(ScoringError, match="batch_tokens must be a positive integer"):
            embed_fasta(model, fasta, tmp_path / "e", batch_tokens=tokens)
        assert not (tmp_path / "e").exists()
    summary = score_csv(model, "MKTAYIAKQ", tmp_path / "m.csv", tmp_path / "s.csv", methods="wt_marginal")
    assert summary.methods == ["wt_marginal"]
    with pytest.raises(MutationError, match="offset must be an integer"):
        score_csv(model, "MKTAYIAKQ", tmp_path / "m.csv", tmp_path / "t.csv", offset="1")
    assert not (tmp_path / "t.csv").exists()
    with pytest.raises(ScoringError, match="where has 1 entries for 2 mutants"):
        score_mutations(model, "MKTAYIAKQ", ["M1A", "K2A"], where=["row 2: "])
    with pytest.raises(FastaError, match="expected FASTA text as a string, got bytes"):
        parse_fasta(b">a\nMK\n")


def test_a_sequence_of_gaps_has_nothing_to_score(model):
    """pseudo_perplexity(["MKT", "---"]) gave NaN for the second without a word (0/0), alone a
    ValueError from np.concatenate; scan("---") the same ValueError; the wild type's pppl NaN."""
    from esmc_mlx.errors import SequenceError

    for call, message in (
        (lambda: pseudo_perplexity(model, ["MKT", "-.-"]), "sequence 2: no residues to score"),
        (lambda: pseudo_perplexity(model, "|"), "sequence 1: no residues to score"),
        (lambda: model.scan("---"), "sequence: no residues to score"),
        (lambda: score_mutations(model, "---", [], methods=["pppl"]), "the wild type: no residues to score"),
    ):
        with pytest.raises(SequenceError, match=message):
            call()
    assert model.scan("M|K").scores.shape == (2, 20)  # gaps and breaks between residues still fine


def test_stored_per_residue_by_negative_index(model, tmp_path):
    """StoredEmbeddings.per_residue(-1) returned an empty (0, d) array and (-2) the last
    record's rows (offsets has n + 1 entries: a raw negative index sliced the wrong span);
    an unknown ID or index past the end failed with ValueError / IndexError."""
    seqs = ["MKTAY", "MKTAYIAK", "MKV"]
    embed_fasta(model, write_fasta(tmp_path / "in.fa", seqs), tmp_path / "e", per_residue=True)
    stored = read_embeddings(tmp_path / "e")
    for i, s in enumerate(seqs):
        assert stored.per_residue(i).shape[0] == stored.per_residue(i - len(seqs)).shape[0] == len(s)
        np.testing.assert_array_equal(stored.per_residue(i - len(seqs)), stored.per_residue(f"s{i}"))
    for key, message in ((3, r"an index in -3\.\.2"), (-4, "an index"), ("zz", "no record 'zz'")):
        with pytest.raises(JobError, match=message):
            stored.per_residue(key)


def test_embed_refuses_layer_with_layers(converted, tmp_path):
    """embed --layer 2 --layers 1 embedded layer 1 only, --layer ignored without a word."""
    fasta = write_fasta(tmp_path / "in.fa", ["MKTAYIAKQ"])
    args = ["embed", str(converted), str(fasta), "--no-progress", "-o"]
    result = CliRunner().invoke(cli, [*args, str(tmp_path / "e"), "--layer", "2", "--layers", "1"])
    assert result.exit_code == 2 and "give --layer 2 or --layers 1, not both" in result.output, result.output
    assert not (tmp_path / "e").exists()
    for extra, want in (([], [-1]), (["--layer", "2"], [2]), (["--layers", "1,2"], [1, 2])):
        out = tmp_path / f"e{len(extra)}{want[0]}"
        assert CliRunner().invoke(cli, [*args, str(out), *extra]).exit_code == 0
        n = read_embeddings(out).num_layers
        assert list(read_embeddings(out).layers) == [w % (n + 1) for w in want]
