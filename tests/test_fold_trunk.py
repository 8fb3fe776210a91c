"""The ESMFold2 trunk and confidence head compute what transformers' twins compute (float32, CPU),
module by module on random weights, and the whole trunk under the reference's own draws."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
pytest.importorskip("transformers.models.esmfold2", reason="needs transformers with ESMFold2")

from transformers.models.esmfold2 import modeling_esmfold2 as ref  # noqa: E402
from transformers.models.esmfold2.protein_utils import prepare_protein_features  # noqa: E402

from esmc_mlx.fold_config import FoldConfig  # noqa: E402
from esmc_mlx.runtime.fold.confidence import ConfidenceHead, intra_token_index  # noqa: E402
from esmc_mlx.runtime.fold.draws import Replay  # noqa: E402
from esmc_mlx.runtime.fold.trunk import (  # noqa: E402
    LanguageModelEncoder,
    PairUpdateStack,
    Parcae,
    TriangleMultiplicativeUpdate,
    pair_mask_of,
    run_trunk_loops,
)
from esmc_mlx.testing import random_transformers_fold_model, tiny_fold_config  # noqa: E402

B, L = 2, 11  # L is no multiple of the chunk sizes below
VALID = (11, 7)  # the second row padded


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def port(mlx_module: nn.Module, torch_module) -> nn.Module:
    """``torch_module``'s state dict into ``mlx_module``, by the very same names (strict: a missing
    or extra name, or another shape, fails)."""
    state = {k: v.detach().numpy() for k, v in torch_module.state_dict().items()}
    assert set(dict(tree_flatten(mlx_module.parameters()))) == set(state)
    mlx_module.load_weights([(k, mx.array(v)) for k, v in state.items()], strict=True)
    return mlx_module


@pytest.fixture(scope="module")
def reference():
    return random_transformers_fold_model()


@pytest.fixture(scope="module")
def config():
    return FoldConfig.from_dict(tiny_fold_config())


def both(array: np.ndarray):
    return torch.from_numpy(array), mx.array(array)


def random_pair(seed: int = 0, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return both((scale * rng.standard_normal((B, L, L, 32))).astype(np.float32))


def token_mask() -> np.ndarray:
    return np.arange(L)[None, :] < np.array(VALID)[:, None]


def pair_masks():
    m = token_mask().astype(np.float32)
    return both(m[:, :, None] * m[:, None, :])


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
@pytest.mark.parametrize("chunk_size", [None, 3, 8], ids=["unchunked", "chunk3", "chunk8"])
def test_triangle_update_matches_transformers(reference, config, outgoing, chunk_size):
    layer = reference.folding_trunk.layers[0]
    theirs = layer.tri_mul_out if outgoing else layer.tri_mul_in
    mine = port(TriangleMultiplicativeUpdate(config, outgoing=outgoing), theirs)
    mine.chunk_size = chunk_size
    kept, theirs.chunk_size = theirs.chunk_size, chunk_size
    try:
        (pair_t, pair_m), (mask_t, mask_m) = random_pair(), pair_masks()
        with torch.no_grad():
            expected = theirs(pair_t, visibility=mask_t).numpy()
            unmasked = theirs(pair_t).numpy()
    finally:
        theirs.chunk_size = kept
    assert rel_l2(mine(pair_m, visibility=mask_m), expected) <= 1e-5
    assert rel_l2(mine(pair_m), unmasked) <= 1e-5
    assert rel_l2(expected, unmasked) > 1e-2  # the mask matters


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_chunked_matmul_contraction_is_the_einsum(config, outgoing):
    """The contraction as chunked matmuls on transposed layouts equals the reference's einsum."""
    rng = np.random.default_rng(1)
    left, right = (mx.array(rng.standard_normal((B, L, L, 32)).astype(np.float32)) for _ in range(2))
    expected = np.array(mx.einsum("bikd,bjkd->bijd" if outgoing else "bkid,bkjd->bijd", left, right))
    update = TriangleMultiplicativeUpdate(config, outgoing=outgoing)
    left_t, right_t = update._layout(left), mx.contiguous(update._layout(right))
    for step in (1, 4, L):
        rows = [slice(i, i + step) for i in range(0, L, step)]
        got = mx.concatenate([update._triangular_contract(left_t, right_t, r) for r in rows], axis=1)
        np.testing.assert_allclose(np.array(got), expected, rtol=1e-6, atol=1e-6)


def test_pair_update_stack_matches_transformers(reference, config):
    theirs = reference.folding_trunk
    mine = port(PairUpdateStack(config, config.folding_trunk_num_hidden_layers), theirs)
    (pair_t, pair_m), (mask_t, mask_m) = random_pair(2), pair_masks()
    with torch.no_grad():
        expected = theirs(pair_t, pair_attention_mask=mask_t).numpy()
    assert rel_l2(mine(pair_m, pair_attention_mask=mask_m), expected) <= 1e-5


def test_parcae_matches_transformers(reference, config):
    theirs = reference.parcae
    mine = port(Parcae(config), theirs)
    with torch.no_grad():
        decay_t, matrix_t = theirs.discretize()
    decay_m, matrix_m = mine.discretize()
    assert rel_l2(decay_m, decay_t.numpy()) <= 1e-6
    assert rel_l2(matrix_m, matrix_t.numpy()) <= 1e-6

    (state_t, state_m), (inj_t, inj_m), (mask_t, mask_m) = random_pair(3), random_pair(4), pair_masks()
    with torch.no_grad():
        step = theirs(state_t, inj_t, decay_t.view(1, 1, 1, -1), matrix_t).numpy()
        decoded = theirs.decode_state(state_t, pair_attention_mask=mask_t).numpy()
    assert rel_l2(mine(state_m, inj_m, decay_m, matrix_m), step) <= 1e-5
    assert rel_l2(mine.decode_state(state_m, pair_attention_mask=mask_m), decoded) <= 1e-5


def test_language_model_encoder_matches_transformers(reference, config):
    theirs = reference.language_model
    mine = port(LanguageModelEncoder(config), theirs)
    lm = config.esmc_config
    hidden = np.random.default_rng(5).standard_normal((B, L, lm.num_hidden_layers + 1, lm.hidden_size))
    hidden_t, hidden_m = both(hidden.astype(np.float32))
    with torch.no_grad():
        expected = theirs(hidden_t).numpy()
    assert expected.shape == (B, L, L, config.pairwise_hidden_size)
    assert rel_l2(mine(hidden_m), expected) <= 1e-5


def test_intra_token_index_restarts_at_each_token():
    atom_to_token = mx.array([[0, 0, 0, 1, 2, 2, 0, 0], [0, 1, 1, 1, 1, 3, 3, 4]])
    expected = [[0, 1, 2, 0, 0, 1, 0, 1], [0, 0, 1, 2, 3, 0, 1, 0]]
    assert intra_token_index(atom_to_token).tolist() == expected


def confidence_inputs(config: FoldConfig, samples: int, seed: int = 6) -> dict[str, np.ndarray]:
    """Two chains (asym 0/1) with a ligand token, the second input padded; one token holds more
    atoms than ``max_atoms_per_token`` (the per-slot weights clamp)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 6, size=(B, L))
    counts[0, 2] = config.max_atoms_per_token + 3
    mask = token_mask()
    counts = counts * mask
    num_atoms = int(counts.sum(axis=1).max()) + 5
    atom_to_token = np.zeros((B, num_atoms), dtype=np.int64)
    atom_mask = np.zeros((B, num_atoms), dtype=bool)
    rep_idx = np.zeros((B, L), dtype=np.int64)
    for b in range(B):
        owners = np.repeat(np.arange(L), counts[b])
        atom_to_token[b, : len(owners)] = owners
        atom_mask[b, : len(owners)] = True
        starts = np.concatenate([[0], np.cumsum(counts[b])[:-1]])
        rep_idx[b] = np.where(mask[b], starts + rng.integers(0, np.maximum(counts[b], 1)), 0)
    asym = (np.arange(L)[None, :] >= np.array([6, 4])[:, None]).astype(np.int64) * mask
    mol_type = np.zeros((B, L), dtype=np.int64)
    mol_type[0, 9] = 3
    f32 = np.float32
    return dict(
        single_inputs=rng.standard_normal((B, L, config.single_inputs_size)).astype(f32),
        pair_states=rng.standard_normal((B, L, L, config.pairwise_hidden_size)).astype(f32),
        predicted_coords=(6.0 * rng.standard_normal((B * samples, num_atoms, 3))).astype(f32),
        distogram_atom_idx=rep_idx,
        attention_mask=mask,
        atom_to_token=atom_to_token,
        atom_attention_mask=atom_mask,
        asym_id=asym,
        mol_type=mol_type,
        relative_position_encoding=rng.standard_normal((B, L, L, config.pairwise_hidden_size)).astype(f32),
        token_bonds_encoding=rng.standard_normal((B, L, L, config.pairwise_hidden_size)).astype(f32),
    )


CONFIDENCE_KEYS = {
    "plddt_logits",
    "plddt",
    "plddt_per_atom",
    "plddt_ca",
    "complex_plddt",
    "complex_iplddt",
    "resolved_logits",
    "pae_logits",
    "pae",
    "pde_logits",
    "pde",
    "ptm",
    "iptm",
    "pair_chains_iptm",
}


def test_confidence_head_matches_transformers(reference, config):
    samples = 2
    theirs = reference.confidence_head
    mine = port(ConfidenceHead(config), theirs)
    assert "boundaries" in dict(tree_flatten(mine.parameters()))
    inputs = confidence_inputs(config, samples)
    with torch.no_grad():
        expected = theirs(**{k: torch.from_numpy(v) for k, v in inputs.items()}, num_diffusion_samples=samples)
    got = mine(**{k: mx.array(v) for k, v in inputs.items()}, num_diffusion_samples=samples)
    assert set(got) == set(expected) == CONFIDENCE_KEYS
    for key in CONFIDENCE_KEYS:
        want = expected[key].numpy()
        assert got[key].shape == want.shape, key
        assert rel_l2(got[key], want) <= 1e-5, key
    # the inputs reach what they are meant to test: both chains, the interface and the clamp
    assert expected["pair_chains_iptm"].shape == (B * samples, 2, 2)
    assert float(expected["complex_iplddt"].abs().sum()) > 0
    assert int(mx.max(intra_token_index(mx.array(inputs["atom_to_token"])))) >= config.max_atoms_per_token
    # [B, S, A, 3] coordinates read as the flat [B * S, A, 3] ones
    coords = mx.array(inputs["predicted_coords"]).reshape(B, samples, -1, 3)
    again = mine(
        **{k: mx.array(v) for k, v in inputs.items() if k != "predicted_coords"},
        predicted_coords=coords,
        num_diffusion_samples=samples,
    )
    assert np.array_equal(np.array(again["pae"]), np.array(got["pae"]))


def padded_features(sequences: list[str]) -> dict[str, torch.Tensor]:
    """prepare_protein_features per sequence, right-padded to one batch (tokens and atoms)."""
    feats = [prepare_protein_features(s) for s in sequences]
    n_tok = max(f["token_index"].shape[1] for f in feats)
    n_atom = max(f["ref_pos"].shape[1] for f in feats)
    atom_keys = {
        "ref_pos",
        "ref_element",
        "ref_charge",
        "ref_atom_name_chars",
        "ref_space_uid",
        "atom_attention_mask",
        "atom_to_token",
    }
    token_keys = {
        "token_index",
        "residue_index",
        "asym_id",
        "sym_id",
        "entity_id",
        "mol_type",
        "res_type",
        "attention_mask",
        "deletion_mean",
    }
    out = {}
    for key in atom_keys | token_keys | {"token_bonds"}:
        rows = []
        for f in feats:
            x = f[key][0]
            pad = [0, 0] * (x.ndim - 1)
            if key == "token_bonds":
                x = torch.nn.functional.pad(x, [0, 0, 0, n_tok - x.shape[1], 0, n_tok - x.shape[0]])
            else:
                size = n_atom if key in atom_keys else n_tok
                x = torch.nn.functional.pad(x, pad + [0, size - x.shape[0]])
            rows.append(x)
        out[key] = torch.stack(rows)
    return out


@pytest.mark.parametrize(
    "case",
    ["lm-dropout", "msa-config-no-dropout", "no-lm"],
)
def test_trunk_loops_match_transformers_forward(case, monkeypatch):
    """EsmFold2Model.forward's pair states and distogram, from the reference's own input embedder
    outputs and its recorded draws replayed: the MLX language-model encoder, the truncated-normal
    start, every loop's dropout mask, parcae, the stacks, the decode and the distogram head."""
    overrides = {}
    if case == "msa-config-no-dropout":  # an MSA encoder in the config (its weights unused without MSA)
        overrides = dict(
            msa_encoder=dict(enabled=True, num_hidden_layers=2), lm_encoder=dict(num_hidden_layers=1, lm_dropout=0.0)
        )
    raw = tiny_fold_config(**overrides)
    reference, config = random_transformers_fold_model(raw, seed=1), FoldConfig.from_dict(raw)
    assert (reference.msa_encoder is not None) == config.msa_encoder.enabled

    recorded = []
    trunc_normal = torch.nn.init.trunc_normal_

    def recording_trunc_normal(tensor, *args, **kwargs):
        out = trunc_normal(tensor, *args, **kwargs)
        recorded.append(tensor.detach().clone().numpy())
        return out

    def recording_dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        keep = torch.rand(x.shape) >= p
        recorded.append(keep.numpy())
        return x * keep / (1.0 - p)

    monkeypatch.setattr(torch.nn.init, "trunc_normal_", recording_trunc_normal)
    monkeypatch.setattr(torch.nn.functional, "dropout", recording_dropout)
    embedded = []
    hook = reference.input_embedder.register_forward_hook(lambda module, args, out: embedded.append(out))

    feats = padded_features(["MKTAYIAKQR", "GSHMSL"])
    atom_names = [f.name for f in dataclasses.fields(ref.EsmFold2AtomInputs)]
    atom_inputs = ref.EsmFold2AtomInputs(**{k: feats.pop(k) for k in atom_names})
    lm = config.esmc_config
    batch, n_tok = feats["token_index"].shape
    hidden = None
    if case != "no-lm":
        rng = np.random.default_rng(7)
        hidden = rng.standard_normal((batch, n_tok, lm.num_hidden_layers + 1, lm.hidden_size)).astype(np.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        expected = reference(
            **feats,
            atom_inputs=atom_inputs,
            lm_hidden_states=None if hidden is None else torch.from_numpy(hidden),
            num_loops=2,
        )
    hook.remove()

    draws_expected = 1 + (3 if case == "lm-dropout" else 0)
    assert len(recorded) == draws_expected
    initial_pair_states = mx.array(embedded[0][1].numpy())
    lm_pair_states = None
    if hidden is not None:
        lm_pair_states = port(LanguageModelEncoder(config), reference.language_model)(mx.array(hidden))
    replay = Replay(recorded)
    d = config.pairwise_hidden_size
    got = run_trunk_loops(
        config,
        initial_pair_states,
        lm_pair_states,
        pair_mask_of(mx.array(feats["attention_mask"].numpy())),
        folding_trunk=port(PairUpdateStack(config, config.folding_trunk_num_hidden_layers), reference.folding_trunk),
        lm_encoder=port(PairUpdateStack(config, config.lm_encoder.num_hidden_layers), reference.lm_encoder),
        parcae=port(Parcae(config), reference.parcae),
        distogram_head=port(nn.Linear(d, config.structure_head.num_distogram_bins), reference.distogram_head),
        draws=replay,
        num_loops=2,
    )
    assert replay.used == len(recorded)
    assert got.pair_states.dtype == mx.float32
    assert rel_l2(got.pair_states, expected.pair_states.numpy()) <= 1e-4
    assert rel_l2(got.distogram_logits, expected.distogram_logits.numpy()) <= 1e-4


# transformers' _keep_in_fp32_modules_strict: the names that stay float32 in a bfloat16 model
FLOAT32_NAMES = ("fourier", "norm.weight", "norm.bias", "norm_mix", "norm_start", "norm_single", "boundaries")


def as_bfloat16(module: nn.Module) -> nn.Module:
    """The module as a bfloat16 checkpoint loads: float32 where the reference pins it."""
    params = tree_flatten(module.parameters())
    module.load_weights([(k, v if any(n in k for n in FLOAT32_NAMES) else v.astype(mx.bfloat16)) for k, v in params])
    return module


def test_bfloat16_keeps_the_reference_dtypes(reference, config):
    """A bfloat16 trunk stays bfloat16 between its float32 norms (no silent promotion of the L^3
    work), hands back float32 pair states and distogram, and lands near the float32 numbers."""
    stack = port(PairUpdateStack(config, config.folding_trunk_num_hidden_layers), reference.folding_trunk)
    lm_stack = port(PairUpdateStack(config, config.lm_encoder.num_hidden_layers), reference.lm_encoder)
    parcae = port(Parcae(config), reference.parcae)
    lm_encoder = port(LanguageModelEncoder(config), reference.language_model)
    head = port(nn.Linear(32, config.structure_head.num_distogram_bins), reference.distogram_head)
    confidence = port(ConfidenceHead(config), reference.confidence_head)
    lm = config.esmc_config
    rng = np.random.default_rng(8)
    hidden = mx.array(rng.standard_normal((B, L, lm.num_hidden_layers + 1, lm.hidden_size)).astype(np.float32))
    initial = random_pair(9)[1]
    mask = pair_masks()[1]
    draws = [rng.standard_normal((B, L, L, 32)).astype(np.float32) * 0.1] + [
        rng.random((B, L, L, 32)) >= config.lm_encoder.lm_dropout for _ in range(config.num_loops + 1)
    ]

    def trunk():
        return run_trunk_loops(
            config,
            initial,
            lm_encoder(hidden),
            mask,
            folding_trunk=stack,
            lm_encoder=lm_stack,
            parcae=parcae,
            distogram_head=head,
            draws=Replay(draws),
        )

    full = trunk()
    for module in (stack, lm_stack, parcae, lm_encoder, confidence):
        as_bfloat16(module)
    assert parcae.input_norm.weight.dtype == mx.float32 and parcae.out_proj.weight.dtype == mx.bfloat16
    initial = initial.astype(mx.bfloat16)
    assert lm_encoder(hidden).dtype == mx.bfloat16
    assert stack(initial, pair_attention_mask=mask).dtype == mx.bfloat16
    decay, matrix = parcae.discretize()
    assert parcae(initial, initial, decay.astype(mx.bfloat16), matrix.astype(mx.bfloat16)).dtype == mx.bfloat16
    half = trunk()
    assert half.pair_states.dtype == half.distogram_logits.dtype == mx.float32
    assert rel_l2(half.pair_states, full.pair_states) < 1e-1
    assert rel_l2(half.distogram_logits, full.distogram_logits) < 1e-1

    inputs = {k: mx.array(v) for k, v in confidence_inputs(config, 1).items()}
    inputs["single_inputs"] = inputs["single_inputs"].astype(mx.bfloat16)
    out = confidence(**inputs)
    assert out["pae_logits"].dtype == out["plddt_logits"].dtype == mx.bfloat16
    assert out["plddt"].dtype == out["pae"].dtype == out["ptm"].dtype == mx.float32
