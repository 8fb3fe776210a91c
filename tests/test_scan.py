"""Saturation scan (`esmc-mlx scan`, `model.scan`): scores and entropy against transformers'
EsmcForMaskedLM, the pass count, the files, the heatmap's size, long sequences on the command line."""

from __future__ import annotations

import csv
import math
import shutil
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
from click.testing import CliRunner
from transformers import EsmcTokenizer

from esmc_mlx import load
from esmc_mlx.cli import main as cli
from esmc_mlx.errors import ScoringError
from esmc_mlx.tasks.heatmap import heatmap_size
from esmc_mlx.tasks.mutations import AMINO_ACIDS_20, all_singles
from esmc_mlx.tasks.scoring import score_mutations
from esmc_mlx.testing import random_sequences

HF_TOK = EsmcTokenizer()
WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"


@pytest.fixture(scope="module")
def model(converted):
    return load(converted)[0]


def torch_rows(ref, sequence, masked: bool):
    """(L, 64) log_softmax rows: position i read with i masked alone, or from one unmasked pass."""
    ids = torch.tensor(HF_TOK(sequence)["input_ids"]).long()[None]
    L = len(sequence)
    if masked:
        ids = ids.repeat(L, 1)
        ids[torch.arange(L), torch.arange(L) + 1] = HF_TOK.mask_token_id
    with torch.no_grad():
        logits = ref(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if masked:
        return logp[torch.arange(L), torch.arange(L) + 1].numpy()
    return logp[0, 1 : L + 1].numpy()


def png_size(path):
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("method", ["masked_marginal", "wt_marginal"])
def test_scan_matches_transformers(model, reference_model, method):
    got = model.scan(WT, method=method, batch_size=8)
    rows = torch_rows(reference_model, WT, masked=method == "masked_marginal").astype(np.float64)
    aa = [HF_TOK.convert_tokens_to_ids(a) for a in AMINO_ACIDS_20]
    wt = [HF_TOK.convert_tokens_to_ids(c) for c in WT]
    want = rows[:, aa] - rows[np.arange(len(WT)), wt][:, None]
    np.testing.assert_allclose(got.scores, want, atol=1e-4, rtol=1e-4)
    p20 = np.exp(rows[:, aa])
    p20 /= p20.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(got.entropy, -(p20 * np.log(p20)).sum(axis=1), atol=1e-4, rtol=1e-4)
    assert got.scores.shape == (len(WT), 20) and 0 < got.entropy.min() and got.entropy.max() < math.log(20)
    # the scan's scores are score_mutations' on all_singles
    singles = all_singles(WT)
    ref = score_mutations(model, WT, singles, methods=[method])[method]
    np.testing.assert_allclose([v[3] for v in got.variants()], ref, atol=1e-5)
    assert [f"{w}{p}{m}" for p, w, m, _, _ in got.variants()] == singles
    assert got.passes == (math.ceil(len(WT) / 8) if method == "masked_marginal" else 1)


def test_scan_of_500_residues_is_one_pass_per_position_at_most():
    from tests.test_scoring import StubModel

    wt = random_sequences(1, 500, 500, seed=3)[0]
    stub = StubModel()
    from esmc_mlx.tasks.scan import scan

    for batch_size, passes in ((1, 500), (32, 16)):
        stub.calls = 0
        result = scan(stub, wt, batch_size=batch_size)
        assert stub.calls == result.passes == passes
    with pytest.raises(ScoringError, match="unknown scan method"):
        scan(stub, wt, method="pppl")


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
@pytest.mark.parametrize("n,per_row", [(30, 100), (250, 100), (2000, 100)])
def test_heatmap_png_has_the_expected_size(n, per_row, tmp_path):
    from esmc_mlx.tasks.scan import Scan

    rng = np.random.default_rng(0)
    seq = random_sequences(1, n, n, seed=n)[0]
    scan = Scan(
        seq,
        "masked_marginal",
        np.arange(n),
        rng.normal(size=(n, 20)).astype(np.float32),
        rng.uniform(0, 3, n).astype(np.float32),
        name="x",
    )
    paths = scan.write(tmp_path, per_row=per_row)
    assert png_size(paths["png"]) == heatmap_size(n, per_row)
    w, h = heatmap_size(n, per_row)
    assert w == round((0.6 + min(n, per_row) * 0.14 + 1.1) * 100)
    assert h == round((0.5 + math.ceil(n / per_row) * (2.8 + 0.75) + 0.2) * 100)
    assert np.load(paths["npy"]).shape == (n, 20)


def test_cli_scan_fasta_and_long_sequences(converted, model, tmp_path):
    long = random_sequences(1, 300, 300, seed=9)[0]  # > 255 characters: not a file name
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">sp|P1|ONE\n{WT}\n>two\n{WT[:20]}\n")
    runner = CliRunner()
    r = runner.invoke(
        cli, ["scan", str(converted), "--fasta", str(fasta), "-o", str(tmp_path / "scan"), "--no-progress"]
    )
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(tmp_path / "scan" / "sp_P1_ONE_scan.csv")))
    assert len(rows) == 19 * len(WT) and rows[0].keys() >= {"position", "wt", "mut", "masked_marginal", "entropy"}
    want = model.scan(WT)
    np.testing.assert_allclose(np.load(tmp_path / "scan" / "sp_P1_ONE_matrix.npy"), want.scores, atol=1e-6)
    assert png_size(tmp_path / "scan" / "two_heatmap.png") == heatmap_size(20)
    r = runner.invoke(
        cli,
        [
            "scan",
            str(converted),
            "--sequence",
            long,
            "-o",
            str(tmp_path / "long"),
            "--method",
            "wt-marginal",
            "--no-plot",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    assert np.load(tmp_path / "long" / "sequence_matrix.npy").shape == (300, 20)
    assert not (tmp_path / "long" / "sequence_heatmap.png").exists()
    # score: a literal sequence longer than a file name may be
    muts = tmp_path / "m.csv"
    muts.write_text(f"mutant\n{long[0]}1A\n")
    r = runner.invoke(cli, ["score", str(converted), "--sequence", long, "--mutations", str(muts), "--no-progress"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["scan", str(converted), "--sequence", "MKJ", "-o", str(tmp_path / "bad")])
    assert r.exit_code == 1 and "Error:" in r.output and "'J'" in r.output


@pytest.mark.parametrize("other", ["a/b", "A_B"])
def test_scan_refuses_ids_that_would_share_file_names(converted, tmp_path, other):
    """'a/b' and 'a_b' (and, on macOS's case-blind file system, 'A_B') both become a_b_*: the
    second record's files replaced the first's while the run reported both as scanned."""
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a_b\n{WT}\n>{other}\n{WT[:20]}\n")
    r = CliRunner().invoke(
        cli, ["scan", str(converted), "--fasta", str(fasta), "-o", str(tmp_path / "scan"), "--no-progress"]
    )
    assert r.exit_code == 1 and r.output.count("Error:") == 1 and f"'a_b' and '{other}'" in r.output, r.output
    assert not (tmp_path / "scan").exists()


def test_scan_refuses_name_with_fasta(converted, tmp_path):
    """--name with --fasta was ignored without a word (each record's ID names its files)."""
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{WT[:12]}\n")
    args = ["scan", str(converted), "--no-plot", "--no-progress", "-o"]
    r = CliRunner().invoke(cli, [*args, str(tmp_path / "scan"), "--fasta", str(fasta), "--name", "mine"])
    assert r.exit_code == 1 and r.output.count("Error:") == 1 and "--name 'mine'" in r.output, r.output
    assert not (tmp_path / "scan").exists()
    r = CliRunner().invoke(cli, [*args, str(tmp_path / "one"), "--sequence", WT[:12], "--name", "mine"])
    assert r.exit_code == 0 and (tmp_path / "one" / "mine_scan.csv").exists(), r.output
    r = CliRunner().invoke(cli, [*args, str(tmp_path / "two"), "--sequence", WT[:12]])
    assert r.exit_code == 0 and (tmp_path / "two" / "sequence_scan.csv").exists(), r.output


def test_a_stopped_fasta_scan_resumes_where_it_stopped(converted, tmp_path, monkeypatch):
    """A rerun scanned every record again; now the proteins OUT holds from the same sequence,
    settings and model are skipped, and what changed is scanned again."""
    from esmc_mlx.tasks import jobs

    fasta = tmp_path / "in.fa"
    fasta.write_text(f">one\n{WT}\n>two\n{WT[:20]}\n>three\n{WT[5:25]}\n")
    out = tmp_path / "scan"
    args = ["scan", str(converted), "--fasta", str(fasta), "-o", str(out), "--no-plot", "--no-progress"]
    calls, real = [], jobs.run_scan

    def counted(model, sequence, **kw):
        calls.append(kw["name"])
        if kw["name"] == "two" and stop:
            raise KeyboardInterrupt  # Ctrl-C during the second protein
        return real(model, sequence, **kw)

    monkeypatch.setattr(jobs, "run_scan", counted)
    stop = True
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1 and calls == ["one", "two"] and (out / "one_scan.csv").exists()
    assert not (out / "two_scan.csv").exists()
    kept = (out / "one_matrix.npy").stat().st_mtime_ns

    stop, calls[:] = False, []
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0 and calls == ["two", "three"], r.output
    assert "Skipped one: already scanned" in r.output
    assert (out / "one_matrix.npy").stat().st_mtime_ns == kept
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(jobs, "run_scan", real)
    assert CliRunner().invoke(cli, [*args[:4], "-o", str(fresh), "--no-plot", "--no-progress"]).exit_code == 0
    for name in ("one", "two", "three"):
        assert (out / f"{name}_scan.csv").read_bytes() == (fresh / f"{name}_scan.csv").read_bytes()
    monkeypatch.setattr(jobs, "run_scan", counted)

    calls[:] = []  # all there: nothing computed
    assert CliRunner().invoke(cli, args).exit_code == 0 and calls == []
    # what changes a protein's files makes it scanned again: its sequence, the method, a file cut short, --force
    fasta.write_text(f">one\n{WT}\n>two\n{WT[:21]}\n>three\n{WT[5:25]}\n")
    assert CliRunner().invoke(cli, args).exit_code == 0 and calls == ["two"]
    calls[:] = []
    assert CliRunner().invoke(cli, [*args, "--method", "wt-marginal"]).exit_code == 0
    assert calls == ["one", "two", "three"]
    calls[:] = []
    (out / "three_matrix.csv").write_text("position\n")
    assert CliRunner().invoke(cli, [*args, "--method", "wt-marginal"]).exit_code == 0 and calls == ["three"]
    calls[:] = []
    assert CliRunner().invoke(cli, [*args, "--method", "wt-marginal", "--force"]).exit_code == 0
    assert calls == ["one", "two", "three"]
    # a heatmap of the old scores is not left beside the new ones (but a file the user changed is)
    calls[:] = []
    assert CliRunner().invoke(cli, [*args[:-2], "--no-progress"]).exit_code == 0 and len(calls) == 3
    assert (out / "one_heatmap.png").exists() and (out / "two_heatmap.png").exists()
    with open(out / "two_heatmap.png", "ab") as f:
        f.write(b"edited")
    assert CliRunner().invoke(cli, [*args, "--method", "wt-marginal"]).exit_code == 0
    assert not (out / "one_heatmap.png").exists() and (out / "two_heatmap.png").exists()


def test_scan_refuses_a_manifest_it_did_not_write(converted, tmp_path):
    out = tmp_path / "scan"
    out.mkdir()
    (out / "scan-manifest.json").write_text('{"format": "someone-else", "proteins": {}}')
    r = CliRunner().invoke(cli, ["scan", str(converted), "--sequence", WT[:12], "-o", str(out), "--no-progress"])
    assert r.exit_code == 1 and r.output.count("Error:") == 1 and "scan-manifest.json" in r.output, r.output
    assert sorted(p.name for p in out.iterdir()) == ["scan-manifest.json"]
    assert "someone-else" in (out / "scan-manifest.json").read_text()


def test_a_scan_resumes_with_the_same_weights_only(converted, tmp_path):
    """The model is known by its weights (ESMC.fingerprint): a loaded model resumes, and a
    folder converted again in place (or another model given the same name) is not taken for the
    one that made OUT's files, as a path would be."""
    import mlx.core as mx

    from esmc_mlx.tasks.jobs import scan_job
    from esmc_mlx.testing import write_random_artifact

    def job(model, **kw):
        return scan_job(model, tmp_path / "out", sequence=WT[:12], plot=False, **kw)

    assert [s[0] for s in job(load(converted, fuse=False)[0]).scanned] == ["sequence"]
    # the same weights: loaded fused, or a copy elsewhere named by its path
    moved = tmp_path / "moved"
    shutil.copytree(converted, moved)
    for same in (load(converted, fuse=True)[0], str(moved)):
        again = job(same)
        assert again.skipped == ["sequence"] and again.scanned == []
    # other weights of the same shape: the same path converted again, then the first model again
    shutil.rmtree(moved)
    write_random_artifact(moved, load(converted)[0].config, mx.float32, seed=3)
    assert [s[0] for s in job(str(moved)).scanned] == ["sequence"]
    assert [s[0] for s in job(load(converted)[0]).scanned] == ["sequence"]


@pytest.mark.parametrize("offset", ["1", 1.5, True])
def test_scan_offset_must_be_an_integer(model, offset):
    """offset="1" failed only in write (TypeError), 1.5 wrote mutants such as M1.5A."""
    with pytest.raises(ScoringError, match="offset must be an integer"):
        model.scan(WT[:8], offset=offset)


def test_non_ascii_names_keep_their_letters(converted, tmp_path):
    r = CliRunner().invoke(
        cli, ["scan", str(converted), "--sequence", WT[:8], "--name", "αβ/1", "-o", str(tmp_path), "--no-plot"]
    )
    assert r.exit_code == 0 and (tmp_path / "αβ_1_scan.csv").exists(), r.output
