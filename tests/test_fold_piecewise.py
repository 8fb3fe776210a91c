"""Large pairs are evaluated a chunk at a time (``layers.piecewise``): the same numbers as one lazy
graph, at a bounded peak memory (MLX's CPU peak, in pair sizes). The threshold and the memory left
are lowered here so that a small pair counts as large."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map

from esmc_mlx.fold_config import FoldConfig
from esmc_mlx.runtime.fold import layers
from esmc_mlx.runtime.fold.layers import LayerNorm, Transition
from esmc_mlx.runtime.fold.trunk import TriangleMultiplicativeUpdate, pair_mask_of
from esmc_mlx.testing import tiny_config

L, WIDTH, CHUNK = 64, 256, 8  # the published pair width; 8 chunks, as 512 residues in chunks of 64


def randomized(module: nn.Module) -> nn.Module:
    mx.random.seed(0)
    module.update(
        tree_map(lambda p: (mx.random.normal(p.shape) * p.shape[-1] ** -0.5).astype(mx.bfloat16), module.parameters())
    )
    return module


def run(fn, pair: mx.array, threshold: int, monkeypatch) -> tuple[np.ndarray, float]:
    """``fn(pair)`` evaluated with ``threshold`` as the piecewise threshold: (result, peak above
    what was held before, in pair sizes)."""
    monkeypatch.setattr(layers, "PIECEWISE_ELEMENTS", threshold)
    monkeypatch.setattr(layers, "memory_left", lambda: 0)
    monkeypatch.setattr(layers, "NORM_ROWS", CHUNK)
    mx.eval(pair)
    mx.clear_cache()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn(pair)
    mx.eval(out)
    peak = (mx.get_peak_memory() - held) / pair.nbytes
    return np.array(out.astype(mx.float32)), peak


@pytest.fixture
def pair() -> mx.array:
    return mx.random.normal((1, L, L, WIDTH), key=mx.random.key(1)).astype(mx.bfloat16)


@pytest.mark.parametrize(
    "make, bound",
    [
        # lazily about 17 pair sizes (every chunk's SwiGLU hidden at once); piecewise under 4
        (lambda: Transition(WIDTH, 4 * WIDTH, CHUNK), 6),
        # lazily about 12; piecewise under 6
        (lambda: TriangleMultiplicativeUpdate(FoldConfig(esmc_config=tiny_config(), chunk_size=CHUNK)), 8),
    ],
    ids=["transition", "triangle"],
)
def test_piecewise_matches_lazy_at_bounded_peak(make, bound, pair, monkeypatch):
    module = randomized(make())
    mask = pair_mask_of(mx.ones((1, L), dtype=mx.bool_))

    def call(x):
        return module(x) if isinstance(module, Transition) else module(x, mask)

    lazy, _ = run(call, pair, 1 << 62, monkeypatch)
    piecewise, peak = run(call, pair, pair.size, monkeypatch)
    np.testing.assert_array_equal(piecewise, lazy)
    assert peak < bound, f"peak {peak:.2f} pair sizes"


def test_piecewise_layer_norm_is_the_same(pair, monkeypatch):
    norm = LayerNorm(WIDTH)
    norm.update({"weight": 1 + 0.1 * mx.random.normal((WIDTH,)), "bias": 0.1 * mx.random.normal((WIDTH,))})
    whole, _ = run(norm, pair, 1 << 62, monkeypatch)
    rows, _ = run(norm, pair, pair.size, monkeypatch)
    np.testing.assert_array_equal(rows, whole)


@pytest.mark.parametrize("length", [512, 1024])
def test_a_large_pair_is_piecewise_only_where_memory_is_short(length):
    pair = mx.zeros((1, length, length, WIDTH), dtype=mx.bfloat16)  # lazy: nothing allocated
    need = layers.LAYER_PAIR_SIZES * pair.nbytes
    previous = mx.set_memory_limit(mx.get_active_memory() + need + (1 << 20))
    try:
        assert not layers.piecewise(pair)
        mx.set_memory_limit(mx.get_active_memory() + need // 2)
        assert layers.piecewise(pair)
        assert not layers.piecewise(pair[:, :383, :383])  # under PIECEWISE_ELEMENTS whatever the memory
    finally:
        mx.set_memory_limit(previous)
