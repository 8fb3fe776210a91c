"""Where a fold's random numbers come from.

ESMFold2 draws random numbers in the trunk (the initial pair state, the language-model dropout
of every loop) and in the sampler (the starting coordinates, each step's random rotation,
translation and churn noise). Every draw goes through one ``Draws`` object, in the order the
transformers reference draws them, so a test can replay the reference's own numbers
(``Replay``) and compare coordinates, not distributions.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx


class Draws:
    """Random numbers from MLX's generator, seeded: the same seed gives the same fold."""

    def __init__(self, seed: int = 0):
        self.key = mx.random.key(seed)

    def _next(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def normal(self, shape: tuple[int, ...]) -> mx.array:
        """Standard normal, float32."""
        return mx.random.normal(shape, dtype=mx.float32, key=self._next())

    def truncated_normal(self, shape: tuple[int, ...], std: float) -> mx.array:
        """N(0, std) truncated to [-3 std, 3 std], float32."""
        return std * mx.random.truncated_normal(-3.0, 3.0, shape, dtype=mx.float32, key=self._next())

    def keep(self, shape: tuple[int, ...], p: float) -> mx.array:
        """A dropout mask: True with probability 1 - p."""
        return mx.random.uniform(shape=shape, key=self._next()) >= p


class Replay(Draws):
    """Hands out recorded arrays in order (a test's record of the reference's draws); a draw of
    another shape than recorded is an error, so a port that draws in another order fails loudly."""

    def __init__(self, arrays: Iterable):
        self.arrays = [mx.array(a) for a in arrays]
        self.used = 0

    def _take(self, shape: tuple[int, ...]) -> mx.array:
        if self.used >= len(self.arrays):
            raise AssertionError(f"draw {self.used} of shape {tuple(shape)}: only {len(self.arrays)} were recorded")
        out = self.arrays[self.used]
        if tuple(out.shape) != tuple(shape):
            raise AssertionError(f"draw {self.used}: recorded shape {tuple(out.shape)}, asked for {tuple(shape)}")
        self.used += 1
        return out

    def normal(self, shape):
        return self._take(shape).astype(mx.float32)

    def truncated_normal(self, shape, std):
        return self._take(shape).astype(mx.float32)

    def keep(self, shape, p):
        return self._take(shape).astype(mx.bool_)
