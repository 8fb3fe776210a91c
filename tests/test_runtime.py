"""The MLX runtime computes what transformers' EsmcForMaskedLM computes."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")

from esmc_mlx import load
from esmc_mlx.convert import convert
from esmc_mlx.testing import random_sequences, random_transformers_model, write_checkpoint

SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQ", "ACDEFGHIKLMNPQRSTVWY<mask>XBZUO", "MK", "GSHMSLFDKLG|LKVTEAQQR"]


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def torch_forward(model, batch, **kw):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(batch["input_ids"])).long(), output_hidden_states=True, **kw)
    return out


def test_padded_batch_matches_transformers_fp32(converted, reference_model):
    model, tok = load(converted)
    batch = tok(SEQUENCES, return_tensors="np")
    ref = torch_forward(reference_model, batch, attention_mask=torch.tensor(batch["attention_mask"]).long())
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    valid = batch["attention_mask"].astype(bool)
    assert rel_l2(np.array(out.logits)[valid], ref.logits.numpy()[valid]) <= 1e-5
    assert rel_l2(np.array(out.last_hidden_state)[valid], ref.hidden_states[-1].numpy()[valid]) <= 1e-5
    assert len(out.hidden_states) == len(ref.hidden_states)
    for mine, theirs in zip(out.hidden_states, ref.hidden_states):
        assert rel_l2(np.array(mine)[valid], theirs.numpy()[valid]) <= 1e-5


def test_two_chain_input_matches_transformers(converted, reference_model):
    model, tok = load(converted)
    batch = tok(["MKTAYIAKQR|GSHMSLFDKLGG", "LKVTE|AQ"], return_tensors="np", return_sequence_id=True)
    assert batch["sequence_id"][0].max() == 1 and batch["sequence_id"][1, -1] == -1
    ref = torch_forward(reference_model, batch, sequence_id=torch.tensor(batch["sequence_id"]).long())
    out = model(batch["input_ids"], sequence_id=batch["sequence_id"])
    valid = batch["attention_mask"].astype(bool)
    assert rel_l2(np.array(out.logits)[valid], ref.logits.numpy()[valid]) <= 1e-5
    # and chain masking matters: without it the output differs
    unmasked = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    assert rel_l2(np.array(unmasked.logits)[valid], ref.logits.numpy()[valid]) > 1e-3


def test_each_padded_row_equals_its_unpadded_run(converted):
    model, tok = load(converted)
    seqs = random_sequences(6, 3, 40, seed=3)
    batch = tok(seqs)
    padded = np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits)
    for row, seq in enumerate(seqs):
        alone = np.array(model(tok([seq])["input_ids"]).logits)[0]
        np.testing.assert_allclose(padded[row, : len(alone)], alone, rtol=1e-5, atol=1e-5)


def test_bfloat16_within_2e2(tiny_config, tmp_path):
    """bf16 against the fp32 reference: within 2e-2, and no worse than 1.25x torch's own bf16
    error (a random model with perturbed norms is harsher: there torch bf16 itself is ~1.9e-2)."""
    reference = random_transformers_model(tiny_config, seed=1, perturb_norms=False)
    source = write_checkpoint(reference, tmp_path / "src")
    model, tok = load(convert(str(source), tmp_path / "bf16", dtype="bfloat16", progress=False), dtype=mx.bfloat16)
    assert model.dtype == mx.bfloat16
    batch = tok(SEQUENCES, return_tensors="np")
    mask = torch.tensor(batch["attention_mask"]).long()
    ref = torch_forward(reference, batch, attention_mask=mask).logits.numpy()
    torch_bf16 = (
        torch_forward(copy.deepcopy(reference).to(torch.bfloat16), batch, attention_mask=mask).logits.float().numpy()
    )
    out = np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.astype(mx.float32))
    valid = batch["attention_mask"].astype(bool)
    err = rel_l2(out[valid], ref[valid])
    assert 0 < err <= 2e-2
    assert err <= 1.25 * rel_l2(torch_bf16[valid], ref[valid])


def test_cpu_backend_computes_in_float32(checkpoints, tmp_path, on_cpu):
    out_dir = convert(str(checkpoints["published"]), tmp_path / "bf16", dtype="bfloat16", progress=False)
    model, _ = load(out_dir)
    assert model.dtype == mx.float32


def test_attention_weights_are_returned_and_normalised(converted):
    model, tok = load(converted)
    batch = tok(["MKTAYIAK", "MK"])
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
    weights = np.array(out.attentions[0])
    assert weights.shape == (2, 2, 10, 10)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    assert np.all(weights[1, :, :, 4:] == 0)  # padded keys get no attention


def test_runtime_imports_neither_torch_nor_transformers():
    import subprocess
    import sys

    code = (
        "import sys, esmc_mlx, esmc_mlx.runtime, esmc_mlx.cli, esmc_mlx.artifact; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("length", [2048])
def test_long_sequence_runs_on_cpu(converted, length):
    model, tok = load(converted)
    ids = tok(random_sequences(1, length - 2, length - 2, seed=1))["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, length, 64) and bool(mx.all(mx.isfinite(logits)))
