"""Sparse autoencoders: ``load_sae`` and ``sae_features`` against a torch reference written from
esm 3.4's ``EsmcSaeLayer`` / ``EsmcModel._get_sae_outputs`` (the ``esm`` package needs Python 3.12),
on transformers' hidden states; the stop-early forward; bad SAE folders; Hub downloads of only
the files used."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest_hub import hub, no_remote_network  # noqa: F401

from esmc_mlx import SequenceError, load, load_sae
from esmc_mlx.errors import ConfigError, HubError, ScoringError
from esmc_mlx.testing import random_sequences, write_random_sae

SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQ", "MK", "ACDEFGHIKLMNPQRSTVWYXBZUO", "GSHMSLFDKLG|LKVTEAQQR"]
CODEBOOK, K = 256, 8


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def reference_features(reference_model, tokenizer, sequence: str, sae_dir, layer: int, normalize: bool):
    """esm 3.4's SAE features of one sequence, every token, dense (T, codebook), in torch."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    config = json.loads((sae_dir / "config.json").read_text())
    w = load_file(str(sae_dir / f"layer_{layer}.safetensors"))
    ids = torch.tensor(tokenizer([sequence], return_tensors="np")["input_ids"]).long()
    with torch.no_grad():
        states = reference_model(input_ids=ids, output_hidden_states=True).hidden_states
        x = states[layer][0]
        if config.get("use_residual_update_instead_of_states") and layer > 0:
            x = x - states[layer - 1][0]
        x = x - x.mean(dim=-1, keepdim=True)
        x = x / (x.std(dim=-1, keepdim=True) + 1e-5)  # torch's std: Bessel's correction, as esm
        pre = torch.relu((x - w["b_dec"]) @ w["W_enc"])
        top = torch.topk(pre, config["k"], dim=-1)
        dense = torch.zeros_like(pre).scatter(-1, top.indices, top.values)
        if normalize:
            dense = dense / w["max"] * w["idf"]
    return dense.numpy()


@pytest.fixture(scope="module")
def saes(tmp_path_factory, tiny_config):
    root = tmp_path_factory.mktemp("saes")
    d = tiny_config.hidden_size
    return {
        "plain": write_random_sae(root / "plain", d, CODEBOOK, K, [0, 1, 2], seed=1),
        "residual": write_random_sae(root / "residual", d, CODEBOOK, K, [0, 1, 2], residual=True, seed=2),
    }


@pytest.mark.parametrize("kind", ["plain", "residual"])
@pytest.mark.parametrize("normalize", [False, True])
def test_features_match_esm_reference(converted, reference_model, saes, kind, normalize):
    model, tok = load(converted)
    sae = load_sae(saes[kind])
    for layer in (0, 1, 2):  # 2 = n_layers: after the final norm
        got = model.sae_features(SEQUENCES[:3], sae, layer=layer, normalize=normalize)
        for seq, features in zip(SEQUENCES[:3], got):
            want = reference_features(reference_model, tok, seq, saes[kind], layer, normalize)
            assert features.indices.shape == features.values.shape == (len(seq) + 2, K)
            assert features.indices.dtype == np.int32 and features.values.dtype == np.float32
            assert rel_l2(features.dense(), want) <= 1e-4, (kind, layer, seq)
            assert np.all(np.diff(features.values, axis=1) <= 0)  # largest first


def test_features_do_not_depend_on_batching(converted, saes):
    model, _ = load(converted)
    sae = load_sae(saes["residual"])
    seqs = random_sequences(5, 3, 60, seed=4) + SEQUENCES
    alone = [model.sae_features(s, sae, layer=2)[0] for s in seqs]
    batched = model.sae_features(seqs, sae, layer=2, batch_tokens=256)
    one_batch = model.sae_features(seqs, sae, layer=2, batch_tokens=100_000)
    for a, b, c in zip(alone, batched, one_batch):
        assert rel_l2(b.dense(), a.dense()) <= 1e-5 and rel_l2(c.dense(), a.dense()) <= 1e-5


def test_several_saes_and_layers_in_one_pass(converted, saes):
    model, _ = load(converted)
    plain, residual = load_sae(saes["plain"]), load_sae(saes["residual"])
    both = model.sae_features(SEQUENCES, [plain, residual], layer=[1, 2], normalize=True)
    assert sorted(both) == sorted((s.name, i) for s in (plain, residual) for i in (1, 2))
    for (name, layer), results in both.items():
        sae = plain if name == plain.name else residual
        alone = model.sae_features(SEQUENCES, sae, layer=layer, normalize=True)
        for a, b in zip(results, alone):
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_allclose(a.values, b.values, rtol=1e-6)
            assert a.layer == layer and a.sae == name


def test_hidden_states_at_stops_early_with_the_same_states(converted):
    model, tok = load(converted)
    n = model.config.num_hidden_layers
    batch = tok(SEQUENCES, return_tensors="np", return_sequence_id=True)
    full = model(batch["input_ids"], sequence_id=batch["sequence_id"], output_hidden_states=True)
    got = model.hidden_states_at(batch["input_ids"], range(n + 1), sequence_id=batch["sequence_id"])
    assert sorted(got) == list(range(n + 1))
    for i in range(n + 1):
        np.testing.assert_array_equal(np.array(got[i]), np.array(full.hidden_states[i]))
    masked = model.hidden_states_at(batch["input_ids"], [1], attention_mask=batch["attention_mask"])
    plain = model(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    np.testing.assert_array_equal(np.array(masked[1]), np.array(plain.hidden_states[1]))
    # stops at the deepest state asked for: the blocks after it are never run
    calls = []
    for layer in model.esmc.layers:
        original = layer.step
        layer.step = lambda *a, _f=original, **kw: calls.append(1) or _f(*a, **kw)
    try:
        model.hidden_states_at(batch["input_ids"], [1], attention_mask=batch["attention_mask"])
    finally:
        for layer in model.esmc.layers:
            del layer.step
    assert len(calls) == 1
    with pytest.raises(ScoringError, match=r"hidden states 0\.\.2"):
        model.hidden_states_at(batch["input_ids"], [3])


def test_refusals(converted, saes, tmp_path, tiny_config):
    model, _ = load(converted)
    sae = load_sae(saes["plain"])
    with pytest.raises(SequenceError, match="sequence 2: holds <mask>"):
        model.sae_features(["MKTAY", "MK<mask>AY"], sae, layer=1)
    with pytest.raises(ScoringError, match=r"layer 5: this model has hidden states 0\.\.2"):
        model.sae_features("MKTAY", sae, layer=5)
    with pytest.raises(ScoringError, match="layer=N"):
        model.sae_features("MKTAY", sae)  # three layers: which one?
    wide = load_sae(write_random_sae(tmp_path / "wide", tiny_config.hidden_size * 2, 64, 4, [1]))
    with pytest.raises(ScoringError, match="width 256; this model's are 128"):
        model.sae_features("MKTAY", wide)
    only = load_sae(write_random_sae(tmp_path / "one", tiny_config.hidden_size, 64, 4, [1]))
    assert model.sae_features("MKTAY", only)[0].layer == 1  # its only layer, by default
    with pytest.raises(ScoringError, match="has no SAE for layer 2; its layers: 1"):
        model.sae_features("MKTAY", only, layer=2)


def test_bad_sae_folders_name_the_file_and_tensor(converted, saes, tmp_path):
    model, _ = load(converted)
    folder = tmp_path / "sae"
    shutil.copytree(saes["plain"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "k"}))
    with pytest.raises(ConfigError, match=r"config\.json: not a sparse autoencoder config \(no k"):
        load_sae(folder)
    (folder / "config.json").write_text(json.dumps(dict(config, k=CODEBOOK + 1)))
    with pytest.raises(ConfigError, match="k = 257 is larger than codebook_dim"):
        load_sae(folder)
    (folder / "config.json").write_text(json.dumps(dict(config, codebook_dim=128)))
    with pytest.raises(ConfigError, match=r"layer_1\.safetensors: tensor W_enc has shape \(128, 256\), config"):
        model.sae_features("MKTAY", load_sae(folder), layer=1)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "layer_1.safetensors").unlink()
    sae = load_sae(folder)
    assert model.sae_features("MKTAY", sae, layer=2)[0].layer == 2  # layer 1 is never read
    with pytest.raises(ConfigError, match=r"layer_1\.safetensors: missing"):
        model.sae_features("MKTAY", sae, layer=1)
    with pytest.raises(ConfigError, match="no such SAE folder"):
        load_sae(tmp_path / "nothing")


def test_layers_are_read_on_demand_and_released(saes):
    sae = load_sae(saes["plain"])
    assert sae.loaded_layers == []
    layer = sae.layer(2)
    assert sae.loaded_layers == [2] and layer.nbytes == 4 * (128 * CODEBOOK + 128 + 2 * CODEBOOK)
    sae.release(2)
    assert sae.loaded_layers == []


def test_hub_sae_downloads_only_config_and_the_layers_used(hub, converted, saes):
    files = {p.name: p.read_bytes() for p in saes["plain"].iterdir()}
    hub.state.create_repo("my-org/tiny-sae")
    hub.state.commit_files("my-org/tiny-sae", files)
    model, _ = load(converted)
    sae = load_sae("my-org/tiny-sae")
    got = model.sae_features("MKTAYIAKQR", sae, layer=1)
    local = model.sae_features("MKTAYIAKQR", load_sae(saes["plain"]), layer=1)
    np.testing.assert_array_equal(got[0].indices, local[0].indices)
    fetched = {path.rsplit("/", 1)[-1] for method, path, status in hub.state.log if "/resolve/" in path}
    assert fetched == {"config.json", "layer_1.safetensors"}
    with pytest.raises(HubError, match="no such model repo"):
        load_sae("my-org/missing-sae")


def test_quantized_layers_encode_close_to_float(saes, tmp_path):
    from esmc_mlx.convert.sae import parse_sae_spec, write_sae

    reference = load_sae(saes["plain"])
    states = mx.random.normal((64, 128), key=mx.random.key(3))
    want_idx, want_val = reference.layer(1).encode(states)
    for spec in ("bf16", "8"):
        out = tmp_path / spec
        out.mkdir()
        write_sae(reference.config, reference.file, out, parse_sae_spec(spec), [1])
        sae = load_sae(out)
        assert sae.config.available_layers == (1,) and sae.config.precision == (
            "bfloat16" if spec == "bf16" else "8bit"
        )
        idx, val = sae.layer(1).encode(states)
        shared = np.mean([len(set(a) & set(b)) / K for a, b in zip(np.array(idx), np.array(want_idx))])
        assert shared >= 0.9, spec
        assert rel_l2(np.sort(np.array(val), 1), np.sort(np.array(want_val), 1)) <= 0.05, spec


@pytest.mark.parametrize("columns,k", [(256, 8), (2048, 64), (64, 8), (100, 7)])
def test_top_k_finds_the_k_largest_values(columns, k):
    from esmc_mlx.runtime.sae import top_k

    rng = np.random.default_rng(columns + k)
    x = np.maximum(rng.normal(size=(300, columns)), 0).astype(np.float32)  # ReLU: many tied zeros
    x[:50] = np.round(x[:50] * 2) / 2  # and rows of tied positive values
    x[50:60] = 0
    idx = np.array(top_k(mx.array(x), k))
    assert idx.shape == (300, k)
    assert all(len(set(row)) == k for row in idx)  # k distinct columns per row
    found = np.sort(np.take_along_axis(x, idx, axis=1), axis=1)
    np.testing.assert_array_equal(found, np.sort(x, axis=1)[:, -k:])
