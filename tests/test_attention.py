"""Attention maps: ``model(..., output_attentions=True)`` and `esmc-mlx attention` against
transformers' ``output_attentions``, the contact map's formula, bounded chunks, resumes, refusals."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from click.testing import CliRunner

from esmc_mlx import load
from esmc_mlx.cli import main as cli
from esmc_mlx.tasks.attention import apc, write_attention

torch = pytest.importorskip("torch", reason="needs torch: pip install 'esmc-mlx[torch]'")

WT = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
FIDELITY = 1e-5  # validate.thresholds.FIDELITY["float32"]


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def eager_model(reference_model):
    """The reference with eager attention: transformers' sdpa path returns no attention weights."""
    model = copy.deepcopy(reference_model)
    model.set_attn_implementation("eager")
    return model


def transformers_attentions(reference_model, tokenizer, sequences, **kw):
    batch = tokenizer(sequences, return_tensors="np", return_sequence_id=True)
    with torch.no_grad():
        out = reference_model(
            input_ids=torch.tensor(batch["input_ids"]).long(),
            attention_mask=torch.tensor(batch["attention_mask"]).long(),
            output_attentions=True,
            **kw,
        )
    return batch, [a.numpy() for a in out.attentions]


def test_output_attentions_match_transformers(converted, eager_model):
    model, tok = load(converted)
    batch, want = transformers_attentions(eager_model, tok, [WT, WT[:9]])
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
    assert len(out.attentions) == len(want) == model.config.num_hidden_layers
    for mine, theirs in zip(out.attentions, want):
        assert rel_l2(np.array(mine)[0], theirs[0]) <= FIDELITY
        assert rel_l2(np.array(mine)[1, :, :11, :11], theirs[1, :, :11, :11]) <= FIDELITY  # the padded row


def test_attention_command_writes_transformers_maps(converted, eager_model, tmp_path):
    model, tok = load(converted)
    _, want = transformers_attentions(eager_model, tok, [WT])
    r = CliRunner().invoke(
        cli,
        ["attention", str(converted), "--sequence", WT, "-o", str(tmp_path / "attn"), "--heads", "1", "--no-progress"],
    )
    assert r.exit_code == 0, r.output
    assert "Wrote sequence: 33 residues, 2 layers of maps" in r.output
    out = tmp_path / "attn"
    for block in (1, 2):
        maps = np.load(out / f"sequence_layer{block}.npy")
        assert maps.shape == (1, len(WT) + 2, len(WT) + 2) and maps.dtype == np.float32
        assert rel_l2(maps[0], want[block - 1][0, 1]) <= FIDELITY
        np.testing.assert_allclose(maps.sum(axis=-1), 1, atol=1e-5)
    inner = [w[0, 1, 1:-1, 1:-1] for w in want]
    mean = np.mean([(a + a.T) / 2 for a in inner], axis=0)
    contacts = np.load(out / "sequence_contacts.npy")
    assert rel_l2(contacts, apc(mean)) <= FIDELITY
    np.testing.assert_allclose(contacts, contacts.T, atol=1e-7)
    assert (out / "sequence_contacts.png").read_bytes()[:4] == b"\x89PNG"


def test_apc_is_the_average_product_correction():
    x = np.arange(1.0, 10.0).reshape(3, 3)
    want = np.array([[x[i, j] - x[i].sum() * x[:, j].sum() / x.sum() for j in range(3)] for i in range(3)])
    np.testing.assert_allclose(apc(x), want)


def test_maps_do_not_depend_on_the_head_chunk(converted, tmp_path):
    model, _ = load(converted)
    two_chains = "MKTAYIAKQR|GSHMSLFDKLG"
    one = (
        write_attention(model, two_chains, (tmp_path / "a"), "x", [1, 2], [0, 1], head_chunk=1, plot=False)
        if ((tmp_path / "a").mkdir() or True)
        else None
    )
    (tmp_path / "b").mkdir()
    both = write_attention(model, two_chains, tmp_path / "b", "x", [1, 2], [0, 1], plot=False)
    for name in ("x_layer1.npy", "x_layer2.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "a" / name), np.load(tmp_path / "b" / name))
    # the mean sums the heads in another order: the same up to rounding
    np.testing.assert_allclose(np.load(tmp_path / "a" / "x_contacts.npy"), one.contacts)
    np.testing.assert_allclose(one.contacts, both.contacts, rtol=1e-5, atol=1e-7)
    assert one.nbytes == both.nbytes == 2 * 2 * 4 * (len(two_chains) + 2) ** 2
    maps = np.load(tmp_path / "a" / "x_layer1.npy")
    assert np.all(maps[:, 1:11, 12:-1] == 0)  # chains attend within themselves only


def test_attention_resumes_and_refuses(converted, tmp_path):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{WT}\n>b\n{WT[:12]}\n")
    args = ["attention", str(converted), "--fasta", str(fasta), "-o", str(tmp_path / "attn"), "--no-plot"]
    r = CliRunner().invoke(cli, [*args, "--layers", "-1", "--no-progress"])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "attn" / "attention-manifest.json").read_text())
    assert set(manifest["proteins"]) == {"a", "b"}
    assert sorted(p.name for p in (tmp_path / "attn").glob("*.npy")) == [
        "a_contacts.npy", "a_layer2.npy", "b_contacts.npy", "b_layer2.npy"]  # fmt: skip
    r = CliRunner().invoke(cli, [*args, "--layers", "-1", "--no-progress"])
    assert r.exit_code == 0 and r.output.count("Skipped") == 2, r.output
    r = CliRunner().invoke(cli, [*args, "--layers", "2", "--force", "--no-progress"])
    assert r.exit_code == 0 and r.output.count("Wrote a:") == 1, r.output
    for bad, message in (
        (["--layers", "3"], "layer 3: this model's blocks are 1..2"),
        (["--heads", "2"], "head 2: this model's heads are 0..1"),
        (["--heads", "x"], "heads 'x': give comma-separated head indices"),
    ):
        r = CliRunner().invoke(cli, [*args, *bad, "--no-progress"])
        assert r.exit_code == 1 and r.output.count("Error:") == 1 and message in r.output, r.output
