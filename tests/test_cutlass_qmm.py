"""runtime/cutlass_qmm: CUTLASS's mixed-input GEMM as an MLX extension, used where it is built.

On the CPU the compiled extension is stood in for by a function with its contract (transposed
scales and biases in, x @ dequantize(w).T out), to check which layers and calls reach it and
what they hand it. The GPU tests run the real one where it has been built
(``esmc-mlx build-cutlass``) on a CUDA GPU.
"""

import importlib.machinery
import re
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from esmc_mlx import testing
from esmc_mlx.cli import main
from esmc_mlx.errors import EsmcMlxError, EsmcMlxWarning
from esmc_mlx.runtime import cutlass_qmm, kernels
from esmc_mlx.runtime import quantized as rq
from tests.test_kernels import assert_same_forwards_either_way, unpack

EXTENSION_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


class StandIn:
    """The extension's contract on any device: scales and biases come as [K / group, N]."""

    def __init__(self):
        self.calls, self.reordered, self.splits, self.residuals, self.norms = [], [], [], [], []

    def quantized_matmul(
        self, x, q, scales_t, biases_t, bits, group_size, stream_k, tile_tokens, reordered, splits, **added
    ):
        self.calls.append((x.shape, bits, group_size, stream_k, tile_tokens))
        w = mx.dequantize(self.weight(q, bits, reordered), scales_t.T, biases_t.T, group_size=group_size, bits=bits)
        return self.product(x, w, splits, **added)

    def mxfp4_matmul(self, x, q, scale_pairs, stream_k, tile_tokens, reordered, splits, **added):
        """mxfp4's scale pairs ([K / 64, N], two bf16 2^(e-1) each) decoded back to e8m0."""
        self.calls.append((x.shape, 4, 32, stream_k, tile_tokens))
        q = self.weight(q, 4, reordered)
        e = mx.where(pair_halves(scale_pairs) == 0x7FC0, 255, (pair_halves(scale_pairs) >> 7) - 126)
        w = mx.dequantize(q, e.astype(mx.uint8), group_size=32, bits=4, mode="mxfp4")
        return self.product(x, w, splits, **added)

    def product(self, x, w, splits, residual=None, scale=1.0, norm_weight=None, norm_bias=None, eps=1e-5):
        """x @ w.T, or split-K's: K's slabs' products in fp32, summed in order, rounded once; with a
        residual (split-K only), residual + that / scale; with a LayerNorm's weight too, that and
        its LayerNorm."""
        self.splits.append(splits)
        self.residuals.append(None if residual is None else (residual.shape, scale))
        self.norms.append(None if norm_weight is None else (norm_weight, norm_bias, eps))
        if splits == 1:
            assert residual is None, "a residual is added by split-K's sum only"
            return x @ w.T
        assert x.shape[-1] % splits == 0
        parts = zip(mx.split(x.astype(mx.float32), splits, axis=-1), mx.split(w.astype(mx.float32), splits, axis=-1))
        y = sum(a @ b.T for a, b in parts).astype(x.dtype)
        if residual is None:
            return y
        y = residual + y / scale
        return y if norm_weight is None else (y, mx.fast.layer_norm(y, norm_weight, norm_bias, eps))

    def sm_count(self):
        return 132  # an H100 or H200 (SXM)

    def weight(self, q, bits, reordered):
        """A reordered weight (cutlass_qmm.reorder) back in MLX's layout, by the PTX ISA's table."""
        self.reordered.append(reordered)
        return mx.array(pack(fragment_order(values_of(np.array(q), bits), inverse=True), bits)) if reordered else q


def pair_halves(scale_pairs):
    """Scale pairs, [K / 64, N] uint32, back to one bf16 bit pattern a group: [N, K / 32]."""
    return mx.stack([scale_pairs & 0xFFFF, scale_pairs >> 16], axis=1).reshape(-1, scale_pairs.shape[1]).T


def values_of(q, bits):
    """A packed uint32 weight [N, K * bits / 32] as its values, [N, K]."""
    return unpack(q, bits).reshape(q.shape[0], -1)


def pack(values, bits):
    """values_of's inverse."""
    per_word = 32 // bits
    words = values.reshape(values.shape[0], -1, per_word).astype(np.uint32) << (
        np.arange(per_word, dtype=np.uint32) * bits
    )
    return np.bitwise_or.reduce(words, axis=-1)


# wgmma .m64nNk16's A register fragment, from the PTX ISA's table: lane 4 * group + t holds a0-a7
# at these (row, column) offsets from (group, 2t) of its warp's 16 x 16 block.
A_REGISTERS = [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)]


def fragment_order(w, inverse=False):
    """``w`` [N, K] as the flat order in which the warps hold it in their A fragments: 16 x 16
    blocks rows first, a block's lanes in order, each lane's registers in order. ``inverse``:
    ``w`` is that flat order (as [N, K]); back to rows and columns."""
    n, k = w.shape
    lanes = [divmod(lane, 4) for lane in range(32)]
    r, c = np.array([(g + dr, 2 * t + dc) for g, t in lanes for dr, dc in A_REGISTERS]).T
    rows = np.arange(0, n, 16)[None, :, None] + r  # [K / 16, N / 16, 256]: block columns, rows
    cols = np.arange(0, k, 16)[:, None, None] + c
    source = (rows * k + cols).reshape(-1)
    out = np.empty(n * k, dtype=w.dtype)
    if inverse:
        out[source] = w.reshape(-1)
    else:
        out[:] = w.reshape(-1)[source]
    return out.reshape(n, k)


@pytest.mark.parametrize("bits", [4, 8])
def test_reorder_puts_each_lane_s_fragment_side_by_side(bits, on_cpu):
    """cutlass_qmm.reorder against the PTX ISA's fragment table, value for value, on a weight of
    several blocks each way; and a weight not cut into 16 x 16 blocks is refused."""
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**32, size=(48, 64 * bits // 32), dtype=np.uint32)  # 48 x 64 values
    got = cutlass_qmm.reorder(mx.array(q), bits)
    assert got.dtype == mx.uint32 and got.shape == q.shape
    assert np.array_equal(values_of(np.array(got), bits), fragment_order(values_of(q, bits)))
    with pytest.raises(ValueError, match="multiples of 16"):
        cutlass_qmm.reorder(mx.array(q[:40]), bits)


def test_scale_pairs_hold_each_scale_times_2_to_the_126_up_to_its_limit(on_cpu):
    """2^(e-1) for e8m0 exponents 0-128 as bf16 (NaN for 255), two groups a K tile in the order
    of K, exactly; one exponent past MXFP4_MAX_EXPONENT, and the pairs are None."""
    top = cutlass_qmm.MXFP4_MAX_EXPONENT
    e = np.concatenate([np.arange(top + 1), [255] * 7]).astype(np.uint8).reshape(8, 17)  # N 8, K / 32 17 (+1 pad)
    e = np.concatenate([e, e[:, :1]], axis=1)  # K / 32 even: K a multiple of 64
    pairs = cutlass_qmm.scale_pairs(mx.array(e))
    assert pairs.dtype == mx.uint32 and pairs.shape == (9, 8)
    values = np.array(pair_halves(pairs).astype(mx.uint16).view(mx.bfloat16).astype(mx.float32))
    want = np.where(e == 255, np.nan, np.exp2(e.astype(np.float64) - 1))
    np.testing.assert_array_equal(values, want.astype(np.float32))
    e[3, 5] = top + 1
    assert cutlass_qmm.scale_pairs(mx.array(e)) is None


@pytest.fixture
def stand_in(monkeypatch):
    fake = StandIn()
    monkeypatch.setattr(cutlass_qmm, "_extension", lambda: fake)
    monkeypatch.setattr(rq, "backend", lambda: "cuda")
    monkeypatch.setattr(cutlass_qmm.kernel_cache, "device_arch", lambda: "sm_90a")  # a Hopper GPU
    monkeypatch.setenv(rq.POLICY_ENV, "dequantize")  # every call by dequantize + matmul: no CUDA kernel runs
    monkeypatch.delenv(cutlass_qmm.ENV, raising=False)
    monkeypatch.delenv(cutlass_qmm.SCHEDULE_ENV, raising=False)
    return fake


def layer(bits=4, group_size=64, mode="affine", in_dims=128, out_dims=64, bias=False, dtype=mx.bfloat16):
    m = rq.QuantizedLinear(in_dims, out_dims, bias=bias, group_size=group_size, bits=bits, mode=mode)
    m.set_dtype(dtype)  # scales, biases and bias, as in a converted bf16 model
    return m


def reference(m, x):
    w = mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode)
    y = x @ w.T
    return y + m.bias if "bias" in m else y


@pytest.mark.parametrize(
    "bits,group_size,bias,mode",
    [(4, 64, False, "affine"), (8, 128, True, "affine"), (4, 128, True, "affine"), (4, 32, True, "mxfp4")],
)
def test_bfloat16_calls_go_to_the_extension_with_transposed_scales(
    bits, group_size, bias, mode, stand_in, monkeypatch, on_cpu
):
    m = layer(bits, group_size, mode, bias=bias)
    x = mx.random.normal((2, 5, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    monkeypatch.setenv(cutlass_qmm.ENV, "0")  # turned off
    assert not m.takes_cutlass(10) and m.takes_dequantize(10)
    off = m(x)
    assert stand_in.calls == []
    monkeypatch.delenv(cutlass_qmm.ENV)  # on by default where built
    assert m.takes_cutlass(10) and not m.takes_dequantize(10)  # no block dequantize made for it
    on = m(x)
    assert stand_in.calls == [((2, 5, 128), bits, group_size, False, 128)]  # x as given; one narrow tile
    assert on.shape == (2, 5, 64)
    np.testing.assert_array_equal(np.array(on.astype(mx.float32)), np.array(reference(m, x).astype(mx.float32)))
    np.testing.assert_allclose(np.array(on.astype(mx.float32)), np.array(off.astype(mx.float32)), rtol=2e-2, atol=2e-2)
    m(x)
    scale_rows = 128 // 64 if mode == "mxfp4" else 128 // group_size  # mxfp4: a pair a K tile
    assert len(stand_in.calls) == 2 and m.cutlass_scales[0].shape == (scale_rows, 64)  # kept, not redone


@pytest.mark.parametrize("mode,bits,group_size", [("affine", 4, 64), ("affine", 8, 64), ("mxfp4", 4, 32)])
def test_it_hands_over_each_weight_reordered_made_once(mode, bits, group_size, stand_in, monkeypatch, on_cpu):
    """A weight of whole 16-row blocks goes to the kernel reordered, the copy made on its first
    call and kept; MLX's layout with ESMC_MLX_CUTLASS_REORDER=0, and for a weight 8 rows past a
    block (no copy made); the same outputs every way."""
    x = mx.random.normal((1, 10, 128), key=mx.random.key(2)).astype(mx.bfloat16)
    m = layer(bits, group_size, mode, out_dims=64)
    first = m(x)
    copy = m.cutlass_weight
    assert not mx.array_equal(copy, m.weight).item()  # its values moved
    m(x)
    assert stand_in.reordered == [True, True] and m.cutlass_weight is copy
    monkeypatch.setenv(cutlass_qmm.REORDER_ENV, "0")
    assert mx.array_equal(m(x), first).item() and stand_in.reordered[-1] is False
    monkeypatch.delenv(cutlass_qmm.REORDER_ENV)
    ragged = layer(bits, group_size, mode, out_dims=24)
    np.testing.assert_array_equal(
        np.array(ragged(x).astype(mx.float32)), np.array(reference(ragged, x).astype(mx.float32))
    )
    assert stand_in.reordered[-1] is False and not hasattr(ragged, "cutlass_weight")


@pytest.mark.parametrize("mode,bits,group_size", [("affine", 4, 64), ("affine", 8, 64), ("mxfp4", 4, 32)])
@pytest.mark.parametrize("out_dims,table", [(64, "cuda-small"), (4096, "cuda")])
def test_it_takes_calls_up_to_its_table_s_token_count(out_dims, table, mode, bits, group_size, stand_in, monkeypatch):
    """CUTLASS_TOKENS per table (the weight's smaller dimension picks it, as for the other
    tables), the same for every mode; ESMC_MLX_CUTLASS_QMM=1 sends every count, =0 none."""
    m = layer(bits, group_size, mode, in_dims=64 if table == "cuda-small" else 2048, out_dims=out_dims)
    assert rq.table_name(kernels.weight_width(m["weight"], m.bits)) == table
    last = rq.CUTLASS_TOKENS[table]
    assert m.takes_cutlass(last) and not m.takes_cutlass(last + 1)
    assert m.takes_dequantize(last + 1) and not m.takes_dequantize(last)
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    assert m.takes_cutlass(last + 1) and m.takes_cutlass(64 * 512)
    monkeypatch.setenv(cutlass_qmm.ENV, "0")
    assert not m.takes_cutlass(1)


@pytest.fixture
def fused_calls(stand_in, monkeypatch):
    """The fused kernel stood in for (its calls' x shapes, in order), and the tables deciding."""
    calls = []

    def fused(x, *packed):
        calls.append(x.shape)
        return x @ mx.dequantize(*packed[:3], group_size=packed[3], bits=packed[4]).T

    monkeypatch.setattr(kernels, "quantized_matmul_supported", lambda x, *packed: True)
    monkeypatch.setattr(kernels, "quantized_matmul", fused)
    monkeypatch.delenv(rq.POLICY_ENV)
    return calls


def test_it_takes_the_fused_kernel_s_calls_from_its_table_s_count(stand_in, fused_calls, monkeypatch):
    """Inside the fused kernel's window (FUSED_TOKENS, the tables' own choice here) CUTLASS takes
    bfloat16 calls from CUTLASS_OVER_FUSED's count on the small models' table, every weight (a
    fill of 0); the fused kernel keeps the rest, float16 calls, calls with the fused path forced
    and all calls with CUTLASS off."""
    m = layer(in_dims=64, out_dims=64)
    assert rq.table_name(kernels.weight_width(m["weight"], m.bits)) == "cuda-small"
    lo, hi = rq.FUSED_TOKENS["cuda-small"]["affine4"]
    first, fill = rq.CUTLASS_OVER_FUSED["cuda-small"]
    assert fill == 0
    inside = [lo, hi - 1, first - 1, first]
    for tokens in inside:
        x = mx.ones((tokens, 64), dtype=mx.bfloat16)
        before = len(stand_in.calls)
        m(x)
        assert len(stand_in.calls) - before == (tokens >= first), tokens
    assert len(fused_calls) == len(inside) - len(stand_in.calls)
    calls = len(stand_in.calls)
    m(mx.ones((first, 64), dtype=mx.float16))  # CUTLASS takes bfloat16 only
    monkeypatch.setenv(rq.POLICY_ENV, "fused")
    m(mx.ones((first, 64), dtype=mx.bfloat16))
    monkeypatch.setenv(rq.POLICY_ENV, "auto")
    monkeypatch.setenv(cutlass_qmm.ENV, "0")
    m(mx.ones((first, 64), dtype=mx.bfloat16))
    assert len(stand_in.calls) == calls and fused_calls[-3:] == [(first, 64)] * 3


def test_it_takes_the_fused_kernel_s_calls_of_a_weight_whose_tiles_fill_the_sms(stand_in, fused_calls, monkeypatch):
    """On the 6B's table CUTLASS takes the fused window's bfloat16 calls from CUTLASS_OVER_FUSED's
    count for a weight whose tiles fill enough of the SMs, each counted once per slab where K is
    split: 7680 rows (the q/k/v: 60 tiles, 0.45 of 132 SMs), 13824 (the gate/up: 108) and 2560 by
    6912 (the down_proj: 20 tiles in 6 slabs), not 2560 by 2368 (20 tiles; K 37 K tiles, in no
    whole slabs).
    Forcing a path or turning CUTLASS off keeps the fused kernel."""
    fewest, fill = rq.CUTLASS_OVER_FUSED["cuda"]
    lo, hi = rq.FUSED_TOKENS["cuda"]["affine4"]
    assert lo < fewest < hi
    assert cutlass_qmm.sm_fill(2560, hi - 1, 6912) == pytest.approx(120 / 132)
    for rows, k, takes in ((7680, 2560, True), (13824, 2560, True), (2560, 6912, True), (2560, 2368, False)):
        assert (cutlass_qmm.sm_fill(rows, hi - 1, k) >= fill) == takes
        m = layer(in_dims=k, out_dims=rows)
        assert rq.table_name(kernels.weight_width(m["weight"], m.bits)) == "cuda"
        for tokens in (lo, fewest - 1, fewest, hi - 1):
            before = len(stand_in.calls)
            m(mx.ones((tokens, k), dtype=mx.bfloat16))
            assert len(stand_in.calls) - before == (takes and tokens >= fewest), (rows, tokens)
    assert len(fused_calls) == 4 * 4 - len(stand_in.calls) == 10
    m = layer(in_dims=2560, out_dims=7680)
    monkeypatch.setenv(rq.POLICY_ENV, "fused")
    m(mx.ones((fewest, 2560), dtype=mx.bfloat16))
    monkeypatch.setenv(rq.POLICY_ENV, "auto")
    monkeypatch.setenv(cutlass_qmm.ENV, "0")
    m(mx.ones((fewest, 2560), dtype=mx.bfloat16))
    assert len(stand_in.calls) == 6 and fused_calls[-2:] == [(fewest, 2560)] * 2
    assert stand_in.splits == [1] * 4 + [6] * 2  # the down_proj's calls in slabs


def test_schedule_stream_k_for_a_short_last_wave_else_the_narrow_tile_where_it_takes_no_more_waves(
    stand_in, monkeypatch
):
    """Whole 128 x 256 tiles on 132 SMs: the 6B's 2560-row weights at 1024 tokens make 80 tiles
    (0.61 of a wave), its q/k/v (7680 rows) 240 (two waves, 0.91), its gate/up (13824) 432 (four
    waves, 0.82). Stream-K takes a short wave with enough K iterations to share: the down_proj
    (K 6912: 8640) and the gate/up (17280), not the o_proj (K 2560: 3200). The 128 x 192 tile
    takes the o_proj (120 tiles, still one wave) and the 300M's gate/up (5120 x 960: 2400
    iterations; 160 or 240 tiles, two waves either way), not the 6B's q/k/v (360 tiles: three
    waves) nor anything at 2048 tokens, where it would take more waves; the 128 x 128 tile takes
    what it fits in as few waves (at 128-256 tokens). The environment forces any schedule, and
    the layer hands the choice to the kernel."""
    assert cutlass_qmm.wave_fill(2560, 1024, 132) == pytest.approx(80 / 132)
    assert cutlass_qmm.wave_fill(7680, 1024, 132) == pytest.approx(240 / 264)
    assert cutlass_qmm.wave_fill(13824, 1024, 132) == pytest.approx(432 / 528)
    assert cutlass_qmm.wave_fill(2560, 1000, 132) == cutlass_qmm.wave_fill(2560, 1024, 132)  # ragged counts whole
    assert cutlass_qmm.waves(7680, 1024, 132, 192) == 3 and cutlass_qmm.waves(7680, 1024, 132) == 2
    six_b = [(2560, 6912), (13824, 2560), (2560, 2560), (7680, 2560)]  # down, gate/up, o, q/k/v
    assert [cutlass_qmm.schedule(rows, 1024, k) for rows, k in six_b] == [
        "stream-k",
        "stream-k",
        "persistent-192",
        "persistent",
    ]
    assert cutlass_qmm.schedule(5120, 1024, 960) == "persistent-192"
    assert [cutlass_qmm.schedule(rows, 2048, k) for rows, k in six_b] == [
        "stream-k",
        "persistent",  # 864 tiles, 0.94 of seven waves; nine narrow
        "stream-k",
        "persistent",
    ]
    # One wave: stream-K only where whole tiles leave at least STREAM_K_ONE_WAVE_BELOW_FILL idle.
    assert cutlass_qmm.schedule(13824, 256, 2560) == "persistent"  # 108 tiles (0.82), 4320 iterations
    assert cutlass_qmm.schedule(13824, 128, 2560) == "persistent-128"  # as many narrowest tiles
    assert cutlass_qmm.schedule(7680, 256, 2560) == "persistent-128"  # 120 of 128 tokens: one wave
    assert cutlass_qmm.schedule(2560, 1024, 6912) == "stream-k"  # 80 tiles (0.61)
    for forced in cutlass_qmm.SCHEDULES:
        monkeypatch.setenv(cutlass_qmm.SCHEDULE_ENV, forced)
        assert cutlass_qmm.schedule(2560, 1024, 6912) == forced
    monkeypatch.setattr(cutlass_qmm, "STREAM_K_MIN_ITERATIONS", 1)  # a small layer qualifies
    m = layer(in_dims=128, out_dims=7680)  # 60 tiles at 10 tokens
    for forced in cutlass_qmm.SCHEDULES:
        monkeypatch.setenv(cutlass_qmm.SCHEDULE_ENV, forced)
        m(mx.zeros((10, 128), dtype=mx.bfloat16))
    monkeypatch.delenv(cutlass_qmm.SCHEDULE_ENV)
    m(mx.zeros((10, 128), dtype=mx.bfloat16))
    # split-k forced on a K too short to split (two slabs of 64 < SPLIT_K_MIN_SLAB): one slab
    assert [call[-2:] for call in stand_in.calls] == [
        (False, 256),
        (True, 256),
        (False, 192),
        (False, 128),
        (False, 256),
        (False, 128),
        (True, 256),
    ]
    assert stand_in.splits == [1] * 7


def test_split_k_cuts_k_into_as_many_slabs_as_still_fill_one_wave(stand_in, monkeypatch, on_cpu):
    """Whole tiles filling less than SPLIT_K_BELOW_FILL of one wave (132 SMs) and K at least
    SPLIT_K_MIN_K: K in the most slabs that keep one wave, each whole K tiles and scale groups
    (``unit``) and at least SPLIT_K_MIN_SLAB. The 6B at 256 tokens: o_proj and down_proj 20 tiles
    (0.15 of the wave), q/k/v 60 (0.45), gate/up 108 (0.82). The layer hands the count to the
    kernel."""
    assert cutlass_qmm.splits(2560, 256, 2560) == 5  # 6 would fit the wave, but 2560 is no multiple of 6 x 64
    assert cutlass_qmm.splits(2560, 256, 6912) == 6
    assert cutlass_qmm.splits(2560, 256, 6912, unit=128) == 6
    assert cutlass_qmm.splits(2560, 256, 2560, unit=128) == 5
    assert cutlass_qmm.splits(7680, 256, 2560) == 2
    assert cutlass_qmm.splits(13824, 256, 2560) == 1  # no second slab fits the wave
    assert cutlass_qmm.splits(960, 256, 960) == 3  # the 300M's o_proj: 5 slabs would be 192 of K
    assert cutlass_qmm.splits(2560, 256, 384) == 1  # two slabs of 192: too short
    assert cutlass_qmm.schedule(2560, 256, 2560) == "split-k"
    assert cutlass_qmm.schedule(2560, 256, 384) == "persistent-128"  # nothing to split
    assert cutlass_qmm.schedule(13824, 256, 2560) == "persistent"
    monkeypatch.setenv(cutlass_qmm.SPLITS_ENV, "4")
    assert cutlass_qmm.splits(2560, 256, 6912) == 4
    assert cutlass_qmm.splits(2560, 256, 6912, unit=128) == 1  # 4 x 128 does not divide 6912
    monkeypatch.delenv(cutlass_qmm.SPLITS_ENV)
    assert cutlass_qmm.schedule(960, 256, 960) == "persistent-128"  # K too short to pay for the slabs
    # unless the slabs' sum adds the residual stream (the 300M's o_proj): it replaces the add's kernel
    assert cutlass_qmm.schedule(960, 256, 960, added=True) == "split-k-128"  # in 128-token tiles (below)
    assert cutlass_qmm.schedule(960, 256, 384, added=True) == "persistent-128"  # K under SPLIT_K_MIN_K_ADDED
    assert cutlass_qmm.schedule(7680, 256, 2560) == "persistent-128"  # the tiles fill 0.45
    for mode, bits, group_size in [("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)]:
        m = layer(bits, group_size, mode, in_dims=2048, out_dims=256)  # 2 tiles: 8 slabs of 256
        x = mx.random.normal((1, 10, 2048), key=mx.random.key(3)).astype(mx.bfloat16)
        y = m(x)
        assert stand_in.splits[-1] == 8
        np.testing.assert_allclose(
            np.array(y.astype(mx.float32)), np.array(reference(m, x).astype(mx.float32)), rtol=2e-2, atol=2e-2
        )


def test_split_k_runs_the_tiles_that_leave_each_the_least_work(stand_in, on_cpu):
    """Split-K's tiles are 128 tokens wide where their slabs leave each tile less K x tokens than
    the 256-token tiles' (SPLIT_K_TILES; the wider on a tie), and the layer hands the kernel that
    width with the slab count for it."""
    # The 300M's o_proj and down_proj at 256 tokens: 48 tiles of 128 tokens x 320 of K against 24
    # of 256 x 320; 128 of 128 x 320 against 80 of 256 x 256
    assert cutlass_qmm.plan(960, 256, 960, added=True) == ("split-k-128", 3)
    assert cutlass_qmm.plan(960, 256, 2560, added=True) == ("split-k-128", 8)
    # The 6B's: 100 of 256 x 512 against 80 of 128 x 1280 (3 slabs do not divide 2560 into 64s);
    # a tie, 120 of 256 x 1152 and 120 of 128 x 2304, keeps the wider
    assert cutlass_qmm.plan(2560, 256, 2560, added=True) == ("split-k", 5)
    assert cutlass_qmm.plan(2560, 256, 6912, added=True) == ("split-k", 6)
    # At 128 tokens or fewer a 256-token tile is half empty: as many slabs of 128-token tiles
    assert cutlass_qmm.plan(2560, 128, 6912, added=True) == ("split-k-128", 6)
    assert cutlass_qmm.plan(960, 1024, 2560, added=True) == ("split-k", 4)  # 4 x 256 x 640 = 2 x 128 x 1280
    assert cutlass_qmm.tile_width("split-k-128") == 128 and cutlass_qmm.tile_width("split-k") == 256
    # the SMs it keeps busy: 16 tiles of 128 tokens in 8 slabs
    assert cutlass_qmm.sm_fill(960, 256, 2560) == pytest.approx(128 / 132)
    m = layer(in_dims=2560, out_dims=960)
    x = mx.random.normal((256, 2560), key=mx.random.key(5)).astype(mx.bfloat16)
    np.testing.assert_allclose(
        np.array(m(x).astype(mx.float32)), np.array(reference(m, x).astype(mx.float32)), rtol=2e-2, atol=2e-2
    )
    assert stand_in.calls[-1][-2:] == (False, 128) and stand_in.splits[-1] == 8


SCALE_6B = (80 / 36) ** 0.5  # ESMC's residual scale: sqrt(layers / 36)


def layer_norm(width, bias=True, dtype=mx.bfloat16, seed=0):
    """An nn.LayerNorm of random weight (and bias) in ``dtype``, as a converted model holds one."""
    norm = nn.LayerNorm(width, bias=bias)
    norm.update({k: mx.random.normal(v.shape, key=mx.random.key(seed + i)) for i, (k, v) in enumerate(norm.items())})
    norm.set_dtype(dtype)
    return norm


def test_split_k_adds_the_residual_stream_in_its_sum(stand_in, monkeypatch, on_cpu):
    """QuantizedLinear.added_to hands the residual stream and the LayerNorm after it to the kernel
    where the call runs split-K (residual + product / scale and its LayerNorm from its sum: the
    ops' values), and returns None for every other call: whole tiles, a bias, a residual of
    another dtype, another path."""
    x = mx.random.normal((1, 10, 2048), key=mx.random.key(4)).astype(mx.bfloat16)
    r = mx.random.normal((1, 10, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    norm = layer_norm(256)
    # the kernel's LayerNorm runs a block a row: up to 8192 bf16 values (1024 threads of 8)
    assert cutlass_qmm.norms_in_sum(layer_norm(8192), 8192) and not cutlass_qmm.norms_in_sum(layer_norm(8200), 8200)
    for mode, bits, group_size in [("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)]:
        m = layer(bits, group_size, mode, in_dims=2048, out_dims=256)  # 2 tiles: 8 slabs
        assert cutlass_qmm.adds_residual(m, 10)
        added, normed = m.added_to(r, x, SCALE_6B, norm)
        assert stand_in.splits[-1] == 8 and stand_in.residuals[-1] == ((1, 10, 256), SCALE_6B)
        assert stand_in.norms[-1][0] is norm.weight and stand_in.norms[-1][1:] == (norm.bias, norm.eps)
        assert mx.array_equal(added, r + m(x) / SCALE_6B).item()
        assert mx.array_equal(normed, norm(added)).item()
    whole = layer(in_dims=2048, out_dims=256)
    calls = len(stand_in.calls)
    assert whole.added_to(r, mx.zeros((1, 10, 2048), mx.bfloat16), 1.0, norm) is not None
    monkeypatch.setenv(cutlass_qmm.SPLITS_ENV, "1")  # whole tiles
    assert not cutlass_qmm.adds_residual(whole, 10) and whole.added_to(r, x, 1.0, norm) is None
    monkeypatch.delenv(cutlass_qmm.SPLITS_ENV)
    biased = layer(in_dims=2048, out_dims=256, bias=True)
    assert biased.added_to(r, x, 1.0, norm) is None
    with pytest.raises(ValueError, match="without bias only"):
        cutlass_qmm.matmul(biased, x, 10, r)
    with pytest.raises(ValueError, match="with a residual only"):
        cutlass_qmm.matmul(whole, x, 10, norm=norm)
    assert whole.added_to(r.astype(mx.float32), x, 1.0, norm) is None
    assert whole.added_to(r, x.astype(mx.float16), 1.0, norm) is None  # CUTLASS takes bfloat16 only
    monkeypatch.setenv(cutlass_qmm.ENV, "0")
    assert whole.added_to(r, x, 1.0, norm) is None
    assert len(stand_in.calls) == calls + 1  # None costs no call


@pytest.mark.parametrize(
    "norm,why",
    [
        (layer_norm(256, dtype=mx.float32), "an fp32 weight: mx.fast.layer_norm's output would not be bf16"),
        (layer_norm(256, bias=False), None),
        (nn.LayerNorm(256, affine=False), "no weight"),
        (layer_norm(128), "another width"),
        ("NORM_IN_SUM", "turned off"),
    ],
)
def test_split_k_s_sum_normalizes_where_the_kernel_can(norm, why, stand_in, monkeypatch, on_cpu):
    """The kernel takes the LayerNorm where it computes mx.fast.layer_norm's values (a bf16 weight,
    with or without a bf16 bias, of the product's width); otherwise the sum adds only and MLX
    normalizes, with the same outputs either way."""
    if norm == "NORM_IN_SUM":
        monkeypatch.setattr(cutlass_qmm, "NORM_IN_SUM", False)
        norm = layer_norm(256)
    m = layer(in_dims=2048, out_dims=256)
    x = mx.random.normal((1, 10, 2048), key=mx.random.key(4)).astype(mx.bfloat16)
    r = mx.random.normal((1, 10, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    assert cutlass_qmm.norms_in_sum(norm, 256) is (why is None)
    if norm.get("weight") is not None and norm.weight.shape != (256,):
        return  # a mismatched LayerNorm is the caller's error: the ops raise too
    added, normed = m.added_to(r, x, SCALE_6B, norm)
    assert (stand_in.norms[-1] is None) is (why is not None)
    assert mx.array_equal(added, r + m(x) / SCALE_6B).item()
    assert normed.dtype == norm(added).dtype and mx.array_equal(normed, norm(added)).item()


def test_the_layer_adds_its_residual_in_the_split_k_sum(stand_in, monkeypatch, on_cpu):
    """A block whose o_proj and down_proj run split-K (hidden 2048: 16 tiles, 8 slabs) hands each
    its residual stream; the outputs are those of the ops (ESMC_MLX_FUSED_NORM=0)."""
    from esmc_mlx.bench import mlx_model
    from esmc_mlx.runtime.model import FUSED_NORM_ENV

    config = testing.tiny_config(hidden_size=2048, intermediate_size=2048, num_attention_heads=32, num_hidden_layers=2)
    weights = dict(tree_flatten(testing.random_mlx_model(config).parameters()))
    model = mlx_model(config, weights, fuse=True, quant={"mode": "affine", "bits": 4, "group_size": 64})
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(1, 12)))
    out = model(ids, output_hidden_states=True)
    added = [r for r in stand_in.residuals if r is not None]
    assert len(added) == 4 and all(r == ((1, 12, 2048), config.residual_scale) for r in added)  # 2 a block
    # each with the LayerNorm after it: post-attention, the next block's input, the final one (no bias)
    blocks = model.esmc.layers
    norms = [blocks[0].post_attention_layernorm, blocks[1].input_layernorm, blocks[1].post_attention_layernorm]
    passed = [n[0] for n in stand_in.norms if n is not None]
    wanted = [n.weight for n in [*norms, model.esmc.norm]]
    assert len(passed) == 4 and all(a is b for a, b in zip(passed, wanted, strict=True))
    monkeypatch.setenv(FUSED_NORM_ENV, "0")
    ref = model(ids, output_hidden_states=True)
    assert len([r for r in stand_in.residuals if r is not None]) == 4
    for got, want in zip((out.logits, *out.hidden_states), (ref.logits, *ref.hidden_states), strict=True):
        assert mx.array_equal(got, want).item()


def test_not_on_other_gpus(stand_in, monkeypatch, tmp_path):
    """The build targets sm_90a: on any other device the extension is neither used nor built."""
    m = layer()
    monkeypatch.setattr(cutlass_qmm.kernel_cache, "device_arch", lambda: "sm_80")
    assert not cutlass_qmm.enabled() and not m.takes_cutlass(10)
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path))
    with pytest.raises(cutlass_qmm.BuildError, match=r"compute capability 9.0 GPU only \(this device: sm_80\)"):
        cutlass_qmm.build()
    assert not (tmp_path / "cutlass_qmm").exists()


def test_other_inputs_and_weights_keep_their_path(stand_in, monkeypatch, on_cpu):
    x32 = mx.random.normal((1, 7, 128), key=mx.random.key(2))
    m = layer()
    np.testing.assert_allclose(np.array(m(x32)), np.array(reference(m, x32)), rtol=1e-5, atol=1e-5)  # float32 x
    xb = x32.astype(mx.bfloat16)
    for other in (
        layer(mode="mxfp8", bits=8, group_size=32),  # neither affine nor mxfp4
        layer(mode="mxfp4", group_size=32, in_dims=96),  # K not whole 64-wide tiles
        past_the_pairs_range(layer(mode="mxfp4", group_size=32)),  # a scale of 4 (weights of 16-24)
        layer(bits=2),  # the kernel has 4 and 8 bits
        layer(group_size=32),  # groups smaller than CUTLASS's K tile
        layer(out_dims=60),  # rows of y not 16 bytes
        layer(dtype=mx.float32),  # float32 scales
    ):
        assert not other.takes_cutlass(7)
        xi = xb[..., : other.weight.shape[1] * 32 // other.bits]  # its in_dims
        np.testing.assert_allclose(
            np.array(other(xi).astype(mx.float32)),
            np.array(reference(other, xi).astype(mx.float32)),
            rtol=2e-2,
            atol=2e-2,
        )
    assert stand_in.calls == []
    monkeypatch.setattr(rq, "backend", lambda: "cpu")
    assert not m.takes_cutlass(7)


def past_the_pairs_range(m):
    """``m`` (mxfp4) with one group's scale past what scale pairs hold: 2^(129-127)."""
    e = np.array(m.scales)
    e[1, 2] = cutlass_qmm.MXFP4_MAX_EXPONENT + 1
    m.scales = mx.array(e)
    return m


def test_turning_it_on_makes_a_shape_run_eagerly_once_more(monkeypatch):
    """A compiled model runs a shape compiled from its second call; with new kernel choices
    (the switch among them) the next call is a first again, so matmul prepares its scales
    outside any trace."""
    from esmc_mlx.runtime.model import ESMC

    model = ESMC(testing.tiny_config()).compile()
    ids = mx.zeros((1, 12), dtype=mx.int32)
    monkeypatch.delenv(cutlass_qmm.ENV, raising=False)
    assert [model._use_compiled(ids, None) for _ in range(2)] == [False, True]
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    assert [model._use_compiled(ids, None) for _ in range(2)] == [False, True]
    monkeypatch.setenv(cutlass_qmm.SCHEDULE_ENV, "stream-k")  # a forced schedule is a choice too
    assert [model._use_compiled(ids, None) for _ in range(2)] == [False, True]
    monkeypatch.setenv(cutlass_qmm.REORDER_ENV, "0")  # and the weight's layout: its copy made eagerly
    assert [model._use_compiled(ids, None) for _ in range(2)] == [False, True]
    monkeypatch.setenv(cutlass_qmm.SPLITS_ENV, "2")  # and split-K's slab count
    assert [model._use_compiled(ids, None) for _ in range(2)] == [False, True]


def test_off_unless_built(monkeypatch, tmp_path):
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(cutlass_qmm.kernel_cache, "device_arch", lambda: "sm_90a")
    cutlass_qmm._extension.cache_clear()
    try:
        monkeypatch.setenv(cutlass_qmm.ENV, "1")
        folder = cutlass_qmm.build_dir()
        assert folder.parent == tmp_path / "cutlass_qmm" and folder.name.startswith(f"mlx-{mx.__version__}-")
        assert cutlass_qmm._extension() is None and not cutlass_qmm.enabled()  # nothing built there
        # A build of another cutlass_qmm.cu (another signature) lies elsewhere and is not loaded.
        old = tmp_path / "cutlass_qmm" / f"mlx-{mx.__version__}" / f"{cutlass_qmm.MODULE}{EXTENSION_SUFFIX}"
        old.parent.mkdir(parents=True)
        old.write_bytes(b"not this source's build")
        cutlass_qmm._extension.cache_clear()
        with pytest.warns(
            EsmcMlxWarning, match=rf"for another MLX or esmc-mlx \(mlx-{mx.__version__}\).*build-cutlass"
        ):
            assert cutlass_qmm._extension() is None
        assert not cutlass_qmm.enabled()  # said once (cached)
        monkeypatch.setenv("ESMC_MLX_CACHE", "off")
        assert cutlass_qmm.build_dir() is None
        with pytest.raises(cutlass_qmm.BuildError, match="cache is off"):
            cutlass_qmm.build()
    finally:
        cutlass_qmm._extension.cache_clear()


def test_the_build_is_named_by_its_source_and_every_header_of_ours_it_includes(monkeypatch, tmp_path):
    """A change to a header cutlass_qmm.cu includes from this package (layer_norm_rows.cuh, which
    kernels.py's row kernels share) names another build, as a change to the .cu does: an old
    build is never loaded against new arithmetic. HEADERS lists every such include."""
    included = re.findall(r'^#include "([^/"]+)"', cutlass_qmm.SOURCE.read_text(), flags=re.MULTILINE)
    assert included and sorted(included) == sorted(h.name for h in cutlass_qmm.HEADERS)
    assert all(h.parent == cutlass_qmm.SOURCE.parent and h.exists() for h in cutlass_qmm.HEADERS)
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path))
    shipped = cutlass_qmm.build_dir()
    header = tmp_path / "layer_norm_rows.cuh"
    header.write_bytes(kernels.ROW_HEADER_FILE.read_bytes() + b"// changed\n")
    monkeypatch.setattr(cutlass_qmm, "HEADERS", (header,))
    assert cutlass_qmm.build_dir() != shipped and cutlass_qmm.build_dir().parent == shipped.parent
    header.write_bytes(kernels.ROW_HEADER_FILE.read_bytes())
    assert cutlass_qmm.build_dir() == shipped


def test_a_build_that_does_not_load_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path))
    broken = cutlass_qmm.build_dir() / (cutlass_qmm.MODULE + EXTENSION_SUFFIX)
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a shared library")
    cutlass_qmm._extension.cache_clear()
    try:
        with pytest.raises(cutlass_qmm.BuildError, match=f"{broken} does not load .*rebuild it"):
            cutlass_qmm._extension()
        # on by default where built: a Hopper GPU's quantized forward meets it, as one Error: line
        monkeypatch.setattr(rq, "backend", lambda: "cuda")
        monkeypatch.setattr(cutlass_qmm.kernel_cache, "device_arch", lambda: "sm_90a")
        monkeypatch.setenv(rq.POLICY_ENV, "dequantize")
        monkeypatch.delenv(cutlass_qmm.ENV, raising=False)
        with pytest.raises(EsmcMlxError, match="does not load"):
            layer()(mx.zeros((1, 4, 128), dtype=mx.bfloat16))
    finally:
        cutlass_qmm._extension.cache_clear()


def test_build_names_what_is_missing(monkeypatch, tmp_path):
    out = tmp_path / "x.so"
    with pytest.raises(cutlass_qmm.BuildError, match="no-such-nvcc not found"):
        cutlass_qmm.build_command(out, nvcc="no-such-nvcc")
    monkeypatch.setattr(cutlass_qmm.shutil, "which", lambda name: "/usr/bin/" + name)
    cuda_mlx = tmp_path / "mlx"  # the layout of MLX's CUDA wheel
    (cuda_mlx / "include" / "cutlass").mkdir(parents=True)
    (cuda_mlx / "lib").mkdir()
    monkeypatch.setattr(cutlass_qmm.mx, "__file__", str(cuda_mlx / "__init__.py"))
    monkeypatch.setitem(sys.modules, "nanobind", None)  # not installed
    with pytest.raises(cutlass_qmm.BuildError, match="nanobind not found"):
        cutlass_qmm.build_command(out)

    class OldNanobind:
        __version__ = "2.9.2"

    monkeypatch.setitem(sys.modules, "nanobind", OldNanobind)
    with pytest.raises(cutlass_qmm.BuildError, match="nanobind 2.9.2 does not share"):
        cutlass_qmm.build_command(out)
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path))
    failed = cutlass_qmm.BuildError("nvcc failed: x")
    monkeypatch.setattr(cutlass_qmm, "build", lambda nvcc, log: (_ for _ in ()).throw(failed))
    out = CliRunner().invoke(main, ["build-cutlass"])
    assert out.exit_code == 1 and out.output.strip().splitlines() == ["Error: nvcc failed: x"]


def test_build_command_can_target_another_mlx_and_python(monkeypatch, tmp_path):
    """scripts/device_setup.py builds here for the GPU machine: the command then reads another
    MLX install's headers and libmlx and another Python's headers, none of this process's."""
    monkeypatch.setattr(cutlass_qmm.shutil, "which", lambda name: "/usr/bin/" + name)
    other = tmp_path / "site312" / "mlx"
    (other / "include" / "cutlass").mkdir(parents=True)
    (other / "lib").mkdir()
    (tmp_path / "fmt" / "fmt").mkdir(parents=True)
    (tmp_path / "fmt" / "fmt" / "format.h").touch()
    monkeypatch.setenv("FMT_INCLUDE", str(tmp_path / "fmt"))

    class Nanobind:
        __version__ = "3.1.0"
        source_dir = staticmethod(lambda: str(tmp_path / "nanobind" / "src"))
        include_dir = staticmethod(lambda: str(tmp_path / "nanobind" / "include"))

    monkeypatch.setitem(sys.modules, "nanobind", Nanobind)
    command = cutlass_qmm.build_command(tmp_path / "x.so", mlx_root=other, python_include="/py312/include")
    assert f"-I{other / 'include'}" in command and f"-L{other / 'lib'}" in command
    assert "-I/py312/include" in command
    here = str(Path(cutlass_qmm.mx.__file__).resolve().parent)
    assert not [flag for flag in command if here in flag]


def test_build_cutlass_help_explains_without_building(monkeypatch):
    monkeypatch.setattr(cutlass_qmm, "build", lambda nvcc, log: pytest.fail("--help built the extension"))
    out = CliRunner().invoke(main, ["build-cutlass", "--help"])
    assert out.exit_code == 0
    text = " ".join(out.output.split())
    assert "build-cutlass [OPTIONS]" in text and f"{cutlass_qmm.ENV}=0 turns it off" in text


def test_build_cutlass_passes_its_compiler_and_says_where_it_went(monkeypatch, tmp_path):
    made = tmp_path / "x.so"
    monkeypatch.setattr(cutlass_qmm, "build", lambda nvcc, log: log(f"with {nvcc}") or made)
    out = CliRunner().invoke(main, ["build-cutlass", "--nvcc", "/opt/cuda/bin/nvcc"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines() == [
        "with /opt/cuda/bin/nvcc",
        f"Built {made}. Quantized models use it from now on ({cutlass_qmm.ENV}=0 turns it off).",
    ]


def test_build_command_reads_mlx_s_cutlass_headers(monkeypatch, tmp_path):
    """A CPU build of MLX has no CUTLASS headers: the build says so, naming the folder."""
    monkeypatch.setattr(cutlass_qmm.shutil, "which", lambda name: "/usr/bin/" + name)
    fake_mlx = tmp_path / "mlx"
    fake_mlx.mkdir()
    monkeypatch.setattr(cutlass_qmm.mx, "__file__", str(fake_mlx / "__init__.py"))
    with pytest.raises(cutlass_qmm.BuildError, match=f"{fake_mlx} has no CUTLASS headers"):
        cutlass_qmm.build_command(tmp_path / "x.so")


ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
BUILT = ON_CUDA and cutlass_qmm._extension() is not None


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize(
    "bits,group_size,mode", [(4, 64, "affine"), (8, 64, "affine"), (4, 128, "affine"), (4, 32, "mxfp4")]
)
@pytest.mark.parametrize("rows", [1, 3, 300, 1024])
@pytest.mark.parametrize("schedule", cutlass_qmm.SCHEDULES)
def test_extension_matches_dequantize_and_matmul_on_cuda(bits, group_size, mode, rows, schedule, monkeypatch):
    """The real kernel, every schedule and tile, against x @ dequantize(w).T in float32: at most the
    bf16 matmul's own error from it (the persistent tiles measured equal to the bit on the 6B's
    shapes in the thirty-first session), and the same bits on a second call (stream-K's partial
    sums are added in a fixed order)."""
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    monkeypatch.setenv(cutlass_qmm.SCHEDULE_ENV, schedule)
    monkeypatch.setenv(rq.POLICY_ENV, "dequantize")
    m = layer(bits, group_size, mode, in_dims=2560, out_dims=1024, bias=True)
    x = mx.random.normal((1, rows, 2560), key=mx.random.key(rows)).astype(mx.bfloat16)
    assert m.takes_cutlass(rows)
    got = m(x)
    assert mx.array_equal(got, m(x)).item()
    exact = reference(m, x.astype(mx.float32))
    bf16 = reference(m, x)
    err = float(mx.abs(got.astype(mx.float32) - exact).max())
    bf16_err = float(mx.abs(bf16.astype(mx.float32) - exact).max())
    assert err <= 2 * bf16_err + 1e-3


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize(
    "bits,group_size,mode", [(4, 64, "affine"), (8, 64, "affine"), (4, 128, "affine"), (4, 32, "mxfp4")]
)
@pytest.mark.parametrize("rows", [1, 300, 1024])
@pytest.mark.parametrize("schedule", cutlass_qmm.SCHEDULES)
def test_a_reordered_weight_gives_the_same_bits_on_cuda(bits, group_size, mode, rows, schedule, monkeypatch):
    """The kernel on cutlass_qmm.reorder's copy of the weight (as the layers hand it over): the
    same products summed in the same order as on MLX's layout, so the same output bit for bit
    (which the tests around hold to dequantize + matmul and mx.dequantize)."""
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    monkeypatch.setenv(cutlass_qmm.SCHEDULE_ENV, schedule)
    monkeypatch.setenv(rq.POLICY_ENV, "dequantize")
    m = layer(bits, group_size, mode, in_dims=2560, out_dims=1024, bias=True)
    x = mx.random.normal((1, rows, 2560), key=mx.random.key(rows)).astype(mx.bfloat16)
    reordered = m(x)
    assert hasattr(m, "cutlass_weight")
    monkeypatch.setenv(cutlass_qmm.REORDER_ENV, "0")
    assert mx.array_equal(m(x), reordered).item()


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize("splits", [2, 5, 10])  # 10: more slabs than the sum's kernel loads at once
@pytest.mark.parametrize("schedule", ["split-k", "split-k-128"])
def test_split_k_in_any_number_of_slabs_on_cuda(splits, schedule, monkeypatch):
    """Split-K in as many slabs as it is handed, in either tile, gives x @ dequantize(w).T within
    the bf16 matmul's own error of the float32 product, and its sum adds the residual as MLX's
    ops do, bit for bit."""
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    monkeypatch.setenv(cutlass_qmm.SCHEDULE_ENV, schedule)
    monkeypatch.setenv(cutlass_qmm.SPLITS_ENV, str(splits))
    monkeypatch.setenv(rq.POLICY_ENV, "dequantize")
    m = layer(4, 64, "affine", in_dims=2560, out_dims=1024)
    x = mx.random.normal((1, 77, 2560), key=mx.random.key(splits)).astype(mx.bfloat16)
    assert cutlass_qmm.plan(1024, 77, 2560, cutlass_qmm.split_unit(m)) == (schedule, splits)
    got = m(x)
    exact = reference(m, x.astype(mx.float32))
    bf16_err = float(mx.abs(reference(m, x).astype(mx.float32) - exact).max())
    assert float(mx.abs(got.astype(mx.float32) - exact).max()) <= 2 * bf16_err + 1e-3
    r = mx.random.normal((1, 77, 1024), key=mx.random.key(99)).astype(mx.bfloat16)
    norm = layer_norm(1024)
    added, normed = m.added_to(r, x, SCALE_6B, norm)
    assert mx.array_equal(added, r + got / SCALE_6B).item() and mx.array_equal(normed, norm(added)).item()


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize("mode,bits,group_size", [("mxfp4", 4, 32), ("affine", 4, 64), ("affine", 8, 128)])
@pytest.mark.parametrize("rows", [1, 77, 256])
@pytest.mark.parametrize("scale", [SCALE_6B, (30 / 36) ** 0.5, 1.0])  # the 6B's, the 300M's, none
def test_the_residual_added_in_split_k_s_sum_is_the_ops_bit_for_bit_on_cuda(
    mode, bits, group_size, rows, scale, monkeypatch
):
    """residual + x @ w.T / scale from the kernel that sums the slabs, and mx.fast.layer_norm of
    it from the same kernel, equal MLX's ops on the kernel's own product, bit for bit, eager and
    compiled: the 6B's o_proj and down_proj (2560 wide) and products as wide as the 300M's (960)
    and the 600M's (1152), each with a LayerNorm with a bias and one without (the final one)."""
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    monkeypatch.setenv(rq.POLICY_ENV, "dequantize")  # CUTLASS at every row count
    for k, n in ((2560, 2560), (6912, 2560), (2560, 960), (2560, 1152)):
        m = layer(bits, group_size, mode, in_dims=k, out_dims=n)
        x = mx.random.normal((1, rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
        r = (4 * mx.random.normal((1, rows, n), key=mx.random.key(k))).astype(mx.bfloat16)
        assert cutlass_qmm.adds_residual(m, rows) and m.path(rows) == "cutlass"
        want = r + m(x) / scale
        for norm in (layer_norm(n, seed=k), layer_norm(n, bias=False, seed=n)):
            assert cutlass_qmm.norms_in_sum(norm, n)
            compiled = mx.compile(lambda a, b: m.added_to(a, b, scale, norm))  # noqa: B023
            for got in (m.added_to(r, x, scale, norm), compiled(r, x), compiled(r, x)):
                for g, w in zip(got, (want, norm(want)), strict=True):
                    assert g.shape == w.shape and g.dtype == mx.bfloat16
                    assert mx.array_equal(g, w).item(), (k, n, int(mx.sum(g != w).item()))


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize("schedule", ["persistent-128", "split-k"])
def test_the_extension_copies_strided_and_broadcast_inputs_on_cuda(schedule, monkeypatch):
    """x and the residual go to the primitive as given, with no reshape or contiguous() node; a
    transposed x, a strided slice of one and a broadcast residual give what their contiguous
    copies give, bit for bit (the primitive copies them itself), and 1-D and 4-D x keep their
    shape."""
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    monkeypatch.setenv(cutlass_qmm.SCHEDULE_ENV, schedule)
    monkeypatch.setenv(rq.POLICY_ENV, "dequantize")
    m = layer(4, 64, "affine", in_dims=2048, out_dims=256)
    transposed = mx.random.normal((2048, 20), key=mx.random.key(6)).astype(mx.bfloat16).T[None]
    sliced = mx.random.normal((1, 40, 2048), key=mx.random.key(7)).astype(mx.bfloat16)[:, ::2]
    for x in (transposed, sliced):
        assert mx.array_equal(m(x), m(mx.contiguous(x))).item()
    four_d = mx.contiguous(transposed).reshape(2, 2, 5, 2048)
    assert m(four_d).shape == (2, 2, 5, 256) and m(transposed[0, 3]).shape == (256,)
    assert mx.array_equal(m(four_d).reshape(1, 20, 256), m(transposed)).item()
    if schedule == "split-k":
        norm = layer_norm(256)
        broadcast = mx.broadcast_to(mx.random.normal((256,), key=mx.random.key(8)).astype(mx.bfloat16), (1, 20, 256))
        # row-contiguous, 2 bytes past a 16-byte boundary: the sum reads it a value at a time
        offset = mx.random.normal((20 * 256 + 1,), key=mx.random.key(9)).astype(mx.bfloat16)[1:].reshape(1, 20, 256)
        for r in (broadcast, offset):
            got = m.added_to(r, transposed, SCALE_6B, norm)
            want = m.added_to(mx.contiguous(r), mx.contiguous(transposed), SCALE_6B, norm)
            assert all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize("mode", ["affine4", "mxfp4"])
def test_forward_with_the_residual_in_split_k_s_sum_on_cuda(mode, monkeypatch):
    """A quantized model whose o_proj and down_proj run split-K gives the same logits and hidden
    states with the residual added in the slabs' sum as with MLX's ops: eager, compiled, and
    evaluated block by block."""
    from esmc_mlx.bench import mlx_model
    from esmc_mlx.runtime.model import FUSED_NORM_ENV

    config = testing.tiny_config(hidden_size=2048, intermediate_size=2048, num_attention_heads=32, num_hidden_layers=3)
    weights = dict(tree_flatten(testing.random_mlx_model(config).parameters()))
    quant = (
        {"mode": "affine", "bits": 4, "group_size": 64}
        if mode == "affine4"
        else {"mode": "mxfp4", "bits": 4, "group_size": 32}
    )
    model = mlx_model(config, weights, fuse=True, quant=quant)
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(1, 200)))
    o_proj = model.esmc.layers[0].self_attn.o_proj
    assert o_proj.path(200) == "cutlass" and cutlass_qmm.adds_residual(o_proj, 200)
    assert cutlass_qmm.norms_in_sum(model.esmc.layers[0].post_attention_layernorm, 2048)
    assert cutlass_qmm.norms_in_sum(model.esmc.norm, 2048)  # no bias
    assert_same_forwards_either_way(model, ids, FUSED_NORM_ENV, monkeypatch)


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize("mode,bits,group_size", [("mxfp4", 4, 32), ("affine", 4, 64), ("affine", 8, 128)])
def test_extension_dequantizes_as_mx_dequantize_on_cuda(mode, bits, group_size, monkeypatch):
    """Each weight the kernel multiplies is mx.dequantize's, bit for bit: x the identity makes
    y = w.T, every output one product and a sum of zeros (exact in the fp32 accumulators). For
    mxfp4 every byte of two codes in every place, under every e8m0 scale the scale pairs hold that
    keeps the weights normal (2-128; a subnormal weight is the tensor cores' to round, an inf or
    NaN would spread along its row through the zeros)."""
    monkeypatch.setenv(cutlass_qmm.ENV, "1")
    monkeypatch.setenv(rq.POLICY_ENV, "dequantize")
    m = layer(bits, group_size, mode, in_dims=512, out_dims=256)
    if mode == "mxfp4":
        codes = (np.arange(256)[:, None] + np.arange(256)[None, :]) % 256  # row r: bytes r, r + 1, ...
        m.weight = mx.array(codes.astype(np.uint8).view(np.uint32))
        top = cutlass_qmm.MXFP4_MAX_EXPONENT
        m.scales = (2 + mx.arange(256 * 16, dtype=mx.uint32) % (top - 1)).reshape(256, 16).astype(mx.uint8)
    assert m.takes_cutlass(512)
    w = mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=group_size, bits=bits, mode=mode)
    got = m(mx.eye(512, dtype=mx.bfloat16))
    assert np.array_equal(np.array(got.T.astype(mx.float32)), np.array(w.astype(mx.bfloat16).astype(mx.float32)))


ADDED = {"splits": 2, "residual": mx.zeros((8, 64), mx.bfloat16)}  # a residual the sum adds


@pytest.mark.skipif(not BUILT, reason="needs MLX on a CUDA GPU and the extension built (esmc-mlx build-cutlass)")
@pytest.mark.parametrize(
    "arguments,says",
    [
        ({"tile_tokens": 64}, "tile_tokens must be 128, 192 or 256"),
        ({"tile_tokens": 192, "stream_k": True}, "stream-K runs 256-token tiles only"),
        ({"group_size": 32}, "group_size must be 64 or 128"),
        ({"splits": 3}, "split-K needs K a multiple of splits x 64"),
        ({"splits": 2, "stream_k": True}, "split-K runs whole 256- or 128-token tiles only"),
        ({"splits": 2, "tile_tokens": 192}, "split-K runs whole 256- or 128-token tiles only"),
        ({"residual": mx.zeros((8, 64), dtype=mx.bfloat16)}, "a residual is added by split-K's sum"),
        ({"splits": 2, "residual": mx.zeros((8, 32), dtype=mx.bfloat16)}, "the residual must be bfloat16 and shaped"),
        ({"splits": 2, "residual": mx.zeros((8, 64))}, "the residual must be bfloat16 and shaped"),
        ({"splits": 2, "norm_weight": mx.ones((64,), mx.bfloat16)}, "normalizes the residual stream it adds"),
        ({**ADDED, "norm_bias": mx.zeros((64,), mx.bfloat16)}, "a LayerNorm bias needs its weight"),
        ({**ADDED, "norm_weight": mx.ones((32,), mx.bfloat16)}, "weight and bias must be bfloat16 \\[N\\]"),
        ({**ADDED, "norm_weight": mx.ones((64,))}, "weight and bias must be bfloat16 \\[N\\]"),
        ({**ADDED, "norm_weight": mx.ones((64,), mx.bfloat16), "eps": 0.0}, "eps must be positive"),
    ],
)
def test_extension_refuses_what_it_was_not_built_for(arguments, says):
    m = layer(4, 64, in_dims=256, out_dims=64)
    scales_t, biases_t = (mx.contiguous(m[name].T) for name in ("scales", "biases"))
    x = mx.zeros((8, 256), dtype=mx.bfloat16)
    call = {"bits": 4, "group_size": 64, **arguments}
    with pytest.raises(ValueError, match=says):
        cutlass_qmm._extension().quantized_matmul(x, m["weight"], scales_t, biases_t, **call)
