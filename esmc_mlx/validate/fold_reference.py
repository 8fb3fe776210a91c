"""transformers' ESMFold2 fold with its random draws recorded, or replayed from a record, so that
another fold (the MLX fold through ``runtime.fold.draws.Replay``, or transformers' own on other
weights) draws the very same numbers and the two can be compared coordinate by coordinate.

The reference draws through four torch calls: ``nn.init.trunc_normal_`` (the initial pair
state), ``F.dropout(..., training=True)`` (each loop's language-model dropout), ``torch.randn``
and ``torch.randn_like`` (the sampler). They are wrapped for the duration of one fold, in the
order they run; any other use of them there (the backbone's inactive dropout) passes through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

# What the comparison reads of a fold, the reference's output names.
COMPARED = ("sample_atom_coords", "distogram_logits", "plddt", "plddt_per_atom", "pae", "pde", "ptm", "iptm")


@contextlib.contextmanager
def _drawing(draw: Callable, keep: Callable):
    """Inside: torch's four drawing calls take their numbers from ``draw(shape, like, fresh)`` (a
    tensor of that shape, with ``like``'s device and dtype; ``fresh()`` draws it as torch would)
    and dropout its keep mask from ``keep(shape, p)``."""
    import torch
    import torch.nn.functional as F

    originals = (torch.nn.init.trunc_normal_, F.dropout, torch.randn, torch.randn_like)

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        with torch.no_grad():
            return tensor.copy_(draw(tuple(tensor.shape), tensor, lambda: originals[0](tensor, mean, std, a, b)))

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return originals[1](x, p, training, inplace)
        return x * keep(tuple(x.shape), p).to(device=x.device, dtype=x.dtype) / (1.0 - p)

    def randn(*size, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        like = torch.empty(0, device=kwargs.get("device"), dtype=kwargs.get("dtype") or torch.float32)
        return draw(tuple(shape), like, lambda: originals[2](*size, **kwargs))

    def randn_like(x, **kwargs):
        return draw(tuple(x.shape), x, lambda: originals[3](x, **kwargs))

    torch.nn.init.trunc_normal_, F.dropout, torch.randn, torch.randn_like = trunc_normal_, dropout, randn, randn_like
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_, F.dropout, torch.randn, torch.randn_like = originals


@contextlib.contextmanager
def recorded_draws(seed: int = 0):
    """Inside: torch's random draws of a fold land, in order, in the yielded list (numpy arrays;
    dropout as its keep mask)."""
    import torch

    drawn: list[np.ndarray] = []
    generator = torch.Generator().manual_seed(seed)

    def draw(shape, like, fresh):
        out = fresh()
        drawn.append(out.detach().float().cpu().numpy().copy())
        return out

    def keep(shape, p):
        mask = torch.rand(shape, generator=generator) >= p
        drawn.append(mask.numpy())
        return mask

    with _drawing(draw, keep):
        torch.manual_seed(seed)
        yield drawn


@contextlib.contextmanager
def replayed_draws(drawn: list[np.ndarray]):
    """Inside: torch's random draws of a fold are the recorded ``drawn``, handed out in order; a
    draw of another shape than recorded, or one more than recorded, is an error. Yields a list
    holding the number of draws used so far."""
    import torch

    used = [0]

    def take(shape) -> np.ndarray:
        if used[0] >= len(drawn):
            raise AssertionError(f"draw {used[0]} of shape {shape}: only {len(drawn)} were recorded")
        out = drawn[used[0]]
        if tuple(out.shape) != tuple(shape):
            raise AssertionError(f"draw {used[0]}: recorded shape {tuple(out.shape)}, asked for {tuple(shape)}")
        used[0] += 1
        return out

    def draw(shape, like, fresh):
        return torch.from_numpy(np.ascontiguousarray(take(shape))).to(device=like.device, dtype=like.dtype)

    def keep(shape, p):
        return torch.from_numpy(np.ascontiguousarray(take(shape)))

    with _drawing(draw, keep):
        yield used


def reference_fold(
    model,
    features: dict,
    samples: int,
    steps: int | None,
    loops: int | None,
    seed: int = 0,
    draws: list[np.ndarray] | None = None,
):
    """Fold ``features`` (``tasks.fold.protein_features``'s numpy arrays) with transformers'
    ``EsmFold2Model`` ``model``: (its outputs named in COMPARED as float32 numpy arrays, the
    draws it made). ``draws``: a record of an earlier fold of the same features to replay
    (all of it: a fold that draws fewer is an error) instead of drawing from ``seed``."""
    import torch

    device = next(model.parameters()).device
    inputs = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in features.items()}
    drawing = recorded_draws(seed) if draws is None else replayed_draws(draws)
    with torch.no_grad(), drawing as record:
        out = model.fold(**inputs, num_diffusion_samples=samples, num_sampling_steps=steps, num_loops=loops)
    if draws is not None and record[0] != len(draws):
        raise AssertionError(f"the fold drew {record[0]} times, {len(draws)} draws were recorded")
    return {k: out[k].float().cpu().numpy() for k in COMPARED}, (record if draws is None else draws)
