"""`esmc-mlx fold`: the files it writes hold what the API's fold of the same seed returns, a rerun
resumes, other settings fold again, user files are never overwritten, bad input is one Error
line, a record too large for this machine's memory is refused before any fold."""

from __future__ import annotations

import csv

import mlx.core as mx
import numpy as np
import pytest
from fault_tools import cli, convert_cli, debris, one_error_line
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from esmc_mlx.convert import convert
from esmc_mlx.resolve import LOCAL_ALIASES
from esmc_mlx.tasks import scoring
from esmc_mlx.tasks.fold import atom_counts, load_fold
from esmc_mlx.tasks.fold import job as fold_module
from esmc_mlx.testing import write_fold_checkpoint

SEQ = "MKTAYIAKQRQISFVK"
COMPLEX = "MKTAYIAKQR|GSHMSLFDK"
FAST = ("--steps", "2", "--loops", "0", "--no-progress")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
    root = tmp_path_factory.mktemp("fold-cli")
    checkpoint = write_fold_checkpoint(root / "checkpoint", seed=3)
    return convert(str(checkpoint), root / "artifact", progress=False)


@pytest.fixture(scope="module")
def api(artifact):
    model = load_fold(artifact)
    return lambda chains, samples=1, seed=0: model.fold(chains, samples=samples, steps=2, loops=0, seed=seed)


def fold(artifact, *args):
    return cli("fold", artifact, *args, *FAST)


def atoms(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("ATOM")]


def summary(out) -> list[dict]:
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_fasta_folds_into_the_files_the_api_returns(artifact, api, tmp_path):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">one first\n{SEQ}\n>cx\n{COMPLEX}\n")
    out = tmp_path / "folds"
    r = fold(artifact, fasta, "-o", out)
    assert r.exit_code == 0, r.output
    assert "Folded 2 sequences (0 already done, 2 in all" in r.output
    rows = summary(out)
    assert list(rows[0]) == ["id", "length", "chains", "mean_plddt", "ptm", "iptm", "seconds", "sample"]
    assert [row["id"] for row in rows] == ["one", "cx"]
    for row, chains in zip(rows, [[SEQ], COMPLEX.split("|")]):
        s = api(chains)
        ident = row["id"]
        lines = atoms(out / f"{ident}.pdb")
        assert len(lines) == atom_counts(chains)[0]
        real = s.features["atom_attention_mask"][0].astype(bool)
        b_factors = np.array([float(line[60:66]) for line in lines])
        np.testing.assert_allclose(b_factors, np.round(100 * s.plddt_per_atom[0][real], 2), atol=0.011)
        assert {line[21] for line in lines} == set("AB"[: len(chains)])
        np.testing.assert_allclose(np.load(out / f"{ident}_pae.npy"), s.pae[0], rtol=1e-5, atol=1e-5)
        assert np.load(out / f"{ident}_pae.npy").dtype == np.float32
        assert row["length"] == str(sum(map(len, chains))) and row["chains"] == str(len(chains))
        assert float(row["mean_plddt"]) == pytest.approx(100 * s.plddt[0].mean(), rel=1e-5)
        assert float(row["ptm"]) == pytest.approx(s.ptm[0], rel=1e-5)
        assert row["iptm"] == "" if len(chains) == 1 else float(row["iptm"]) == pytest.approx(s.iptm[0], rel=1e-5)
        assert row["sample"] == "0" and float(row["seconds"]) > 0
    if fold_module.plotting_available():
        assert (out / "one_pae.png").read_bytes()[:4] == b"\x89PNG"
    assert debris(out, tmp_path) == []


def test_samples_keeps_every_sample_and_the_best_by_ptm(artifact, api, tmp_path):
    out = tmp_path / "folds"
    r = fold(artifact, "--sequence", SEQ, "--samples", "3", "--seed", "5", "--name", "p", "-o", out)
    assert r.exit_code == 0, r.output
    s = api(SEQ, samples=3, seed=5)
    best = int(np.argmax(s.ptm))
    assert summary(out)[0]["sample"] == str(best)
    assert float(summary(out)[0]["ptm"]) == pytest.approx(s.ptm.max(), rel=1e-5)
    for k in range(3):
        assert (out / f"p_sample{k}.pdb").read_text() == s.to_pdb(k)
    assert (out / "p.pdb").read_text() == s.to_pdb(best)
    np.testing.assert_allclose(np.load(out / "p_pae.npy"), s.pae[best], rtol=1e-5, atol=1e-5)


def test_cif_format(artifact, api, tmp_path):
    out = tmp_path / "folds"
    r = fold(artifact, "--sequence", COMPLEX, "--format", "cif", "-o", out)
    assert r.exit_code == 0, r.output
    text = (out / "sequence.cif").read_text()
    assert text == api(COMPLEX.split("|")).to_mmcif(name="sequence")
    assert text.startswith("data_") and not (out / "sequence.pdb").exists()


def test_a_rerun_skips_and_other_settings_fold_again(artifact, tmp_path, monkeypatch):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n>b\n{SEQ[:10]}\n")
    out = tmp_path / "folds"
    assert fold(artifact, fasta, "-o", out).exit_code == 0
    times = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    calls = []
    real = fold_module.fold
    monkeypatch.setattr(
        fold_module, "fold", lambda model, chains, **kw: calls.append(chains) or real(model, chains, **kw)
    )
    r = fold(artifact, fasta, "-o", out)
    assert r.exit_code == 0, r.output
    assert calls == [] and "Skipped 2 records: already folded" in r.output and "(2 already done" in r.output
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == times

    fasta.write_text(f">a\n{SEQ}\n>b\n{SEQ[:10]}\n>c\n{SEQ[3:]}\n")  # one more record: only it folds
    assert fold(artifact, fasta, "-o", out).exit_code == 0 and calls == [[SEQ[3:]]]
    assert [row["id"] for row in summary(out)] == ["a", "b", "c"]

    r = fold(artifact, fasta, "-o", out, "--seed", "1")  # other settings: refused, then folded with --force
    one_error_line(r, "other settings", "seed: 0 there, 1 now", "--force")
    r = fold(artifact, fasta, "-o", out, "--seed", "1", "--force")
    assert r.exit_code == 0 and "Folded 3 sequences (0 already done" in r.output, r.output


def test_ctrl_c_keeps_what_was_folded_and_says_how_to_resume(artifact, tmp_path, monkeypatch):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n>b\n{SEQ[:10]}\n")
    out = tmp_path / "folds"
    real = fold_module.fold

    def stopped(model, chains, **kw):
        if chains == [SEQ[:10]]:
            raise KeyboardInterrupt
        return real(model, chains, **kw)

    monkeypatch.setattr(fold_module, "fold", stopped)
    r = fold(artifact, fasta, "-o", out)
    assert r.exit_code == 1 and "keeps 1 structure of 2" in r.output and "run the same command again" in r.output
    assert (out / "a.pdb").exists() and not (out / "b.pdb").exists() and debris(out, tmp_path) == []
    monkeypatch.setattr(fold_module, "fold", real)
    r = fold(artifact, fasta, "-o", out)
    assert r.exit_code == 0 and "Folded 1 sequence (1 already done, 2 in all" in r.output, r.output


def test_files_of_the_user_are_never_overwritten(artifact, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    one_error_line(fold(artifact, "--sequence", SEQ, "-o", mine), "did not make", "notes.txt")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    out = tmp_path / "folds"
    assert fold(artifact, "--sequence", SEQ, "--name", "a", "-o", out).exit_code == 0
    (out / "b.pdb").write_text("a structure of the user's")
    one_error_line(fold(artifact, "--sequence", SEQ, "--name", "b", "-o", out), "b.pdb")
    assert (out / "b.pdb").read_text() == "a structure of the user's" and not (out / "b_pae.npy").exists()


@pytest.mark.parametrize(
    "sequence, fragments",
    [
        ("seqs.fasta", ["no such file"]),
        ("ACGTACGTACGTACGTACGT", ["reads as DNA or RNA", "translate it first"]),
        ("MKTAYIAK:GSHMSL", ["':' at position 9", "'|'"]),
        ("MKTAYIAK|", ["chain B is empty"]),
    ],
)
def test_bad_input_is_one_error_line(artifact, tmp_path, sequence, fragments):
    out = tmp_path / "folds"
    one_error_line(fold(artifact, "--sequence", sequence, "-o", out), *fragments)
    assert not out.exists()


def test_a_bad_fasta_record_is_named_before_any_fold(artifact, tmp_path):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">good\n{SEQ}\n>dna\nACGTACGTACGTACGTACGTAC\n")
    one_error_line(fold(artifact, fasta, "-o", tmp_path / "folds"), "dna", "DNA or RNA")
    assert not (tmp_path / "folds").exists()


def test_a_record_too_large_for_memory_is_refused_before_any_fold(artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(scoring, "memory_bytes", lambda: 1 << 20)  # a machine of 1 MiB
    line = one_error_line(fold(artifact, "--sequence", SEQ, "--samples", "2", "-o", tmp_path / "folds"), "'sequence'")
    assert "GiB" in line and "fewer --samples" in line
    assert not (tmp_path / "folds").exists()


@pytest.fixture(scope="module")
def tiny_fold(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-fold") / "tiny-fold"
    r = convert_cli("tiny-fold", "-o", model)
    assert r.exit_code == 0, r.output
    assert "random" in r.output and "meaningless" in r.output
    return model


def test_tiny_fold_builds_offline_and_folds(tiny_fold, tmp_path):
    """esmc-convert tiny-fold: esmc-tiny's backbone as it ships, random folding weights (said so)."""
    model = tiny_fold
    packaged = load_file(LOCAL_ALIASES["tiny"] / "model.safetensors")
    built = dict(tree_flatten(load_fold(model).esmc.parameters()))
    for name in ("esmc.embed_tokens.weight", "esmc.layers.5.mlp.down_proj.weight"):
        np.testing.assert_array_equal(np.array(built[name]), packaged[name])
    out = tmp_path / "folds"
    r = fold(model, "--sequence", SEQ, "-o", out)
    assert r.exit_code == 0, r.output
    assert len(atoms(out / "sequence.pdb")) == atom_counts([SEQ])[0] and summary(out)[0]["length"] == str(len(SEQ))


@pytest.mark.parametrize("length, samples", [(40, 1), (90, 2)])
def test_the_memory_estimate_holds_the_measured_peak(tiny_fold, length, samples):
    model = load_fold(tiny_fold)
    chains = [(SEQ * 10)[:length]]
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model.fold(chains, samples=samples, steps=2, loops=1)
    peak = mx.get_peak_memory() - base
    assert peak <= fold_module.fold_bytes(model.config, chains, samples, model.dtype.size) <= 3 * peak
