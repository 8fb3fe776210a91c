"""scripts/train_tiny.py's pieces: schedule, batches, masking, evaluation, one short run."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.esmc")

from test_tiny_data import load_script  # noqa: E402

tt = load_script("train_tiny")


@pytest.fixture(scope="module")
def tok():
    from transformers import EsmcTokenizer

    return tt.Tokens.from_vocab(EsmcTokenizer().get_vocab())


def test_tokens_encode_like_the_tokenizer(tok):
    from transformers import EsmcTokenizer

    seq = "MKVLAXBZUOC"
    assert tok.encode(seq).tolist() == EsmcTokenizer()(seq)["input_ids"][1:-1]


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    peak, warmup, steps = 1e-3, 10, 110
    assert tt.lr_at(0, peak, warmup, steps) == pytest.approx(1e-4)
    assert tt.lr_at(9, peak, warmup, steps) == pytest.approx(peak)
    assert tt.lr_at(60, peak, warmup, steps) == pytest.approx(0.55 * peak)
    assert tt.lr_at(110, peak, warmup, steps) == pytest.approx(0.1 * peak)
    assert tt.lr_at(500, peak, warmup, steps) == pytest.approx(0.1 * peak)


def test_epoch_batches_cover_every_sequence_within_the_token_budget():
    rng = np.random.default_rng(0)
    seqs = [np.full(n, i, dtype=np.int64) for i, n in enumerate(rng.integers(20, 300, size=500))]
    batches = tt.epoch_batches(seqs, np.random.default_rng(1), crop=100, batch_tokens=2048)
    crops = [c for b in batches for c in b]
    assert sorted(int(c[0]) for c in crops) == list(range(500))  # each sequence once, as one crop
    for c in crops:
        assert len(c) == min(100, len(seqs[int(c[0])]))
    for b in batches:
        assert len(b) * (max(len(c) for c in b) + 2) <= 2048
    again = tt.epoch_batches(seqs, np.random.default_rng(1), crop=100, batch_tokens=2048)
    assert [[c.tolist() for c in b] for b in again] == [[c.tolist() for c in b] for b in batches]


def test_mlm_mask_touches_only_residues_in_80_10_10(tok):
    chunks = [np.full(n, 5, dtype=np.int64) for n in (500, 300, 700)] * 10  # all "A": 15,000 residues
    ids = tt.batch_tensor(chunks, tok)
    assert ids.shape == (30, 704) and ids[0, 0] == tok.cls_id and ids[1, 301] == tok.eos_id
    inputs, labels = tt.mlm_mask(ids, tok, torch.Generator().manual_seed(0))
    picked = labels != -100
    residue = tt.residue_positions(ids, tok)
    assert not (picked & ~residue).any() and (inputs[~picked] == ids[~picked]).all()
    assert 0.13 < picked.sum() / residue.sum() < 0.17
    n = picked.sum().item()
    masked = (inputs[picked] == tok.mask_id).sum().item()
    kept = (inputs[picked] == ids[picked]).sum().item()  # 10% kept + random draws of "A"
    assert 0.75 < masked / n < 0.85 and 0.08 < kept / n < 0.16
    assert set(inputs[picked].tolist()) <= set(tok.standard.tolist()) | {tok.mask_id}


@pytest.fixture
def keep_torch_determinism():
    """train() turns on torch's deterministic algorithms for the process; undo it for later tests."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_short_cpu_run_writes_a_checkpoint_and_metrics(tmp_path, keep_torch_determinism):
    td = load_script("tiny_data")
    rng = np.random.default_rng(0)
    records = [
        td.Record(f"p:f:{i}", str(i), "", "", "".join(rng.choice(list(td.STANDARD), size=n)), "p", "f", "uniprot")
        for i, n in enumerate(rng.integers(30, 90, size=40))
    ]
    splits = {r.name: ("test" if i < 4 else "val" if i < 8 else "train") for i, r in enumerate(records)}
    td.write_dataset(records, splits, tmp_path / "data.fasta")
    out = tmp_path / "out"
    argv = [
        "train",
        "--data",
        str(tmp_path / "data.fasta"),
        "--out",
        str(out),
        "--steps",
        "4",
        "--warmup",
        "1",
        "--eval-every",
        "2",
        "--log-every",
        "1",
        "--hidden",
        "64",
        "--heads",
        "1",
        "--layers",
        "1",
        "--intermediate",
        "256",
        "--batch-tokens",
        "512",
    ]
    tt.main(argv)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 4 and [h["step"] for h in metrics["history"]] == [2, 4]
    assert metrics["best_step"] in (2, 4)
    assert metrics["test"]["masked_residues"] == sum(len(r.seq) for r in records[:4])  # every residue once
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    tt.main(argv[:4] + [str(tmp_path / "again")] + argv[5:])
    again = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert [h["train_loss"] for h in again["history"]] == [h["train_loss"] for h in metrics["history"]]
    assert again["test"] == metrics["test"]


def test_the_packaged_card_is_the_one_the_script_writes_from_the_run_s_metrics():
    """The card's text lives in the script; the shipped README.md is its output for metrics.json."""
    from pathlib import Path

    data = Path(__file__).resolve().parent.parent / "esmc_mlx" / "data" / "esmc-tiny"
    card = tt.model_card(json.loads((data / "metrics.json").read_text()))
    assert card == (data / "README.md").read_text()
    assert "small demo model" in card and "not a model for biology" in card
