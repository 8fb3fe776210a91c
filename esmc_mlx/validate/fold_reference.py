"""transformers' ESMFold2 fold with its random draws recorded, so that the MLX fold can replay
them (``runtime.fold.draws.Replay``) and the two be compared coordinate by coordinate.

The reference draws through four torch calls: ``nn.init.trunc_normal_`` (the initial pair
state), ``F.dropout(..., training=True)`` (each loop's language-model dropout), ``torch.randn``
and ``torch.randn_like`` (the sampler). They are wrapped for the duration of one fold, in the
order they run; any other use of them there (the backbone's inactive dropout) passes through.
"""

from __future__ import annotations

import contextlib

import numpy as np

# What the comparison reads of a fold, the reference's output names.
COMPARED = ("sample_atom_coords", "distogram_logits", "plddt", "plddt_per_atom", "pae", "pde", "ptm", "iptm")


@contextlib.contextmanager
def recorded_draws(seed: int = 0):
    """Inside: torch's random draws of a fold land, in order, in the yielded list (numpy arrays;
    dropout as its keep mask)."""
    import torch
    import torch.nn.functional as F

    drawn: list[np.ndarray] = []
    generator = torch.Generator().manual_seed(seed)
    originals = (torch.nn.init.trunc_normal_, F.dropout, torch.randn, torch.randn_like)

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        out = originals[0](tensor, mean, std, a, b, generator=generator)
        drawn.append(out.detach().float().cpu().numpy().copy())
        return out

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return originals[1](x, p, training, inplace)
        keep = torch.rand(x.shape, generator=generator).to(x.device) >= p
        drawn.append(keep.cpu().numpy())
        return x * keep.to(x.dtype) / (1.0 - p)

    def randn(*args, **kwargs):
        out = originals[2](*args, **kwargs)
        drawn.append(out.detach().float().cpu().numpy().copy())
        return out

    def randn_like(x, **kwargs):
        out = originals[3](x, **kwargs)
        drawn.append(out.detach().float().cpu().numpy().copy())
        return out

    torch.nn.init.trunc_normal_, F.dropout, torch.randn, torch.randn_like = trunc_normal_, dropout, randn, randn_like
    try:
        torch.manual_seed(seed)
        yield drawn
    finally:
        torch.nn.init.trunc_normal_, F.dropout, torch.randn, torch.randn_like = originals


def reference_fold(model, features: dict, samples: int, steps: int | None, loops: int | None, seed: int = 0):
    """Fold ``features`` (``tasks.fold.protein_features``'s numpy arrays) with transformers'
    ``EsmFold2Model`` ``model``: (its outputs named in COMPARED as float32 numpy arrays, the
    draws it made)."""
    import torch

    device = next(model.parameters()).device
    inputs = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in features.items()}
    with torch.no_grad(), recorded_draws(seed) as drawn:
        out = model.fold(**inputs, num_diffusion_samples=samples, num_sampling_steps=steps, num_loops=loops)
    return {k: out[k].float().cpu().numpy() for k in COMPARED}, drawn
