"""The diffusion sampler of ESMFold2 (AlphaFold 3's Algorithm 18), as transformers'
``generation_esmfold2.py`` runs it, over any ``denoise(noisy_coords, noise_level)`` callable.

Every random number comes from a ``Draws`` in the reference's order: the starting coordinates
(S, A, 3), then per step a rotation's quaternions (S, 4), a translation (S, 1, 3) and the churn
noise (S, A, 3), drawn even when ``noise_scale`` is 0. Coordinates stay float32 throughout, as in
the reference. The schedule is host-side: its values are float32 (as the reference's tensors)
and the per-step scalars Python floats (as the reference's ``.item()`` arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ...errors import FoldError
from ...fold_config import StructureHeadConfig
from ...runtime.execution import InFlight
from ...runtime.fold.draws import Draws


def inference_noise_schedule(head: StructureHeadConfig, num_steps: int | None = None) -> np.ndarray:
    """Karras' power-law schedule of ``num_steps`` noise levels (default ``inference_num_steps``)
    from ``inference_sigma_max_ratio`` to ``inference_sigma_min_ratio`` times ``sigma_data``,
    then 0: float32, ``num_steps + 1`` values."""
    steps = head.inference_num_steps if num_steps is None else int(num_steps)
    if steps < 1:
        raise FoldError(f"the sampler needs at least 1 step, got {steps}")
    sigma_data = head.diffusion_module.sigma_data
    if steps == 1:
        return np.array([head.inference_sigma_max_ratio * sigma_data, 0.0], dtype=np.float32)
    inverse = 1.0 / head.inference_exponent
    start, end = head.inference_sigma_max_ratio**inverse, head.inference_sigma_min_ratio**inverse
    # The reference's float32 operations, in its order (Python scalars meet float32 arrays).
    ramp = np.arange(steps, dtype=np.float32) / np.float32(steps - 1)
    schedule = sigma_data * (start + ramp * (end - start)) ** head.inference_exponent
    return np.append(schedule.astype(np.float32), np.float32(0.0))


def noise_schedule(head: StructureHeadConfig, num_steps: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(sigmas, gammas) of the sampler: ``inference_noise_schedule`` with the levels above
    ``inference_sigma_cap`` cut and the cap put first (sampling starts from it), and each level's
    churn factor, ``gamma_0`` above ``gamma_min`` else 0. float32, read from ``head`` (a
    ``FoldConfig``'s ``structure_head``) at the call, as the reference reads its config."""
    schedule = inference_noise_schedule(head, num_steps)
    cap = head.inference_sigma_cap
    if cap is not None:
        schedule = np.concatenate([np.array([cap], dtype=np.float32), schedule[schedule <= cap]])
    gammas = np.where(schedule > head.gamma_min, np.float32(head.gamma_0), np.float32(0.0)).astype(np.float32)
    return schedule, gammas


def random_rotations(quaternions: mx.array) -> mx.array:
    """(S, 3, 3) rotation matrices of (S, 4) quaternions (r, i, j, k) drawn from a standard
    normal: uniform rotations. A pure function of the draws."""
    scale = mx.sqrt((quaternions * quaternions).sum(axis=1))
    signs = mx.where(quaternions[:, 0] < 0, -scale, scale)
    q = quaternions / signs[:, None]
    r, i, j, k = (q[:, n] for n in range(4))
    two_s = 2.0 / (q * q).sum(axis=-1)
    entries = (
        1 - two_s * (j * j + k * k),
        two_s * (i * j - k * r),
        two_s * (i * k + j * r),
        two_s * (i * j + k * r),
        1 - two_s * (i * i + k * k),
        two_s * (j * k - i * r),
        two_s * (i * k - j * r),
        two_s * (j * k + i * r),
        1 - two_s * (i * i + j * j),
    )
    return mx.stack(entries, axis=-1).reshape(-1, 3, 3)


def center_random_augmentation(
    coords: mx.array, atom_mask: mx.array, draws: Draws, second_coords: mx.array | None = None
) -> tuple[mx.array, mx.array | None]:
    """AlphaFold 3's Algorithm 19: ``coords`` (S, A, 3) centred on the mean of its ``atom_mask``
    (S, A) atoms, turned by a random rotation and moved by a random translation (drawn from
    ``draws``: quaternions (S, 4), then translation (S, 1, 3)); ``second_coords`` gets the same
    centring, rotation and translation."""
    mask = atom_mask[..., None]
    mean = (coords * mask).sum(axis=1, keepdims=True) / mx.maximum(mask.sum(axis=1, keepdims=True), 1)
    coords = coords - mean
    rotations = random_rotations(draws.normal((coords.shape[0], 4)))
    coords = coords @ rotations
    translations = draws.normal((coords.shape[0], 1, 3))
    coords = coords + translations
    if second_coords is not None:
        second_coords = (second_coords - mean) @ rotations + translations
    return coords, second_coords


def _determinant(m: mx.array) -> mx.array:
    """Determinants of (..., 3, 3) matrices, by the cofactor formula."""
    return (
        m[..., 0, 0] * (m[..., 1, 1] * m[..., 2, 2] - m[..., 1, 2] * m[..., 2, 1])
        - m[..., 0, 1] * (m[..., 1, 0] * m[..., 2, 2] - m[..., 1, 2] * m[..., 2, 0])
        + m[..., 0, 2] * (m[..., 1, 0] * m[..., 2, 1] - m[..., 1, 1] * m[..., 2, 0])
    )


def weighted_rigid_align(coords: mx.array, target: mx.array, weights: mx.array, mask: mx.array) -> mx.array:
    """Kabsch: ``coords`` (S, A, 3) moved by the rotation and translation that best fit ``target``
    in the least squares of ``weights * mask`` (S, A); no reflection."""
    w = (mask * weights)[..., None]
    denominator = mx.maximum(w.sum(axis=-2, keepdims=True), 1e-8)
    centroid = (coords * w).sum(axis=-2, keepdims=True) / denominator
    target_centroid = (target * w).sum(axis=-2, keepdims=True) / denominator
    centered = coords - centroid
    centered_target = target - target_centroid
    covariance = (w * centered_target).swapaxes(-1, -2) @ centered
    # MLX's SVD runs on the CPU stream only; a (S, 3, 3) batch costs nothing there.
    u, _, vh = mx.linalg.svd(covariance, stream=mx.cpu)
    flip = _determinant(u @ vh)
    ones = mx.ones_like(flip)
    rotation = (u * mx.stack([ones, ones, flip], axis=-1)[..., None, :]) @ vh
    return centered @ rotation.swapaxes(-1, -2) + target_centroid


def sample_structure(
    denoise: Callable[[mx.array, mx.array], mx.array],
    atom_mask: mx.array,
    schedule: np.ndarray,
    gammas: np.ndarray,
    noise_scale: float,
    step_scale: float,
    num_samples: int,
    draws: Draws,
) -> mx.array:
    """Sample ``num_samples`` structures per row of ``atom_mask`` (B, A): (B * num_samples, A, 3)
    float32 atom coordinates, samples of a row next to each other (the reference's
    ``repeat_interleave``). ``denoise(noisy_coords, noise_level)`` takes (B * S, A, 3) coordinates
    and (B * S,) float32 noise levels and returns the denoised coordinates; ``schedule`` and
    ``gammas`` are ``noise_schedule``'s; ``noise_scale`` scales the churn noise, ``step_scale``
    the step (the config's ``structure_head`` values by default in the reference)."""
    atom_mask = mx.repeat(mx.array(atom_mask), num_samples, axis=0).astype(mx.float32)
    batch, num_atoms = atom_mask.shape
    sigmas, gammas = [float(s) for s in schedule], [float(g) for g in gammas]
    coords = sigmas[0] * draws.normal((batch, num_atoms, 3))
    denoised, in_flight = None, InFlight()  # no value is read back between steps
    for sigma_prev, sigma_next, gamma in zip(sigmas[:-1], sigmas[1:], gammas[1:]):
        coords, denoised = center_random_augmentation(coords, atom_mask, draws, second_coords=denoised)
        noise_level = sigma_prev * (1.0 + gamma)
        churn = noise_scale * max(noise_level**2 - sigma_prev**2, 0.0) ** 0.5
        noisy = coords + churn * draws.normal((batch, num_atoms, 3))
        denoised = denoise(noisy, mx.full((batch,), noise_level, dtype=mx.float32)).astype(mx.float32)
        noisy = weighted_rigid_align(noisy, denoised, atom_mask, atom_mask)
        direction = (noisy - denoised) / noise_level
        coords = noisy + step_scale * (sigma_next - noise_level) * direction
        in_flight(coords, denoised)  # building a step (thousands of small ops) overlaps running one
    return coords
