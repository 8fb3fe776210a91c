"""`esmc-mlx embed`, `scan` and `score` under `mlx.launch`: two ranks on 127.0.0.1 (ring
backend) give what one process gives."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from esmc_mlx import load
from esmc_mlx.tasks.jobs import GATHER_ROUNDS, embed_fasta, gather_every, score_csv
from esmc_mlx.tasks.store import read_embeddings
from esmc_mlx.testing import child_env, random_sequences

pytestmark = pytest.mark.skipif(not mx.distributed.is_available(), reason="MLX built without distributed support")
WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"


def free_port_pair() -> int:
    """A port p on 127.0.0.1 with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    pytest.skip("no two consecutive free ports on 127.0.0.1")


def launch(args: list[str], cwd: Path, timeout: int = 150, ok: bool = True) -> str:
    """Run ``esmc-mlx ARGS`` on two ranks; its stdout (``ok``), else its output after a failure."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    prefix = (
        [str(launcher)]
        if launcher.exists()
        else [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]
    )
    command = [
        *prefix,
        "--backend",
        "ring",
        "--hosts",
        "127.0.0.1",
        "-n",
        "2",
        "-p",
        str(free_port_pair()),
        "--",
        sys.executable,
        "-m",
        "esmc_mlx.cli",
        *args,
        "--no-progress",
    ]
    try:
        done = subprocess.run(
            command, cwd=cwd, env=child_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mlx.launch timed out after {timeout} s: {e.stdout}\n{e.stderr}")
    if not ok:  # mlx.launch exits 0 even when its ranks fail: the caller reads the output
        return done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_two_ranks_embed_like_one(converted, tmp_path):
    seqs = random_sequences(11, 3, 50, seed=21)
    fasta = tmp_path / "in.fa"
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(seqs)))
    model = load(converted)[0]
    embed_fasta(model, fasta, tmp_path / "one", per_residue=True, layer=1, batch_tokens=80)
    out = launch(
        [
            "embed",
            str(converted),
            str(fasta),
            "-o",
            str(tmp_path / "two"),
            "--per-residue",
            "--layer",
            "1",
            "--batch-tokens",
            "80",
        ],
        tmp_path,
    )
    assert "Embedded 11 sequences on 2 ranks" in out
    one, two = read_embeddings(tmp_path / "one"), read_embeddings(tmp_path / "two")
    assert one.ids == two.ids
    # Ranks run the very batches one process runs (dealt out round-robin): the same numbers.
    np.testing.assert_array_equal(two.mean, one.mean)
    np.testing.assert_array_equal(two.residues, one.residues)
    np.testing.assert_array_equal(two.offsets, one.offsets)
    assert not list(tmp_path.glob("two/parts/*"))


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_two_ranks_gather_several_times(converted, tmp_path):
    # 70 one-sequence batches: 35 per rank, more than GATHER_ROUNDS, so the ranks gather twice.
    seqs = random_sequences(70, 3, 28, seed=5)
    fasta = tmp_path / "in.fa"
    fasta.write_text("".join(f">q{i}\n{s}\n" for i, s in enumerate(seqs)))
    assert gather_every(40, 128, {(2, "mean"): "mean"}) == GATHER_ROUNDS < 35
    one = embed_fasta(load(converted)[0], fasta, tmp_path / "one", batch_tokens=40)
    assert one.computed == 70
    out = launch(["embed", str(converted), str(fasta), "-o", str(tmp_path / "two"), "--batch-tokens", "40"], tmp_path)
    assert "Embedded 70 sequences on 2 ranks" in out
    a, b = read_embeddings(tmp_path / "one"), read_embeddings(tmp_path / "two")
    assert a.ids == b.ids == [f"q{i}" for i in range(70)]
    np.testing.assert_array_equal(b.mean, a.mean)


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_two_ranks_score_like_one(converted, tmp_path):
    mutants = ["A4G", "K2P:Q11W", "WT", "M1L", "Q33A:E24F:R10C", "T3S", "V32W", "I30L:E31D"]
    csv_in = tmp_path / "dms.csv"
    csv_in.write_text("mutant,DMS_score\n" + "".join(f"{m},{(-1) ** i * i}\n" for i, m in enumerate(mutants)))
    methods = ["masked_marginal", "wt_marginal", "pppl"]
    one = score_csv(load(converted)[0], WT, csv_in, tmp_path / "one.csv", methods=methods, batch_size=8)
    out = launch(
        [
            "score",
            str(converted),
            "--sequence",
            WT,
            "--mutations",
            str(csv_in),
            "-o",
            str(tmp_path / "two.csv"),
            "-B",
            "8",
            *[a for m in methods for a in ("--method", m.replace("_", "-"))],
        ],
        tmp_path,
    )
    assert "on 2 ranks" in out and "Spearman masked_marginal vs DMS_score" in out
    rows = lambda p: [line.split(",") for line in p.read_text().splitlines()]  # noqa: E731
    a, b = rows(tmp_path / "one.csv"), rows(tmp_path / "two.csv")
    assert a[0] == b[0] == ["mutant", "DMS_score", *methods]
    np.testing.assert_allclose(
        np.array([r[2:] for r in b[1:]], float), np.array([r[2:] for r in a[1:]], float), rtol=1e-5, atol=1e-5
    )
    # rank 0 ran about half of the passes (one rounding per job list)
    rank0 = int(re.search(r"; (\d+) forward passes on 2 ranks", out).group(1))
    assert one.passes // 2 <= rank0 <= one.passes // 2 + 2


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_two_ranks_scan_and_embed_layers_like_one(converted, tmp_path):
    model = load(converted)[0]
    fasta = tmp_path / "in.fa"
    seqs = random_sequences(5, 3, 40, seed=22)
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(seqs)))
    out = launch(
        ["scan", str(converted), "--fasta", str(fasta), "-o", str(tmp_path / "scan"), "-B", "4", "--no-plot"], tmp_path
    )
    assert "on 2 ranks" in out
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(np.load(tmp_path / "scan" / f"p{i}_matrix.npy"), model.scan(s).scores, atol=1e-5)
    # a rerun: rank 0 reads the manifest, both ranks skip the same proteins (else they would wait on each other)
    fasta.write_text("".join(f">p{i}\n{s if i else s[:-1]}\n" for i, s in enumerate(seqs)))
    out = launch(
        ["scan", str(converted), "--fasta", str(fasta), "-o", str(tmp_path / "scan"), "-B", "4", "--no-plot"], tmp_path
    )
    assert out.count("Skipped p") == 4 and "Scanned p0" in out, out
    np.testing.assert_allclose(np.load(tmp_path / "scan" / "p0_matrix.npy"), model.scan(seqs[0][:-1]).scores, atol=1e-5)
    # rank 0 refusing OUT (a folder holding another tool's manifest): both ranks stop, neither waits
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "scan-manifest.json").write_text("[]")
    out = launch(["scan", str(converted), "--fasta", str(fasta), "-o", str(tmp_path / "other")], tmp_path, 60, ok=False)
    # Rank 1 stops too: it says why and exits 1, unless the launcher, seeing rank 0 fail first,
    # stops it (-15; CI read that once). Either way the launch ends within its 60 s: no rank waits.
    assert "is a folder esmc-mlx did not make" in out and "scan-manifest.json" in out, out  # the output guard's
    assert "rank 0 could not write" in out or "rank 1 exited with code -15" in out, out
    assert "Traceback" not in out and not list((tmp_path / "other").glob("p*")), out
    embed_fasta(
        model,
        fasta,
        tmp_path / "one",
        layers="0,-1",
        pools="mean,max,per_residue",
        storage="safetensors",
        batch_tokens=40,
    )
    launch(
        [
            "embed",
            str(converted),
            str(fasta),
            "-o",
            str(tmp_path / "two"),
            "--layers",
            "0,-1",
            "--pool",
            "mean,max,per-residue",
            "--format",
            "safetensors",
            "--batch-tokens",
            "40",
        ],
        tmp_path,
    )
    one, two = read_embeddings(tmp_path / "one"), read_embeddings(tmp_path / "two")
    for name in one.arrays:
        np.testing.assert_allclose(np.asarray(two.arrays[name]), np.asarray(one.arrays[name]), atol=1e-5)


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_two_ranks_features_like_one(converted, tmp_path):
    from esmc_mlx.tasks.features import features_job, read_features
    from esmc_mlx.testing import write_random_sae

    sae = write_random_sae(tmp_path / "sae", 128, 64, 4, [1, 2], residual=True)
    seqs = random_sequences(11, 3, 50, seed=22)
    fasta = tmp_path / "in.fa"
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(seqs)))
    features_job(load(converted)[0], sae, tmp_path / "one", fasta=fasta, layers=[1, 2], batch_tokens=80)
    args = ["features", str(converted), "--sae", str(sae), "--fasta", str(fasta), "-o", str(tmp_path / "two")]
    out = launch([*args, "--layer", "1", "--layer", "2", "--batch-tokens", "80"], tmp_path)
    assert "Encoded 11 sequences on 2 ranks" in out
    one, two = read_features(tmp_path / "one"), read_features(tmp_path / "two")
    assert one.ids == two.ids
    for name in one.arrays:  # the very batches one process runs: the same numbers
        np.testing.assert_array_equal(np.asarray(two.arrays[name]), np.asarray(one.arrays[name]))
    assert (tmp_path / "one" / "summary.csv").read_text() == (tmp_path / "two" / "summary.csv").read_text()
