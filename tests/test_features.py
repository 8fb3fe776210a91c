"""`esmc-mlx features`, `esmc-mlx quantize-sae` and the push of an SAE folder: files that round-trip
to what ``sae_features`` returns, resumes, refusals, the validation report, the Hub upload."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest_hub import hub, no_remote_network  # noqa: F401

from esmc_mlx import load, load_sae
from esmc_mlx.cli import main as cli
from esmc_mlx.tasks.features import features_job, read_features, top_features
from esmc_mlx.tasks.sae import SAEFeatures
from esmc_mlx.testing import random_sequences, write_random_sae
from esmc_mlx.validate import thresholds

CODEBOOK, K = 256, 8


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory, tiny_config):
    return write_random_sae(tmp_path_factory.mktemp("sae") / "sae", tiny_config.hidden_size, CODEBOOK, K, [1, 2])


@pytest.fixture
def fasta(tmp_path):
    path = tmp_path / "in.fa"
    seqs = random_sequences(7, 3, 40, seed=11)
    path.write_text("".join(f">p{i} protein {i}\n{s}\n" for i, s in enumerate(seqs)))
    return path, seqs


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_features_command_stores_what_sae_features_returns(converted, sae_dir, fasta, tmp_path):
    path, seqs = fasta
    out = tmp_path / "feats"
    r = run("features", converted, "--sae", sae_dir, "--fasta", path, "-o", out, "--layer", 1, "--layer", 2,
            "--normalize", "--top", 3, "--batch-tokens", 64, "--no-progress")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "Encoded 7 sequences (0 already done, 7 in all)" in r.output
    model = load(converted)[0]
    sae = load_sae(sae_dir)
    want = model.sae_features(seqs, sae, layer=[1, 2], normalize=True)
    stored = read_features(out)
    assert stored.ids == [f"p{i}" for i in range(7)] and stored.layers == (1, 2)
    for layer in (1, 2):
        for i, seq in enumerate(seqs):
            got = stored.get(f"p{i}", layer)
            assert got.indices.shape == (len(seq), K)  # residues only: <cls> and <eos> are not stored
            np.testing.assert_array_equal(got.indices, want[(sae.name, layer)][i].indices[1:-1])
            np.testing.assert_allclose(got.values, want[(sae.name, layer)][i].values[1:-1], rtol=1e-5)
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert {(r["id"], r["layer"]) for r in rows} == {(f"p{i}", str(layer)) for i in range(7) for layer in (1, 2)}
    assert all(int(r["rank"]) <= 3 for r in rows)
    first = [r for r in rows if r["id"] == "p0" and r["layer"] == "2"]
    expect = top_features(stored.get("p0", 2), 3)
    assert [int(r["feature"]) for r in first] == [e["feature"] for e in expect]
    assert not list(out.glob("heatmap_*"))  # with --fasta: no heatmaps unless asked
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["array_layouts"]["layer1_indices"] == [K, "int32"]
    assert np.load(out / "layer1_indices.npy").dtype == np.int32


def test_summary_of_one_feature_is_exact():
    idx = np.array([[3, 1], [3, 2], [0, 1], [3, 2]], np.int32)
    vals = np.array([[2.0, 1.0], [4.0, 0.7], [1.0, 0.0], [1.0, 0.6]], np.float32)  # totals: 3: 7, 2: 1.3
    rows = top_features(SAEFeatures(idx, vals, 5, 1, "x"), 2)
    assert [r["feature"] for r in rows] == [3, 2]
    assert rows[0]["residues_active"] == 3 and rows[0]["mean_activation"] == pytest.approx(7 / 4)
    assert rows[0]["max_activation"] == 4.0 and rows[0]["max_position"] == 2 and rows[0]["positions"] == "1-2;4"
    assert rows[1]["positions"] == "2;4"  # feature 1 at residue 3 has value 0: not active


def test_summary_ranks_by_total_then_feature_number():
    """The top features are those of the largest totals, ties in feature order, and each one's
    profile is its activation at every residue."""
    rng = np.random.default_rng(3)
    idx = np.stack([rng.permutation(40)[:6] for _ in range(30)]).astype(np.int32)
    vals = (rng.integers(0, 3, size=(30, 6)) / 2).astype(np.float32)  # many tied totals, zeros
    dense = np.zeros((30, 40))
    np.put_along_axis(dense, idx, vals, axis=1)
    totals = dense.sum(axis=0)
    want = [f for f in sorted(range(40), key=lambda f: (-totals[f], f)) if totals[f] > 0][:7]
    rows = top_features(SAEFeatures(idx, vals, 40, 1, "x"), 7)
    assert [r["feature"] for r in rows] == want
    for r in rows:
        np.testing.assert_array_equal(r["profile"], dense[:, r["feature"]])
        assert r["residues_active"] == int((dense[:, r["feature"]] > 0).sum())


def test_features_resume_and_refuse_other_settings(converted, sae_dir, fasta, tmp_path, monkeypatch):
    path, seqs = fasta
    out = tmp_path / "feats"
    model = load(converted)[0]
    calls = []
    original = type(model).hidden_states_at

    def counted(self, ids, *a, **kw):
        calls.append(ids.shape[0])
        return original(self, ids, *a, **kw)

    monkeypatch.setattr(type(model), "hidden_states_at", counted)
    first = features_job(model, sae_dir, out, fasta=path, layers=[2], batch_tokens=64, flush_every=1)
    assert first.computed == 7 and sum(calls) == 7
    calls.clear()
    again = features_job(model, sae_dir, out, fasta=path, layers=[2], batch_tokens=64)
    assert again.skipped == 7 and again.computed == 0 and calls == []
    with open(path, "a") as f:  # a FASTA that grew: only the new record is computed
        f.write(">new\nMKTAYIAKQR\n")
    grown = features_job(model, sae_dir, out, fasta=path, layers=[2], batch_tokens=64)
    assert grown.computed == 1 and sum(calls) == 1
    assert read_features(out).ids[-1] == "new"
    r = run("features", converted, "--sae", sae_dir, "--fasta", path, "-o", out, "--layer", 2, "--normalize",
            "--no-progress")  # fmt: skip
    assert r.exit_code == 1 and r.output.count("Error:") == 1 and "normalize: False there, True now" in r.output
    other = write_random_sae(tmp_path / "other", 128, CODEBOOK, K, [1, 2], seed=9)
    r = run("features", converted, "--sae", other, "--fasta", path, "-o", out, "--layer", 2, "--no-progress")
    assert r.exit_code == 1 and "sae_weights" in r.output
    r = run("features", converted, "--sae", other, "--fasta", path, "-o", out, "--layer", 2, "--force", "--no-progress")
    assert r.exit_code == 0, r.output


def test_features_of_one_sequence_draw_a_heatmap(converted, sae_dir, tmp_path):
    out = tmp_path / "one"
    r = run("features", converted, "--sae", sae_dir, "--sequence", "MKTAYIAKQRQISFVKSHFSRQ", "--layer", 1,
            "-o", out, "--name", "mine", "--no-progress")  # fmt: skip
    assert r.exit_code == 0, r.output
    png = out / "heatmap_mine.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_features(out).get("mine").indices.shape == (22, K)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layer", "7"], "layer 7: this model has hidden states 0..2"),
        ([], "layers 1, 2: say which"),
        (["--layer", "1", "--sequence", "MKJ"], "'J'"),
        (["--layer", "1", "--sequence", "MK", "--fasta", "FASTA"], "give exactly one of --sequence and --fasta"),
    ],
)
def test_features_refusals(converted, sae_dir, fasta, tmp_path, args, message):
    args = [str(fasta[0]) if a == "FASTA" else a for a in args]
    if "--sequence" not in args:
        args += ["--fasta", str(fasta[0])]
    r = run("features", converted, "--sae", sae_dir, "-o", tmp_path / "out", "--no-progress", *args)
    assert r.exit_code == 1 and r.output.count("Error:") == 1 and message in r.output, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
@pytest.mark.parametrize("spec, precision", [("bf16", "bfloat16"), ("8", "8bit")])
def test_quantize_sae_validates_and_pushes(converted, sae_dir, tmp_path, hub, spec, precision):
    out = tmp_path / f"sae-{spec}"
    r = run("quantize-sae", sae_dir, "-o", out, "--q", spec, "--model", converted, "--layers", "2")
    assert r.exit_code == 0, r.output
    assert "SAE validation: PASSED" in r.output
    config = json.loads((out / "config.json").read_text())
    assert config["available_layers"] == [2] and config["k"] == K
    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["passed"] and report["precision"] == precision
    bounds = thresholds.SAE_QUALITY[precision]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["topk_agreement"]["value"] >= bounds["topk_agreement"] == checks["topk_agreement"]["threshold"]
    assert 0 < checks["value_rel_err"]["value"] <= bounds["value_rel_err"]
    assert sorted(p.name for p in out.iterdir()) == [".esmc-mlx", "config.json", "layer_2.safetensors", "validation"]
    features = load(converted)[0].sae_features("MKTAYIAKQRQ", load_sae(out))  # its only layer
    assert features[0].layer == 2
    (out / "notes.txt").write_text("private notes")  # not part of the SAE: never uploaded
    r = run("push", out, "alice/tiny-sae")
    assert r.exit_code == 0, r.output
    assert 'esmc_mlx.load_sae("alice/tiny-sae")' in r.output
    repo = hub.state.repos["alice/tiny-sae"]
    files = set(repo.resolve("main").files)
    assert files == {".gitattributes", "README.md", "config.json", "layer_2.safetensors",
                     "validation/report.json", "validation/report.md"}  # fmt: skip
    card = (out / "README.md").read_text()
    assert "sparse-autoencoder" in card and "Validation: passed" in card and "load_sae" in card
    assert precision.replace("8bit", "8-bit affine") in card


def test_quantize_sae_refusals(converted, sae_dir, tmp_path):
    r = run("quantize-sae", sae_dir, "-o", tmp_path / "a", "--q", "4", "--model", converted)
    assert r.exit_code == 1 and "--q '4' for an SAE: choose one of bf16, fp16, 8" in r.output
    r = run("quantize-sae", sae_dir, "-o", tmp_path / "a", "--q", "8")
    assert r.exit_code == 1 and "give --model" in r.output
    r = run("quantize-sae", sae_dir, "-o", tmp_path / "a", "--q", "8", "--model", converted, "--layers", "5")
    assert r.exit_code == 1 and "no SAE for layer 5" in r.output
    assert not (tmp_path / "a").exists()
    r = run("quantize-sae", sae_dir, "-o", tmp_path / "b", "--q", "bf16", "--no-validate")
    assert r.exit_code == 0 and not (tmp_path / "b" / "validation").exists()
    r = run("push", tmp_path / "b", "alice/unvalidated", "--dry-run")
    assert r.exit_code == 1 and "not validated" in r.output and "quantize-sae" in r.output
