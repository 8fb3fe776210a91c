"""Embeddings of several layers and poolings from one pass, against numpy on transformers'
hidden states; the three storage formats, each resumable; the FASTA read as a stream."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
from click.testing import CliRunner
from transformers import EsmcTokenizer

from esmc_mlx import load
from esmc_mlx.cli import main as cli
from esmc_mlx.errors import FastaError, JobError, ScoringError
from esmc_mlx.tasks.fasta import iter_fasta
from esmc_mlx.tasks.jobs import embed_fasta
from esmc_mlx.tasks.scoring import NonstandardResidueWarning
from esmc_mlx.tasks.store import read_embeddings
from esmc_mlx.testing import random_sequences
from tests.test_scoring import Counting, write_fasta

HF_TOK = EsmcTokenizer()
SEQS = ["MKTAYIAKQRQISFVKSHFSRQ", "MK", "ACDEFGHIKLMNPQRSTVWYXBZUO", "GSHMSLFDKLG"]


@pytest.fixture(scope="module")
def model(converted):
    return load(converted)[0]


def torch_hidden(ref, seq):
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(HF_TOK(seq)["input_ids"]).long()[None], output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]  # each (L + 2, d), <cls> first


@pytest.mark.filterwarnings("ignore::esmc_mlx.tasks.scoring.NonstandardResidueWarning")  # after the first
def test_every_pooling_of_every_layer_matches_numpy_on_transformers(model, reference_model):
    counting = Counting(model)
    with pytest.warns(NonstandardResidueWarning):
        got = counting.embed(SEQS, layers="all", pools="mean,max,cls,per-residue", batch_tokens=60)
    passes = counting.calls
    assert got.layers == (0, 1, 2)
    for i, seq in enumerate(SEQS):
        hidden = torch_hidden(reference_model, seq)
        standard = np.array([c not in "XBZUO" for c in seq])  # mean and max leave X B Z U O out
        for layer in (0, 1, 2):
            h = hidden[layer]
            residues = h[1:-1]
            np.testing.assert_allclose(got.get("mean", layer)[i], residues[standard].mean(0), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got.get("max", layer)[i], residues[standard].max(0), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got.get("cls", layer)[i], h[0], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got.get("per_residue", layer)[i], residues, rtol=1e-4, atol=1e-4)
    # one pass per batch, however many layers and pools
    counting.calls = 0
    counting.embed(SEQS, layer=-1, batch_tokens=60)
    assert counting.calls == passes
    with pytest.raises(ScoringError, match="unknown pooling"):
        model.embed(SEQS, pools="mean,median")
    with pytest.raises(ScoringError, match="out of range"):
        model.embed(SEQS, layers="0,7")


@pytest.mark.parametrize("storage", ["npy", "safetensors", "h5"])
def test_storage_formats_round_trip_and_resume(model, storage, tmp_path, monkeypatch):
    import esmc_mlx.tasks.store as store

    monkeypatch.setattr(store, "SHARD_BYTES", 20_000)  # several safetensors shards
    seqs = random_sequences(12, 4, 40, seed=31)
    fasta = write_fasta(tmp_path / "in.fa", seqs)
    kwargs = dict(
        layers=[0, -1], pools=["mean", "max", "cls", "per_residue"], storage=storage, batch_tokens=64, chunk_records=5
    )
    interrupted = Counting(model, fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        embed_fasta(interrupted, fasta, tmp_path / "out", flush_every=1, **kwargs)
    counting = Counting(model)
    summary = embed_fasta(counting, fasta, tmp_path / "out", **kwargs)
    assert summary.skipped > 0 and summary.skipped + summary.computed == 12
    want = model.embed(seqs, layers=[0, -1], pools=["mean", "max", "cls", "per_residue"])
    stored = read_embeddings(tmp_path / "out")
    assert stored.ids == [f"s{i}" for i in range(12)]
    for layer in (0, 2):
        for pool in ("mean", "max", "cls"):
            np.testing.assert_allclose(np.asarray(stored.get(pool, layer)), want.get(pool, layer), atol=1e-5)
        for i in range(12):
            np.testing.assert_allclose(stored.per_residue(i, layer), want.get("per_residue", layer)[i], atol=1e-5)
    if storage == "safetensors":
        index = json.loads((tmp_path / "out" / "embeddings.safetensors.index.json").read_text())
        assert len(index["shards"]) > 1
    # a grown FASTA computes only the new records, and keeps the stored ones
    grown = write_fasta(tmp_path / "grown.fa", seqs + ["MKVLAAGIVGW"])
    counting = Counting(model)
    summary = embed_fasta(counting, grown, tmp_path / "out", **kwargs)
    assert (summary.skipped, summary.computed) == (12, 1)
    again = read_embeddings(tmp_path / "out")
    np.testing.assert_allclose(np.asarray(again.get("mean", 2))[:12], want.get("mean", 2), atol=1e-5)
    np.testing.assert_allclose(
        again.per_residue("s12", 0), model.embed("MKVLAAGIVGW", layer=0, per_residue=True).per_residue[0], atol=1e-5
    )
    with pytest.raises(JobError, match="other settings"):
        embed_fasta(model, grown, tmp_path / "out", **dict(kwargs, pools=["mean"]))
    # a shrunk FASTA is refused (the stored embeddings of the IDs it lacks are not thrown away
    # unasked); with drop_missing it drops them, computing nothing
    shrunk = write_fasta(tmp_path / "shrunk.fa", seqs[:10])
    kept = {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    with pytest.raises(JobError, match=r"3 IDs that .*shrunk.fa lacks \('s10' \.\.\.\).*--drop-missing"):
        embed_fasta(Counting(model), shrunk, tmp_path / "out", **kwargs)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == kept
    summary = embed_fasta(Counting(model), shrunk, tmp_path / "out", drop_missing=True, **kwargs)
    assert (summary.computed, summary.dropped) == (0, 3)
    last = read_embeddings(tmp_path / "out")
    assert last.ids == [f"s{i}" for i in range(10)]
    if storage == "safetensors":  # no shard of the earlier merges is left behind
        index = json.loads((tmp_path / "out" / "embeddings.safetensors.index.json").read_text())
        assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == sorted(
            s["file"] for s in index["shards"]
        )
    np.testing.assert_allclose(last.per_residue("s9", 0), want.get("per_residue", 0)[9], atol=1e-5)


def test_chunked_streaming_gives_the_same_embeddings(model, tmp_path):
    seqs = random_sequences(10, 4, 40, seed=32)
    fasta = write_fasta(tmp_path / "in.fa", seqs)
    embed_fasta(model, fasta, tmp_path / "a", chunk_records=3, pools=["mean", "per_residue"])
    embed_fasta(model, fasta, tmp_path / "b", chunk_records=1000, pools=["mean", "per_residue"])
    a, b = read_embeddings(tmp_path / "a"), read_embeddings(tmp_path / "b")
    np.testing.assert_allclose(a.mean, b.mean, atol=1e-5)  # batches differ: padding
    np.testing.assert_allclose(a.residues, b.residues, atol=1e-5)


def test_fasta_is_read_as_a_stream(tmp_path):
    path = tmp_path / "big.fa"
    path.write_text(">a\nMKV\n>b\nMKJ\n")
    records = iter_fasta(path)
    assert next(records).id == "a"  # the bad record further on is not read yet
    with pytest.raises(FastaError, match="record 'b': invalid character 'J'"):
        next(records)


@pytest.mark.filterwarnings("ignore::esmc_mlx.tasks.scoring.NonstandardResidueWarning")  # SEQS[2] holds X B Z U O
def test_cli_layers_pools_and_formats(converted, model, tmp_path):
    fasta = write_fasta(tmp_path / "in.fa", SEQS)
    runner = CliRunner()
    r = runner.invoke(
        cli,
        [
            "embed",
            str(converted),
            str(fasta),
            "-o",
            str(tmp_path / "st"),
            "--layers",
            "1,-1",
            "--pool",
            "mean,cls",
            "--per-residue",
            "--format",
            "safetensors",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    stored = read_embeddings(tmp_path / "st")
    want = model.embed(SEQS, layers=[1, -1], pools=["mean", "cls", "per_residue"])
    np.testing.assert_allclose(np.asarray(stored.get("cls", 1)), want.get("cls", 1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(stored.get("mean", -1)), want.get("mean", -1), atol=1e-5)
    np.testing.assert_array_equal(want.get("mean", -1), want.get("mean", 2))
    np.testing.assert_allclose(stored.per_residue(2, 2), want.get("per_residue", 2)[2], atol=1e-5)
    assert sorted(p.name for p in (tmp_path / "st").glob("*.safetensors")) == ["embeddings-00001-of-00001.safetensors"]
    r = runner.invoke(cli, ["embed", str(converted), str(fasta), "-o", str(tmp_path / "bad"), "--pool", "median"])
    assert r.exit_code == 1 and "Error: unknown pooling" in r.output


def test_a_version_1_directory_resumes(model, tmp_path):
    """Directories written before layers/pools/formats (one layer, mean.npy) still resume."""
    seqs = random_sequences(4, 4, 30, seed=33)
    fasta = write_fasta(tmp_path / "in.fa", seqs)
    out = tmp_path / "old"
    out.mkdir()
    from esmc_mlx.tasks.store import sequence_hash

    mean = model.embed(seqs[:3], layer=1).mean
    np.save(out / "mean.npy", mean)
    (out / "index.tsv").write_text(
        "id\tlength\tsha1\n" + "".join(f"s{i}\t{len(s)}\t{sequence_hash(s)}\n" for i, s in enumerate(seqs[:3]))
    )
    (out / "manifest.json").write_text(
        json.dumps(
            {
                "format": "esmc-mlx-embeddings",
                "version": 1,
                "layer": 1,
                "per_residue": False,
                "dtype": "float32",
                "hidden_size": 128,
                "num_hidden_layers": 2,
                "complete": True,
                "count": 3,
            }
        )
    )
    summary = embed_fasta(model, fasta, out, layer=1)
    assert (summary.skipped, summary.computed) == (3, 1)
    np.testing.assert_allclose(read_embeddings(out).mean, model.embed(seqs, layer=1).mean, atol=1e-5)


def test_missing_optional_dependencies_are_clear_errors(converted, tmp_path, monkeypatch):
    import sys

    fasta = write_fasta(tmp_path / "in.fa", SEQS[:1])
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    runner = CliRunner()
    r = runner.invoke(cli, ["embed", str(converted), str(fasta), "-o", str(tmp_path / "h5"), "--format", "h5"])
    assert (
        r.exit_code == 1 and "Error: --format h5 needs h5py: pip install 'h5py>=3.8' (esmc-mlx's h5 extra)" in r.output
    )
    r = runner.invoke(cli, ["scan", str(converted), "--sequence", "MKV", "-o", str(tmp_path / "scan")])
    assert r.exit_code == 1 and "Error: drawing the heatmap needs matplotlib" in r.output
    assert not (tmp_path / "scan").exists()
