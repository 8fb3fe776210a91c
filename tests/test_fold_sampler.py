"""The MLX sampler computes what transformers' ESMFold2 sampling loop computes, draw for draw.

Torch's random numbers are recorded as the reference draws them and replayed to the MLX side
(``Replay``), so coordinates are compared, not distributions.
"""

from __future__ import annotations

import copy
import types

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[torch]' in the clone")

from transformers import EsmFold2Config
from transformers.models.esmfold2.generation_esmfold2 import (
    EsmFold2FoldingMixin,
    _center_random_augmentation,
    _random_rotations,
    _weighted_rigid_align,
)

from esmc_mlx.errors import FoldError
from esmc_mlx.fold_config import FoldConfig
from esmc_mlx.runtime.fold.draws import Draws, Replay
from esmc_mlx.tasks.fold.sampler import (
    center_random_augmentation,
    inference_noise_schedule,
    noise_schedule,
    random_rotations,
    sample_structure,
    weighted_rigid_align,
)
from esmc_mlx.testing import tiny_fold_config


class Recorder:
    """torch.randn / torch.randn_like as the reference calls them, each draw kept in order."""

    def __init__(self, monkeypatch, seed: int = 0):
        self.draws: list[np.ndarray] = []
        randn = torch.randn
        generator = torch.Generator().manual_seed(seed)

        def record(out):
            self.draws.append(out.detach().numpy().copy())
            return out

        def fake_randn(*size, dtype=None, device=None, **_):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            return record(randn(*shape, generator=generator, dtype=dtype or torch.float32, device=device))

        def fake_randn_like(x, **_):
            return record(randn(x.shape, generator=generator, dtype=x.dtype))

        monkeypatch.setattr(torch, "randn", fake_randn)
        monkeypatch.setattr(torch, "randn_like", fake_randn_like)


class Reference(EsmFold2FoldingMixin):
    """The reference's sampling loop and schedule, with its config, around a stand-in denoiser."""

    def __init__(self, config: EsmFold2Config, structure_head=None):
        self.config = config
        self.structure_head = structure_head


def configs(**head):
    """The same tiny config for both sides: transformers' object and esmc-mlx's FoldConfig."""
    raw = copy.deepcopy(tiny_fold_config())
    raw["structure_head"].update(head)
    return EsmFold2Config.from_dict(raw), FoldConfig.from_dict(raw)


@pytest.mark.parametrize(
    "head,steps",
    [
        ({}, None),
        ({}, 1),
        ({}, 2),
        ({}, 68),
        ({"inference_sigma_cap": None}, 20),
        ({"inference_sigma_cap": 40.0, "gamma_min": 5.0, "inference_exponent": 7.0}, 200),
        ({"inference_sigma_max_ratio": 80.0, "inference_sigma_min_ratio": 1e-3}, 9),
    ],
)
def test_noise_schedule_matches_transformers(head, steps):
    theirs_config, mine_config = configs(**head)
    reference = Reference(theirs_config)
    sigmas, gammas = noise_schedule(mine_config.structure_head, steps)
    ref_sigmas, ref_gammas = reference._build_noise_schedule(steps, torch.device("cpu"))
    assert sigmas.dtype == gammas.dtype == np.float32
    np.testing.assert_allclose(sigmas, ref_sigmas.numpy(), rtol=2e-7, atol=0)
    np.testing.assert_array_equal(gammas, ref_gammas.numpy())
    ramp = inference_noise_schedule(mine_config.structure_head, steps)
    np.testing.assert_allclose(ramp, reference.inference_noise_schedule(steps).numpy(), rtol=2e-7, atol=0)


def test_a_sampler_without_steps_is_refused():
    _, config = configs()
    with pytest.raises(FoldError, match="at least 1 step, got 0"):
        noise_schedule(config.structure_head, 0)


def test_random_rotations_match_transformers(monkeypatch):
    recorder = Recorder(monkeypatch, seed=1)
    theirs = _random_rotations(64, torch.float32, torch.device("cpu")).numpy()
    (quaternions,) = recorder.draws
    assert (quaternions[:, 0] < 0).any() and (quaternions[:, 0] > 0).any()  # both signs of the real part
    mine = np.array(random_rotations(mx.array(quaternions)))
    np.testing.assert_allclose(mine, theirs, atol=2e-7)
    np.testing.assert_allclose(mine @ mine.transpose(0, 2, 1), np.broadcast_to(np.eye(3), mine.shape), atol=1e-6)
    np.testing.assert_allclose(np.linalg.det(mine), 1.0, atol=1e-6)


def test_center_random_augmentation_matches_transformers(monkeypatch):
    rng = np.random.default_rng(0)
    coords = (rng.standard_normal((3, 40, 3)) * 30 + 5).astype(np.float32)
    second = (rng.standard_normal((3, 40, 3)) * 10).astype(np.float32)
    mask = np.ones((3, 40), dtype=np.float32)
    mask[:, 33:] = 0
    mask[2] = 0  # a sample without atoms: its mean is 0 (the clamp to 1)
    recorder = Recorder(monkeypatch)
    theirs, theirs_second = _center_random_augmentation(torch.tensor(coords), torch.tensor(mask), torch.tensor(second))
    assert [d.shape for d in recorder.draws] == [(3, 4), (3, 1, 3)]
    replay = Replay(recorder.draws)
    mine, mine_second = center_random_augmentation(mx.array(coords), mx.array(mask), replay, mx.array(second))
    assert replay.used == 2
    np.testing.assert_allclose(np.array(mine), theirs.numpy(), atol=2e-5)
    np.testing.assert_allclose(np.array(mine_second), theirs_second.numpy(), atol=2e-5)
    alone, none = center_random_augmentation(mx.array(coords), mx.array(mask), Replay(recorder.draws))
    assert none is None
    np.testing.assert_allclose(np.array(alone), theirs.numpy(), atol=2e-5)


@pytest.mark.parametrize("reflect", [False, True])
def test_weighted_rigid_align_matches_transformers(reflect):
    rng = np.random.default_rng(2)
    target = (rng.standard_normal((4, 50, 3)) * 12).astype(np.float32)
    rotations = np.linalg.qr(rng.standard_normal((4, 3, 3)))[0]
    if reflect:  # a mirror image: the best proper rotation, not the reflection
        rotations[:, :, 2] *= np.sign(np.linalg.det(rotations))[:, None] * -1
    else:
        rotations[:, :, 2] *= np.sign(np.linalg.det(rotations))[:, None]
    coords = (target @ rotations + rng.standard_normal((4, 1, 3)) * 20 + rng.standard_normal(target.shape)).astype(
        np.float32
    )
    weights = rng.uniform(0.5, 2.0, (4, 50)).astype(np.float32)
    mask = (rng.uniform(size=(4, 50)) > 0.2).astype(np.float32)
    theirs = _weighted_rigid_align(*(torch.tensor(a) for a in (coords, target, weights, mask))).numpy()
    mine = np.array(weighted_rigid_align(*(mx.array(a) for a in (coords, target, weights, mask))))
    np.testing.assert_allclose(mine, theirs, atol=1e-4)
    # a rigid motion of the input: distances kept
    d = np.linalg.norm(mine[:, :, None] - mine[:, None], axis=-1)
    np.testing.assert_allclose(d, np.linalg.norm(coords[:, :, None] - coords[:, None], axis=-1), atol=1e-3)


SIGMA_DATA = 16.0


def template(num_atoms: int) -> np.ndarray:
    rng = np.random.default_rng(5)
    return np.cumsum(rng.standard_normal((num_atoms, 3)) * 1.5, axis=0).astype(np.float32)


class TorchDenoiser(torch.nn.Module):
    """A deterministic denoiser: a noise-level blend of the input and a fixed structure bent by
    the input (nonlinear in both), the same function as ``mlx_denoise``."""

    def __init__(self, structure: np.ndarray):
        super().__init__()
        self.structure = torch.tensor(structure)
        self.levels: list[np.ndarray] = []

    def prepare_conditioning(self, **_):
        return "conditioning"

    def forward(self, noisy_coords, noise_level, conditioning):
        assert conditioning == "conditioning"
        self.levels.append(noise_level.numpy().copy())
        s = noise_level[:, None, None]
        skip = SIGMA_DATA**2 / (SIGMA_DATA**2 + s**2)
        return skip * noisy_coords + (1 - skip) * (self.structure + 2.0 * torch.tanh(noisy_coords / 8.0))


def mlx_denoiser(structure: np.ndarray, levels: list):
    structure = mx.array(structure)

    def denoise(noisy_coords, noise_level):
        assert noise_level.dtype == mx.float32
        levels.append(np.array(noise_level))
        s = noise_level[:, None, None]
        skip = SIGMA_DATA**2 / (SIGMA_DATA**2 + s**2)
        return skip * noisy_coords + (1 - skip) * (structure + 2.0 * mx.tanh(noisy_coords / 8.0))

    return denoise


@pytest.mark.parametrize(
    "head,steps,samples",
    [
        ({}, None, 2),  # the tiny config: 6 steps, no churn
        ({"noise_scale": 1.003, "step_scale": 1.5}, 12, 3),
        ({"noise_scale": 0.8}, 68, 1),  # the published step count
    ],
)
def test_sampling_loop_matches_transformers(monkeypatch, head, steps, samples):
    theirs_config, mine_config = configs(**head)
    num_atoms = 96
    mask = np.ones((1, num_atoms), dtype=bool)
    mask[0, 83:] = False  # the padding of the atom axis
    structure = template(num_atoms)

    recorder = Recorder(monkeypatch, seed=3)
    head_module = TorchDenoiser(structure)
    reference = Reference(theirs_config, head_module)
    atom_inputs = types.SimpleNamespace(
        atom_to_token=torch.zeros(1, num_atoms, dtype=torch.long), atom_attention_mask=torch.tensor(mask)
    )
    with torch.no_grad():
        theirs = reference._sample_structure(
            pair_trunk=None,
            single_inputs=torch.zeros(1, 8, 4),
            relative_position_encoding=None,
            atom_inputs=atom_inputs,
            attention_mask=torch.ones(1, 8, dtype=torch.bool),
            num_diffusion_samples=samples,
            num_sampling_steps=steps,
        ).numpy()

    sigmas, gammas = noise_schedule(mine_config.structure_head, steps)
    replay, levels = Replay(recorder.draws), []
    mine = sample_structure(
        mlx_denoiser(structure, levels),
        mx.array(mask),
        sigmas,
        gammas,
        mine_config.structure_head.noise_scale,
        mine_config.structure_head.step_scale,
        samples,
        replay,
    )
    assert replay.used == len(recorder.draws) == 1 + 3 * (len(sigmas) - 1)
    assert mine.dtype == mx.float32 and mine.shape == (samples, num_atoms, 3)
    # the same noise levels, to the last bit of float32 but where torch's powf rounds the other way
    np.testing.assert_allclose(np.stack(levels), np.stack(head_module.levels), rtol=2e-7, atol=0)
    assert np.abs(np.array(mine) - theirs).max() < 1e-4


def test_samples_of_a_seed_repeat_and_differ_between_seeds():
    _, config = configs()
    sigmas, gammas = noise_schedule(config.structure_head)
    mask = mx.ones((1, 32), dtype=mx.bool_)
    denoise = mlx_denoiser(template(32), [])

    def run(seed):
        return np.array(sample_structure(denoise, mask, sigmas, gammas, 1.0, 1.0, 2, Draws(seed)))

    first, again, other = run(0), run(0), run(1)
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).max() > 1.0
    assert np.abs(first[0] - first[1]).max() > 1.0  # two samples, two draws
