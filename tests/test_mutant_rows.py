"""One validator for the rows of a mutation CSV: every bad row reported at once (file, line,
reason), before the model loads; ``--skip-invalid`` scores the rest and writes the rejected rows
beside the output. The packaged esmc-tiny, no torch."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from esmc_mlx import load
from esmc_mlx.cli import main as cli
from esmc_mlx.convert import convert
from esmc_mlx.errors import JobError, MutationError, ScoringError
from esmc_mlx.tasks.jobs import rejects_path, score_csv
from esmc_mlx.tasks.scoring import check_mutants, score_mutations

WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
# line 3: wrong wild type; line 5: out of range; line 6: not a mutant; line 7: a site twice
ROWS = "mutant,DMS_score\nK2A,1\nA3G,2\nT3G,3\nM40A,4\nhello,5\nK2A:K2G,6\nQ33A,7\n"
BAD = {
    3: "'A3G': wild-type residue A at position 3 does not match the sequence, which has T there",
    5: "'M40A': position 40 is out of range (the sequence spans 1..33)",
    6: "'hello': 'hello' is not a substitution like A23G",
    7: "'K2A:K2G': position 2 is mutated twice",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return convert("tiny", tmp_path_factory.mktemp("tiny") / "fp32", progress=False)


def test_every_bad_row_is_reported_at_once_before_the_model_loads(tmp_path):
    muts = tmp_path / "dms.csv"
    muts.write_text(ROWS)
    with pytest.raises(MutationError) as caught:
        score_csv(tmp_path / "no-such-model", WT, muts, tmp_path / "out.csv")  # fails before loading it
    message = str(caught.value)
    assert message.startswith("4 of 7 mutants cannot be scored:")
    for line, reason in BAD.items():
        assert f"{muts}, line {line}: {reason}" in message
    assert message.endswith(
        f"\n--skip-invalid scores the other rows and writes these to {tmp_path / 'out.rejected.csv'}"
    )
    assert not (tmp_path / "out.csv").exists()


def test_the_validator_collects_windows_and_mutated_sequences_too():
    mutants = ["K2A:Q33A", "K2A", "T3G", "bad"]
    given = [None, WT, "MKG" + WT[3:], ""]  # row 2 is not K2A applied; row 3 is T3G applied
    parsed, rejected = check_mutants(mutants, WT, joint_window=20, mutated_sequences=given)
    assert [r.index for r in rejected] == [0, 1, 3] and parsed[2] is not None
    assert [r.error for r in rejected] == [ScoringError, JobError, MutationError]
    assert "span more than the window of 20" in rejected[0].reason
    assert "mutated_sequence does not match" in rejected[1].reason
    _, none = check_mutants(mutants[:2], WT, joint_window=False)  # sum: the span does not matter
    assert none == []


def test_the_python_api_lists_every_bad_mutant(tmp_path):
    with pytest.raises(
        MutationError, match=r"2 of 3 mutants cannot be scored:\n  mutant 2: 'A3G'.*\n  mutant 3: 'M40A'"
    ):
        score_mutations(None, WT, ["K2A", "A3G", "M40A"])
    with pytest.raises(MutationError, match=r"^mutant 2: 'A3G': wild-type residue A"):  # one bad mutant: one line
        score_mutations(None, WT, ["K2A", "A3G"])


def test_skip_invalid_scores_the_rest_and_writes_the_rejects_beside(tiny, tmp_path):
    muts = tmp_path / "dms.csv"
    muts.write_text(ROWS)
    out = tmp_path / "scored.csv"
    args = ["score", str(tiny), "--sequence", WT, "--mutations", str(muts), "-o", str(out), "--no-progress"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and result.output.startswith("Error: 4 of 7 mutants cannot be scored:"), result.output
    assert all(f"line {line}: " in result.output for line in BAD) and not out.exists()
    result = CliRunner().invoke(cli, [*args, "--skip-invalid", "--method", "wt-marginal"])
    assert result.exit_code == 0, result.output
    assert f"Rejected 4 invalid rows -> {tmp_path / 'scored.rejected.csv'}" in result.output
    scored = list(csv.DictReader(open(out)))
    assert [r["mutant"] for r in scored] == ["K2A", "T3G", "Q33A"] and all(r["wt_marginal"] for r in scored)
    model = load(tiny)[0]
    want = score_mutations(model, WT, ["K2A", "T3G", "Q33A"], methods=["wt_marginal"])["wt_marginal"]
    np.testing.assert_allclose([float(r["wt_marginal"]) for r in scored], want, atol=1e-6)
    rejected = list(csv.DictReader(open(rejects_path(out))))
    assert [int(r["line"]) for r in rejected] == list(BAD)
    assert all(r["reason"].startswith(reason) for r, reason in zip(rejected, BAD.values()))
    assert [r["DMS_score"] for r in rejected] == ["2", "4", "5", "6"]  # the rows as they were
    # all rows bad: nothing to score, an error even with --skip-invalid
    (tmp_path / "bad.csv").write_text("mutant\nA3G\nM40A\n")
    result = CliRunner().invoke(
        cli, ["score", str(tiny), "--sequence", WT, "--mutations", str(tmp_path / "bad.csv"), "--skip-invalid"]
    )
    assert result.exit_code == 1 and "2 of 2 mutants cannot be scored" in result.output


def test_skip_invalid_into_a_stream_lists_the_rejects_on_stderr(tiny, tmp_path):
    muts = tmp_path / "dms.csv"
    muts.write_text(ROWS)
    args = ["score", str(tiny), "--sequence", WT, "--mutations", str(muts), "-o", "/dev/stdout"]
    done = subprocess.run(
        [sys.executable, "-m", "esmc_mlx.cli", *args, "--skip-invalid", "--method", "wt-marginal", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "mutant,DMS_score,wt_marginal" and [x.split(",")[0] for x in lines[1:4]] == [
        "K2A",
        "T3G",
        "Q33A",
    ]
    assert "Rejected 4 invalid rows:" in done.stderr
    assert all(f"{muts}, line {line}: {reason}" in done.stderr for line, reason in BAD.items())
    assert not list(tmp_path.glob("*.rejected.csv"))


def test_joint_with_only_wt_marginal_is_refused(tiny, tmp_path):
    muts = tmp_path / "m.csv"
    muts.write_text("mutant\nK2A:T3G\n")
    args = ["score", str(tiny), "--sequence", WT, "--mutations", str(muts), "--multi", "joint"]
    result = CliRunner().invoke(cli, [*args, "--method", "wt-marginal"])
    assert result.exit_code == 1 and "Error: --multi joint" in result.output and "only masked-marginal" in result.output
    assert not (tmp_path / "m.scored.csv").exists()
    with pytest.raises(ScoringError, match="--multi joint"):
        score_mutations(None, WT, ["K2A:T3G"], methods=["wt_marginal", "pppl"], multi="joint")
    result = CliRunner().invoke(cli, [*args, "--method", "wt-marginal", "--method", "masked-marginal"])
    assert result.exit_code == 0, result.output
