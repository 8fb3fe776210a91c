"""The ESMFold2 atom stack, input embedder and denoiser compute what transformers' twins compute."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")

from transformers.models.esmfold2 import modeling_esmfold2 as ref  # noqa: E402
from transformers.models.esmfold2.protein_utils import prepare_protein_features  # noqa: E402

from esmc_mlx.fold_config import FoldConfig  # noqa: E402
from esmc_mlx.runtime.fold.atoms import AtomAttention, AtomDecoder, AtomEncoder, AtomInputs  # noqa: E402
from esmc_mlx.runtime.fold.diffusion import DiffusionConditioning, DiffusionModule  # noqa: E402
from esmc_mlx.runtime.fold.inputs import InputEmbedder, RelativePositionEncoding  # noqa: E402
from esmc_mlx.testing import random_transformers_fold_model, tiny_fold_config  # noqa: E402

TOL = 1e-5
SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMWLKE"]  # 22 and 8 residues: 192 and 64 atom slots


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def to_mx(t) -> mx.array:
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    return mx.array(t.numpy())


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def load_from(mlx_module, torch_module):
    """``torch_module``'s state_dict (buffers included) into ``mlx_module``; any name missing on either
    side or any shape mismatch fails."""
    state = torch_module.state_dict()
    assert set(dict(tree_flatten(mlx_module.parameters()))) == set(state)
    mlx_module.load_weights([(k, to_mx(v)) for k, v in state.items()], strict=True)
    return mlx_module


@pytest.fixture(scope="module")
def models():
    config = tiny_fold_config()
    return random_transformers_fold_model(config, seed=0), FoldConfig.from_dict(config)


def _pad(tensor, length: int, axes: tuple[int, ...]):
    pad = []
    for dim in reversed(range(tensor.dim())):
        pad += [0, length - tensor.shape[dim] if dim in axes else 0]
    return torch.nn.functional.pad(tensor, pad)


def batch_features(sequences: list[str]) -> dict:
    """``prepare_protein_features`` of each sequence, right-padded (zeros/False) to one batch."""
    each = [prepare_protein_features(s) for s in sequences]
    tokens = max(f["res_type"].shape[1] for f in each)
    atoms = max(f["ref_pos"].shape[1] for f in each)
    out = {}
    for key in each[0]:
        parts = []
        for f in each:
            t = f[key]
            if key.startswith(("ref_", "atom_")):
                t = _pad(t, atoms, (1,))
            elif key == "token_bonds":
                t = _pad(t, tokens, (1, 2))
            elif key in ("msa", "msa_attention_mask", "has_deletion", "deletion_value"):
                t = _pad(t, tokens, (2,))
            else:
                t = _pad(t, tokens, (1,))
            parts.append(t)
        out[key] = torch.cat(parts)
    return out


def prepared(model, features: dict, seed: int = 0):
    """The reference's featurized (one-hot) atom inputs as torch and MLX, plus the token features,
    with a random profile and deletion mean so that a swapped input shows."""
    res_type_one_hot, _, _, element, chars, atom_to_token = model._prepare_features(
        res_type=features["res_type"],
        attention_mask=features["attention_mask"],
        msa=None,
        msa_attention_mask=None,
        deletion_mean=features["deletion_mean"],
        ref_element=features["ref_element"],
        ref_atom_name_chars=features["ref_atom_name_chars"],
        atom_attention_mask=features["atom_attention_mask"],
        atom_to_token=features["atom_to_token"],
    )
    fields = dict(
        ref_pos=features["ref_pos"],
        ref_charge=features["ref_charge"],
        atom_attention_mask=features["atom_attention_mask"],
        ref_element=element,
        ref_atom_name_chars=chars,
        ref_space_uid=features["ref_space_uid"],
        atom_to_token=atom_to_token,
    )
    g = torch.Generator().manual_seed(seed)
    tokens = dict(
        res_type_one_hot=res_type_one_hot,
        profile=torch.softmax(torch.randn(res_type_one_hot.shape, generator=g), -1),
        deletion_mean=torch.rand(res_type_one_hot.shape[:2], generator=g),
    )
    return ref.EsmFold2AtomInputs(**fields), AtomInputs(**{k: to_mx(v) for k, v in fields.items()}), tokens


@pytest.fixture(scope="module")
def padded(models):
    return prepared(models[0], batch_features(SEQUENCES)), batch_features(SEQUENCES)


@pytest.fixture(scope="module")
def single(models):
    features = prepare_protein_features(SEQUENCES[0])
    return prepared(models[0], features), features


def test_atom_window_mask_and_attention_match_transformers(models, padded):
    model, config = models
    (torch_atoms, mlx_atoms, _), _ = padded
    torch_encoder = model.input_embedder.atom_encoder
    encoder = load_from(AtomEncoder(config, config.atom_encoder), torch_encoder)
    with torch.no_grad():
        embeds, position = torch_encoder.embed_atoms(torch_atoms)
        torch_mask = torch_encoder.build_attention_mask(torch_atoms.atom_attention_mask, embeds)
    mlx_embeds, mlx_position = encoder.embed_atoms(mlx_atoms)
    mask = encoder.build_attention_mask(mlx_atoms.atom_attention_mask, mlx_embeds)
    assert rel_l2(mlx_embeds, embeds.numpy()) <= TOL
    assert rel_l2(mlx_position[0], position[0].numpy()) <= TOL and rel_l2(mlx_position[1], position[1].numpy()) <= TOL
    assert torch_mask.dtype == torch.bool and mask.dtype == mx.float32
    np.testing.assert_array_equal(to_np(mask) == 0, torch_mask.numpy())
    blind = ~torch_mask.any(-1).squeeze(1).numpy()  # padded atoms with no real atom within the window
    assert blind[1].sum() > 0 and not blind[0].any()

    x = torch.randn(embeds.shape, generator=torch.Generator().manual_seed(1))
    torch_attn = torch_encoder.layers[0].self_attn
    attn = load_from(AtomAttention(config, config.atom_encoder), torch_attn)
    with torch.no_grad():
        expected = torch_attn(x, torch_mask, position)[0].numpy()
    got = to_np(attn(to_mx(x), mask, mlx_position))
    assert rel_l2(got, expected) <= TOL
    assert np.all(got[blind] == 0) and np.all(expected[blind] == 0)
    assert np.abs(got[~blind]).min(axis=-1).max() > 0


@pytest.mark.parametrize("which", ["single", "padded"])
def test_atom_encoder_and_decoder_match_transformers(models, which, request):
    model, config = models
    (torch_atoms, mlx_atoms, _), features = request.getfixturevalue(which)
    num_tokens = features["res_type"].shape[1]
    torch_encoder = model.structure_head.atom_encoder
    encoder = load_from(AtomEncoder(config, config.structure_head.diffusion_module.atom_encoder), torch_encoder)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        embeds, position = torch_encoder.embed_atoms(torch_atoms)
        mask = torch_encoder.build_attention_mask(torch_atoms.atom_attention_mask, embeds)
        stream = embeds + torch.randn(embeds.shape, generator=g)
        args = (torch_atoms.atom_attention_mask, torch_atoms.atom_to_token, num_tokens)
        tokens, atoms = torch_encoder(stream, embeds, mask, position, *args)
    mlx_embeds, mlx_position = encoder.embed_atoms(mlx_atoms)
    mlx_mask = encoder.build_attention_mask(mlx_atoms.atom_attention_mask, mlx_embeds)
    mlx_args = (mlx_atoms.atom_attention_mask, mlx_atoms.atom_to_token, num_tokens)
    got_tokens, got_atoms = encoder(to_mx(stream), mlx_embeds, mlx_mask, mlx_position, *mlx_args)
    assert rel_l2(got_tokens, tokens.numpy()) <= TOL and rel_l2(got_atoms, atoms.numpy()) <= TOL
    if which == "padded":  # the short protein's padding tokens have no atoms: exactly 0
        short = int(features["attention_mask"][1].sum())
        assert np.all(np.array(got_tokens)[1, short:] == 0)

    torch_decoder = model.structure_head.atom_decoder
    decoder = load_from(AtomDecoder(config), torch_decoder)
    token_states = torch.randn(tokens.shape, generator=g)
    with torch.no_grad():
        coords = torch_decoder(token_states, atoms, embeds, mask, position, torch_atoms.atom_to_token)
    got = decoder(to_mx(token_states), got_atoms, mlx_embeds, mlx_mask, mlx_position, mlx_atoms.atom_to_token)
    assert got.shape == coords.shape and rel_l2(got, coords.numpy()) <= TOL


def test_input_embedder_matches_transformers(models, padded):
    model, config = models
    (torch_atoms, mlx_atoms, tokens), features = padded
    embedder = load_from(InputEmbedder(config), model.input_embedder)
    names = ("token_index", "residue_index", "asym_id", "sym_id", "entity_id", "token_bonds")
    token_bonds = (torch.rand(features["token_bonds"].shape, generator=torch.Generator().manual_seed(3)) > 0.9).float()
    inputs = {**{k: features[k] for k in names}, "token_bonds": token_bonds, **tokens}
    num_tokens = features["res_type"].shape[1]
    with torch.no_grad():
        expected = model.input_embedder(atom_inputs=torch_atoms, num_tokens=num_tokens, **inputs)
    got = embedder(atom_inputs=mlx_atoms, num_tokens=num_tokens, **{k: to_mx(v) for k, v in inputs.items()})
    assert len(got) == 4
    for mine, theirs in zip(got, expected):
        assert mine.shape == tuple(theirs.shape) and rel_l2(mine, theirs.numpy()) <= TOL


def test_relative_position_encoding_over_chains_matches_transformers(models):
    model, config = models
    rel_pos = load_from(RelativePositionEncoding(config), model.input_embedder.rel_pos)
    # Four chains, two entities, homomer copies (sym_id up to 3 > chain bins), residue gaps > residue bins.
    chains = [(0, 0, 1, 12), (1, 1, 1, 10), (2, 2, 2, 8), (3, 3, 1, 10)]
    asym, sym, entity, residue = [], [], [], []
    for chain, symmetry, ent, length in chains:
        asym += [chain] * length
        sym += [symmetry] * length
        entity += [ent] * length
        residue += list(range(0, 4 * length, 4)) if chain == 0 else list(range(length))
    residue[3] = residue[2]  # two tokens of one residue: only the token offset tells them apart
    token = list(range(len(asym)))
    inputs = {
        "residue_index": residue,
        "asym_id": asym,
        "sym_id": sym,
        "entity_id": entity,
        "token_index": token,
    }
    torch_inputs = {k: torch.tensor([v, v[::-1]]) for k, v in inputs.items()}
    with torch.no_grad():
        expected = model.input_embedder.rel_pos(**torch_inputs).numpy()
    got = rel_pos(**{k: to_mx(v) for k, v in torch_inputs.items()})
    assert rel_l2(got, expected) <= TOL


def test_diffusion_conditioning_matches_transformers(models):
    model, config = models
    torch_cond = model.structure_head.conditioning
    cond = load_from(DiffusionConditioning(config), torch_cond)
    g = torch.Generator().manual_seed(4)
    b, n = 2, 9
    pair = torch.randn(b, n, n, config.pairwise_hidden_size, generator=g)
    rpe = torch.randn(b, n, n, config.pairwise_hidden_size, generator=g)
    single = torch.randn(b, n, config.single_inputs_size, generator=g)
    noise = torch.tensor([160.0 * 16, 0.05], dtype=torch.float32)
    with torch.no_grad():
        pair_repr = torch_cond.compute_pair_repr(pair, rpe)
        single_repr = torch_cond.compute_single_repr(single)
        conditioned = torch_cond(noise_level=noise, single_states=single_repr)
    assert rel_l2(cond.compute_pair_repr(to_mx(pair), to_mx(rpe)), pair_repr.numpy()) <= TOL
    mlx_single = cond.compute_single_repr(to_mx(single))
    assert rel_l2(mlx_single, single_repr.numpy()) <= TOL
    assert rel_l2(cond(to_mx(noise), mlx_single), conditioned.numpy()) <= TOL


def _denoiser_inputs(model, prepared_inputs, features, samples: int, seed: int = 5):
    (torch_atoms, mlx_atoms, _), config = prepared_inputs, model.config
    b, n = features["res_type"].shape
    g = torch.Generator().manual_seed(seed)
    cond = dict(
        pair_trunk=torch.randn(b, n, n, config.pairwise_hidden_size, generator=g),
        relative_position_encoding=torch.randn(b, n, n, config.pairwise_hidden_size, generator=g),
        single_inputs=torch.randn(b, n, config.single_inputs_size, generator=g),
        attention_mask=features["attention_mask"],
    )
    noisy = 20.0 * torch.randn(b * samples, torch_atoms.ref_pos.shape[1], 3, generator=g)
    noise = torch.linspace(40.0, 0.5, b * samples)
    return torch_atoms, mlx_atoms, cond, noisy, noise


@pytest.mark.parametrize("which", ["single", "padded"])
def test_denoiser_step_matches_transformers(models, which, request):
    model, config = models
    prepared_inputs, features = request.getfixturevalue(which)
    samples = 2
    torch_atoms, mlx_atoms, cond, noisy, noise = _denoiser_inputs(model, prepared_inputs, features, samples)
    head = load_from(DiffusionModule(config), model.structure_head)
    with torch.no_grad():
        torch_conditioning = model.structure_head.prepare_conditioning(
            atom_inputs=torch_atoms, num_diffusion_samples=samples, **cond
        )
        expected = model.structure_head(noisy, noise, torch_conditioning).numpy()
    conditioning = head.prepare_conditioning(
        mlx_atoms, **{k: to_mx(v) for k, v in cond.items()}, num_diffusion_samples=samples
    )
    # batch 1 keeps the masks unexpanded (they broadcast over the samples), as the reference does
    assert conditioning.attention_mask.shape == (tuple(torch_conditioning.attention_mask.shape))
    keys = features["attention_mask"].numpy()[:, None, None, :]  # padded keys carry float32's lowest
    for mine, theirs in zip(conditioning.token_attention_bias, torch_conditioning.token_attention_bias):
        mine, theirs = np.array(mine), theirs.numpy()
        keys = np.repeat(keys, mine.shape[0] // keys.shape[0], axis=0)
        assert mine.shape == theirs.shape and rel_l2(np.where(keys, mine, 0), np.where(keys, theirs, 0)) <= TOL
        np.testing.assert_array_equal(mine[~np.broadcast_to(keys, mine.shape)], np.finfo(np.float32).min)
    for name in ("atom_embeds", "projected_single_inputs"):
        assert rel_l2(getattr(conditioning, name), getattr(torch_conditioning, name).numpy()) <= TOL
    np.testing.assert_array_equal(np.array(conditioning.atom_to_token), torch_conditioning.atom_to_token.numpy())
    got = head(to_mx(noisy), to_mx(noise), conditioning)
    assert got.dtype == mx.float32 and rel_l2(got, expected) <= TOL


FP32_PINNED = re.compile("|".join(map(re.escape, ref.EsmFold2PreTrainedModel._keep_in_fp32_modules_strict)))


def test_denoiser_runs_in_bfloat16_and_returns_float32(models, single):
    model, config = models
    torch_atoms, mlx_atoms, cond, noisy, noise = _denoiser_inputs(model, *single, samples=2)
    torch_head = ref.EsmFold2DiffusionModule(model.config).eval()
    torch_head.load_state_dict(model.structure_head.state_dict())
    for name, tensor in [*torch_head.named_parameters(), *torch_head.named_buffers()]:
        if not FP32_PINNED.search(name):  # transformers' bf16 load keeps these float32
            tensor.data = tensor.data.to(torch.bfloat16)
    head = load_from(DiffusionModule(config), torch_head)
    params = dict(tree_flatten(head.parameters()))
    assert params["coords_linear.weight"].dtype == mx.bfloat16
    assert params["conditioning.fourier.frequencies"].dtype == mx.float32
    # The trunk hands the pair states over in float32 and the rest in the weights' dtype.
    weight_dtype = ("relative_position_encoding", "single_inputs")
    cond = {k: v.to(torch.bfloat16) if k in weight_dtype else v for k, v in cond.items()}
    with torch.no_grad():
        torch_conditioning = torch_head.prepare_conditioning(atom_inputs=torch_atoms, num_diffusion_samples=2, **cond)
        expected = torch_head(noisy, noise, torch_conditioning)
    conditioning = head.prepare_conditioning(
        mlx_atoms, **{k: to_mx(v) for k, v in cond.items()}, num_diffusion_samples=2
    )
    assert conditioning.atom_embeds.dtype == mx.bfloat16
    got = head(to_mx(noisy), to_mx(noise), conditioning)
    assert expected.dtype == torch.float32 and got.dtype == mx.float32
    assert rel_l2(got, expected.numpy()) <= 2e-2
