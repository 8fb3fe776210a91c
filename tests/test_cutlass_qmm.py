"""runtime/cuda/cutlass_qmm: CUTLASS's mixed-input GEMM as an MLX extension, used where the plan
(runtime/dispatch.py) sends a call.

On the CPU the compiled extension is stood in for by a class with its contract (transposed
scales and biases in, x @ dequantize(w).T out, split-K's sum adding the residual stream and its
LayerNorm), and calls are planned for a Hopper GPU with ``dispatch.use``, to check which layers
and calls reach it and what they hand it. The planning tests are functions of a ``Weight``, no
arrays. The ``cutlass`` tests run the real extension where it has been built
(``esmc-mlx build-cutlass``) on a Hopper GPU.
"""

import dataclasses
import importlib.machinery
import math
import re
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from esmc_mlx import settings, testing
from esmc_mlx.cli import main
from esmc_mlx.errors import EsmcMlxError, EsmcMlxWarning
from esmc_mlx.runtime import dispatch
from esmc_mlx.runtime import quantized as rq
from esmc_mlx.runtime.cuda import cutlass_qmm, dequantize, fusions, qmm
from esmc_mlx.runtime.cuda import rows as row_kernels
from esmc_mlx.runtime.dispatch import HOPPER, Weight
from esmc_mlx.runtime.model import PLAIN

EXTENSION_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
HOPPER_GPU = dispatch.Device("cuda", "sm_90a", 132)  # an H100 or H200 (SXM)
# Each schedule the kernel runs, with a slab count for the split-K ones (K 2560 in 5 slabs).
SCHEDULES = [
    ("persistent", 1),
    ("persistent-128", 1),
    ("persistent-192", 1),
    ("stream-k", 1),
    ("split-k", 5),
    ("split-k-128", 5),
]
SCALE_6B = (80 / 36) ** 0.5  # ESMC's residual scale: sqrt(layers / 36)

# Hopper's table without the entries that send a call to one of this project's own CUDA kernels
# (they cannot run on the CPU): the fused kernel's windows, the dequantize kernel, dequantizing a
# block's weights in one launch, the residual add + LayerNorm kernel.
NO_OWN_KERNELS = {
    "fused": {},
    "dequantize_from_width": math.inf,
    "together_min_weights": math.inf,
    "add_norm_from": math.inf,
}


def hopper(force=None, cutlass=True, **tuning) -> dispatch.Target:
    """A Hopper GPU's target with CUTLASS built (``cutlass``), ``force`` and these fields of the
    table replaced, planning no CUDA kernel of this project's own."""
    target = dispatch.Target.of(HOPPER_GPU, cutlass=cutlass, force=force)
    return dataclasses.replace(target, tuning=dataclasses.replace(target.tuning, **{**NO_OWN_KERNELS, **tuning}))


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
        halves = pair_halves(scale_pairs)
        e = mx.where(halves == 0x7FC0, 255, (halves >> 7) - 126)
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
        return HOPPER_GPU.sms

    def weight(self, q, bits, reordered):
        """A reordered weight (cutlass_qmm.reorder) back in MLX's layout, by the PTX ISA's table."""
        self.reordered.append(reordered)
        return mx.array(pack(fragment_order(values_of(np.array(q), bits), inverse=True), bits)) if reordered else q


def pair_halves(scale_pairs):
    """Scale pairs, [K / 64, N] uint32, back to one bf16 bit pattern a group: [N, K / 32]."""
    return mx.stack([scale_pairs & 0xFFFF, scale_pairs >> 16], axis=1).reshape(-1, scale_pairs.shape[1]).T


def values_of(q, bits):
    """A packed 4- or 8-bit uint32 weight [N, K * bits / 32] as its values, [N, K] (little-endian
    fields: a byte's low nibble first)."""
    octets = np.ascontiguousarray(q).view(np.uint8)
    if bits == 8:
        return octets.astype(np.uint32)
    return np.stack([octets & 15, octets >> 4], axis=-1).reshape(q.shape[0], -1).astype(np.uint32)


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
    block_rows = np.arange(0, n, 16)[None, :, None] + r  # [K / 16, N / 16, 256]: block columns, rows
    block_cols = np.arange(0, k, 16)[:, None, None] + c
    source = (block_rows * k + block_cols).reshape(-1)
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
    with pytest.raises(ValueError, match="4- and 8-bit weights, not 2-bit"):
        cutlass_qmm.reorder(mx.array(q), 2)


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
def stand_in(monkeypatch, on_cpu):
    """The extension stood in for on the CPU; this project's own CUDA kernels fail the test if a
    plan reaches one."""
    fake = StandIn()
    monkeypatch.setattr(cutlass_qmm, "_extension", lambda: fake)

    def no_cuda_kernel(*args, **kwargs):
        pytest.fail("a CUDA kernel of this project's own was planned on the CPU")

    for module, name in (
        (qmm, "quantized_matmul"),
        (dequantize, "dequantize"),
        (dequantize, "dequantize_together"),
        (row_kernels, "qkv_heads"),
        (row_kernels, "add_layer_norm"),
    ):
        monkeypatch.setattr(module, name, no_cuda_kernel)
    return fake


def layer(bits=4, group_size=64, mode="affine", in_dims=128, out_dims=64, bias=False, dtype=mx.bfloat16):
    m = rq.QuantizedLinear(in_dims, out_dims, bias=bias, group_size=group_size, bits=bits, mode=mode)
    m.set_dtype(dtype)  # scales, biases and bias, as in a converted bf16 model
    return m


def reference(m, x):
    w = mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode)
    y = x @ w.T
    return y + m.bias if "bias" in m else y


def as_f32(a):
    return np.array(a.astype(mx.float32))


def layer_norm(width, bias=True, dtype=mx.bfloat16, seed=0):
    """An nn.LayerNorm of random weight (and bias) in ``dtype``, as a converted model holds one."""
    norm = nn.LayerNorm(width, bias=bias)
    norm.update({k: mx.random.normal(v.shape, key=mx.random.key(seed + i)) for i, (k, v) in enumerate(norm.items())})
    norm.set_dtype(dtype)
    return norm


# ---- what reaches the extension (the stand-in, calls planned for a Hopper GPU) ----------------
@pytest.mark.parametrize(
    "bits,group_size,bias,mode",
    [(4, 64, False, "affine"), (8, 128, True, "affine"), (4, 128, True, "affine"), (4, 32, True, "mxfp4")],
)
def test_bfloat16_calls_go_to_the_extension_with_transposed_scales(bits, group_size, bias, mode, stand_in):
    """Where the plan sends a call to CUTLASS (300 tokens: past the crossover, within CUTLASS's
    token count) the layer hands the extension x as given and its scales transposed (mxfp4's as
    scale pairs), made once and kept; without CUTLASS built the same call takes dequantize +
    matmul, within bf16's rounding of it."""
    m = layer(bits, group_size, mode, in_dims=256, bias=bias)
    x = mx.random.normal((2, 150, 256), key=mx.random.key(1)).astype(mx.bfloat16)
    with dispatch.use(hopper(cutlass=False)):
        assert m.plan(300).path == "dequantize"
        off = m(x)
    assert stand_in.calls == []
    with dispatch.use(hopper()):
        plan = m.plan(300)
        assert (plan.path, plan.tile, plan.splits) == ("cutlass", "persistent-128", 1)
        on = m(x)
        scales = m.cutlass_scales
        m(x)
    assert stand_in.calls == [((2, 150, 256), bits, group_size, False, 128)] * 2  # x as given; one narrow tile
    assert on.shape == (2, 150, 64)
    np.testing.assert_array_equal(as_f32(on), as_f32(reference(m, x)))
    np.testing.assert_allclose(as_f32(on), as_f32(off), rtol=2e-2, atol=2e-2)
    if mode == "mxfp4":
        assert [s.shape for s in scales] == [(256 // 64, 64)]  # a pair a 64-wide K tile
    else:
        assert [s.shape for s in scales] == [(256 // group_size, 64)] * 2  # scales and biases
    assert m.cutlass_scales is scales  # kept, not redone


@pytest.mark.parametrize("mode,bits,group_size", [("affine", 4, 64), ("affine", 8, 64), ("mxfp4", 4, 32)])
def test_it_hands_over_each_weight_reordered_made_once(mode, bits, group_size, stand_in, monkeypatch):
    """A weight of whole 16-row blocks goes to the kernel reordered, the copy made on its first
    call and kept; MLX's layout for a weight 8 rows past a block (no copy made); the same outputs
    every way."""
    x = mx.random.normal((1, 10, 128), key=mx.random.key(2)).astype(mx.bfloat16)
    m = layer(bits, group_size, mode, out_dims=64)
    with dispatch.use(hopper(force="cutlass")):
        first = m(x)
        copy = m.cutlass_weight
        assert not mx.array_equal(copy, m.weight).item()  # its values moved
        m(x)
        assert stand_in.reordered == [True, True] and m.cutlass_weight is copy
        np.testing.assert_array_equal(as_f32(first), as_f32(reference(m, x)))
        with monkeypatch.context() as patch:
            patch.setattr(cutlass_qmm, "reorders", lambda layer: False)  # MLX's layout handed over
            assert mx.array_equal(m(x), first).item() and stand_in.reordered[-1] is False
        ragged = layer(bits, group_size, mode, out_dims=24)
        assert not cutlass_qmm.reorders(ragged)
        np.testing.assert_array_equal(as_f32(ragged(x)), as_f32(reference(ragged, x)))
    assert stand_in.reordered[-1] is False and not hasattr(ragged, "cutlass_weight")


def test_each_schedule_reaches_the_kernel_as_its_tile_and_stream_k(stand_in):
    """cutlass_qmm.matmul hands the kernel a schedule's token tile and whether it runs stream-K,
    and split-K's slab count; a layer hands over its plan's."""
    m = layer(in_dims=2560, out_dims=256)
    x = mx.random.normal((1, 10, 2560), key=mx.random.key(3)).astype(mx.bfloat16)
    for schedule, splits in SCHEDULES:
        cutlass_qmm.matmul(m, x, schedule, splits)
    assert [call[-2:] for call in stand_in.calls] == [
        (False, 256),
        (False, 128),
        (False, 192),
        (True, 256),
        (False, 256),
        (False, 128),
    ]
    assert stand_in.splits == [s for _, s in SCHEDULES]
    # a weight of 60 tiles at 10 tokens, its short wave shared by stream-K once any K qualifies
    wide = layer(in_dims=128, out_dims=7680)
    with dispatch.use(hopper(force="cutlass", stream_k_min_iterations=1)):
        assert wide.plan(10).tile == "stream-k"
        wide(mx.zeros((10, 128), dtype=mx.bfloat16))
    assert stand_in.calls[-1][-2:] == (True, 256)


@pytest.mark.parametrize("mode,bits,group_size", [("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)])
def test_a_layer_hands_the_kernel_its_plan_s_split_k_slabs(mode, bits, group_size, stand_in):
    """Two tiles of 128 rows and K 2048: split-K in 128-token tiles and 8 slabs of 256, summed as
    x @ dequantize(w).T."""
    m = layer(bits, group_size, mode, in_dims=2048, out_dims=256)
    x = mx.random.normal((1, 10, 2048), key=mx.random.key(3)).astype(mx.bfloat16)
    with dispatch.use(hopper(force="cutlass")):
        plan = m.plan(10)
        y = m(x)
    assert (plan.tile, plan.splits) == ("split-k-128", 8)
    assert stand_in.splits[-1] == 8 and stand_in.calls[-1][-2:] == (False, 128)
    np.testing.assert_allclose(as_f32(y), as_f32(reference(m, x)), rtol=2e-2, atol=2e-2)


def test_a_300m_sized_product_runs_split_k_in_its_plan_s_tile(stand_in):
    """The 300M's down_proj (960 x 2560) at 256 tokens, planned automatically: CUTLASS over the
    fused kernel's window, in 8 slabs of 128-token tiles."""
    m = layer(in_dims=2560, out_dims=960)
    x = mx.random.normal((256, 2560), key=mx.random.key(5)).astype(mx.bfloat16)
    with dispatch.use(hopper()):
        y = m(x)
    np.testing.assert_allclose(as_f32(y), np.array(reference(m, x.astype(mx.float32))), rtol=2e-2, atol=2e-2)
    assert stand_in.calls[-1][-2:] == (False, 128) and stand_in.splits[-1] == 8


def test_split_k_adds_the_residual_stream_in_its_sum(stand_in):
    """CUDA's add_norm hands a quantized product's residual stream and the LayerNorm after it to
    the kernel where the call runs split-K (residual + product / scale and its LayerNorm from its
    sum: the ops' values); every other call gets MLX's add and LayerNorm on the product: whole
    tiles, a bias, a residual of another dtype, float16, CUTLASS not built."""
    x = mx.random.normal((1, 10, 2048), key=mx.random.key(4)).astype(mx.bfloat16)
    r = mx.random.normal((1, 10, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    norm = layer_norm(256)
    # the kernel's LayerNorm runs a block a row: up to 8192 bf16 values (1024 threads of 8)
    assert cutlass_qmm.norms_in_sum(layer_norm(8192), 8192) and not cutlass_qmm.norms_in_sum(layer_norm(8200), 8200)
    forced = hopper(force="cutlass")
    with dispatch.use(forced):
        for mode, bits, group_size in [("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)]:
            m = layer(bits, group_size, mode, in_dims=2048, out_dims=256)  # 2 tiles: 8 slabs
            assert m.plan(10, added=True).splits == 8
            added, normed = fusions.CUDA.add_norm(r, m, x, SCALE_6B, norm)
            assert stand_in.splits[-1] == 8 and stand_in.residuals[-1] == ((1, 10, 256), SCALE_6B)
            assert stand_in.norms[-1][0] is norm.weight and stand_in.norms[-1][1:] == (norm.bias, norm.eps)
            assert mx.array_equal(added, r + m(x) / SCALE_6B).item()
            assert mx.array_equal(normed, norm(added)).item()
        short = layer(in_dims=256, out_dims=256)  # K under split_k_min_k_added: whole tiles
        biased = layer(in_dims=2048, out_dims=256, bias=True)
        m = layer(in_dims=2048, out_dims=256)
        x_short = x[..., :256]
        assert short.plan(10, added=True).splits == 1
        for a, linear, h in ((r, short, x_short), (r, biased, x), (r.astype(mx.float32), m, x)):
            calls = len(stand_in.calls)
            got = fusions.CUDA.add_norm(a, linear, h, SCALE_6B, norm)
            assert len(stand_in.calls) == calls + 1 and stand_in.residuals[-1] is None  # the product alone
            want = PLAIN.add_norm(a, linear, h, SCALE_6B, norm)
            assert all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))
        calls = len(stand_in.calls)
        fusions.CUDA.add_norm(r.astype(mx.float16), m, x.astype(mx.float16), 1.0, norm)  # CUTLASS takes bf16 only
        with pytest.raises(ValueError, match="to a product without bias"):
            cutlass_qmm.matmul(biased, x, "split-k", 8, r)
        with pytest.raises(ValueError, match="to a product without bias"):
            cutlass_qmm.matmul(m, x, "persistent", 1, r)
        with pytest.raises(ValueError, match="with a residual only"):
            cutlass_qmm.matmul(m, x, "split-k", 8, norm=norm)
    with dispatch.use(dataclasses.replace(forced, cutlass=False)):
        fusions.CUDA.add_norm(r, m, x, 1.0, norm)
    assert len(stand_in.calls) == calls


@pytest.mark.parametrize(
    "norm,why",
    [
        (layer_norm(256, dtype=mx.float32), "an fp32 weight: mx.fast.layer_norm's output would not be bf16"),
        (layer_norm(256, bias=False), None),
        (nn.LayerNorm(256, affine=False), "no weight"),
        (layer_norm(128), "another width"),
    ],
)
def test_split_k_s_sum_normalizes_where_the_kernel_can(norm, why, stand_in):
    """The kernel takes the LayerNorm where it computes mx.fast.layer_norm's values (a bf16 weight,
    with or without a bf16 bias, of the product's width); otherwise the sum adds only and MLX
    normalizes, with the same outputs either way."""
    m = layer(in_dims=2048, out_dims=256)
    x = mx.random.normal((1, 10, 2048), key=mx.random.key(4)).astype(mx.bfloat16)
    r = mx.random.normal((1, 10, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    assert cutlass_qmm.norms_in_sum(norm, 256) is (why is None)
    if norm.get("weight") is not None and norm.weight.shape != (256,):
        return  # a mismatched LayerNorm is the caller's error: the ops raise too
    with dispatch.use(hopper(force="cutlass")):
        added, normed = fusions.CUDA.add_norm(r, m, x, SCALE_6B, norm)
        assert stand_in.residuals[-1] is not None and (stand_in.norms[-1] is None) is (why is not None)
        assert mx.array_equal(added, r + m(x) / SCALE_6B).item()
    assert normed.dtype == norm(added).dtype and mx.array_equal(normed, norm(added)).item()


def test_a_model_adds_each_residual_in_the_split_k_sum(stand_in):
    """A model whose o_proj and down_proj run split-K (hidden 1024: 8 tiles, 4 slabs) hands each
    its residual stream and the LayerNorm after it, and gives the outputs it gives with MLX's add
    and LayerNorm on the same products (a table where no residual goes into the sum, and whose
    products without one split K alike). Heads of 128 keep the q/k/v layout kernel out of the
    plans."""
    from esmc_mlx.bench import mlx_model

    config = testing.tiny_config(hidden_size=1024, intermediate_size=1024, num_attention_heads=8, num_hidden_layers=2)
    weights = dict(tree_flatten(testing.random_mlx_model(config).parameters()))
    model = mlx_model(config, weights, fuse=True, quant={"mode": "affine", "bits": 4, "group_size": 64})
    model.use_ops(fusions.CUDA)
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(1, 12)))
    in_sum = hopper(force="cutlass")
    ops_after = hopper(force="cutlass", split_k_min_k_added=math.inf, split_k_min_k=in_sum.tuning.split_k_min_k_added)
    for o_proj in (model.esmc.layers[0].self_attn.o_proj, model.esmc.layers[0].mlp.down_proj):
        with dispatch.use(in_sum):
            added = o_proj.plan(12, added=True)
        with dispatch.use(ops_after):
            assert o_proj.plan(12, added=True).splits == 1
            assert o_proj.plan(12) == added and (added.tile, added.splits) == ("split-k-128", 4)
    with dispatch.use(in_sum):
        out = model(ids, output_hidden_states=True)
    added = [r for r in stand_in.residuals if r is not None]
    assert len(added) == 4 and all(r == ((1, 12, 1024), config.residual_scale) for r in added)  # 2 a block
    # each with the LayerNorm after it: post-attention, the next block's input, the final one (no bias)
    blocks = model.esmc.layers
    norms = [blocks[0].post_attention_layernorm, blocks[1].input_layernorm, blocks[1].post_attention_layernorm]
    passed = [n[:2] for n in stand_in.norms if n is not None]
    wanted = [(n.weight, n.get("bias")) for n in [*norms, model.esmc.norm]]
    assert len(passed) == 4 and all(a is b for pair in zip(passed, wanted, strict=True) for a, b in zip(*pair))
    calls = len(stand_in.calls)
    with dispatch.use(ops_after):
        ref = model(ids, output_hidden_states=True)
    assert len(stand_in.calls) == 2 * calls and stand_in.residuals[-calls:] == [None] * calls
    for got, want in zip((out.logits, *out.hidden_states), (ref.logits, *ref.hidden_states), strict=True):
        assert mx.array_equal(got, want).item()


def test_a_layer_fused_after_its_parts_ran_makes_its_own_copies(stand_in):
    """q/k/v fused into one layer after each ran CUTLASS (a model fused after use): the fused
    layer makes its own scales and reordered weight, not the first part's."""
    from esmc_mlx.runtime.execution import concat_linears

    parts = [layer(4, 32, "mxfp4", in_dims=256) for _ in range(3)]
    x = mx.random.normal((1, 300, 256), key=mx.random.key(7)).astype(mx.bfloat16)
    with dispatch.use(hopper()):
        for part in parts:
            part(x)
        fused = concat_linears(parts)
        y = fused(x)
    assert fused.cutlass_scales[0].shape == (256 // 64, 192) and fused.cutlass_weight.shape == fused.weight.shape
    np.testing.assert_array_equal(as_f32(y), as_f32(reference(fused, x)))


def test_other_inputs_and_weights_keep_their_path(stand_in):
    """Calls CUTLASS's kernel does not take never reach it, even forced: a float32 x, float16 x,
    weights of other modes, bits or groups, K not whole 64-wide tiles, mxfp4 scales past the
    pairs' range, rows of y not 16 bytes, float32 scales. Each runs the plan and gives the
    output it has where CUTLASS is not built, bit for bit."""
    x32 = mx.random.normal((1, 7, 128), key=mx.random.key(2))
    xb = x32.astype(mx.bfloat16)
    m = layer()
    calls = [(m, x32), (m, x32.astype(mx.float16))]
    for other in (
        layer(mode="mxfp8", bits=8, group_size=32),  # neither affine nor mxfp4
        layer(mode="mxfp4", group_size=32, in_dims=96),  # K not whole 64-wide tiles
        past_the_pairs_range(layer(mode="mxfp4", group_size=32)),  # a scale of 4 (weights of 16-24)
        layer(bits=2),  # the kernel has 4 and 8 bits
        layer(group_size=32),  # groups smaller than CUTLASS's K tile
        layer(out_dims=60),  # rows of y not 16 bytes
        layer(dtype=mx.float32),  # float32 scales
    ):
        calls.append((other, xb[..., : other.weight.shape[1] * 32 // other.bits]))  # its in_dims
    forced = hopper(force="cutlass")
    for linear, x in calls:
        with dispatch.use(forced):
            plan = linear.plan(7, x.dtype)
            got = linear(x)
        with dispatch.use(dataclasses.replace(forced, cutlass=False)):
            assert linear.plan(7, x.dtype).path == plan.path != "cutlass"
            assert mx.array_equal(got, linear(x)).item()
        exact = np.array(reference(linear, x.astype(mx.float32)))
        # within bf16's rounding of the sums, whose terms reach the largest output's size
        np.testing.assert_allclose(as_f32(got), exact, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(exact).max()))
    assert stand_in.calls == []


def past_the_pairs_range(m):
    """``m`` (mxfp4) with one group's scale past what scale pairs hold: 2^(129-127)."""
    e = np.array(m.scales)
    e[1, 2] = cutlass_qmm.MXFP4_MAX_EXPONENT + 1
    m.scales = mx.array(e)
    return m


def test_not_on_other_gpus(stand_in, monkeypatch, tmp_path):
    """The build targets sm_90a: on any other device the extension is neither used nor built."""
    m = layer()
    with dispatch.use(dispatch.Target.of(dispatch.Device.parse("cuda:sm_80"), cutlass=True, force="cutlass")):
        assert m.plan(10).path != "cutlass"
        m(mx.zeros((10, 128), dtype=mx.bfloat16))
    assert stand_in.calls == []
    monkeypatch.setattr(cutlass_qmm.device, "arch", lambda: "sm_80")
    assert not cutlass_qmm.available() and cutlass_qmm.why_unused() is None
    with (
        settings.override(cache=tmp_path),
        pytest.raises(cutlass_qmm.BuildError, match=r"compute capability 9.0 GPU only \(this device: sm_80\)"),
    ):
        cutlass_qmm.build()
    assert not (tmp_path / "cutlass_qmm").exists()


def test_a_compiled_model_traces_again_under_another_target():
    """A compiled model runs a shape compiled from its second call under the same target; under
    another (CUTLASS built or not, another table) the next call is a first again, so the layers
    prepare CUTLASS's copies outside any trace; back under the first, its trace is reused."""
    from esmc_mlx.runtime.model import ESMC

    model = ESMC(testing.tiny_config()).compile()
    ids = mx.zeros((1, 12), dtype=mx.int32)
    built = hopper()
    targets = (built, dataclasses.replace(built, cutlass=False), hopper(split_k_min_k_added=math.inf))
    assert [model.use_compiled(ids, None) for _ in range(2)] == [False, True]
    for target in targets:
        with dispatch.use(target):
            assert [model.use_compiled(ids, None) for _ in range(2)] == [False, True]
    with dispatch.use(built):
        assert model.use_compiled(ids, None)
    assert model.use_compiled(ids, None)


# ---- planning: functions of a Weight on Hopper's table --------------------------------------
def test_cutlass_takes_calls_up_to_its_table_s_token_count():
    """cutlass_tokens per table (the weight's smaller dimension picks it, as for the other
    tables), the same for every mode CUTLASS takes; forced, every token count; not built, none."""
    built = dispatch.Target.of(HOPPER_GPU, cutlass=True)
    forced = dataclasses.replace(built, force="cutlass")
    unbuilt = dataclasses.replace(forced, cutlass=False)
    for mode, bits, group_size in [("affine", 4, 64), ("affine", 8, 64), ("mxfp4", 4, 32)]:
        scales = "uint8" if mode == "mxfp4" else "bfloat16"
        for rows, k, table in ((960, 960, "small"), (2560, 6912, "large")):
            w = Weight(mode, bits, group_size, rows, k, scales)
            last = HOPPER.cutlass_tokens[table]
            assert dispatch.linear(w, last, "bfloat16", built).path == "cutlass"
            assert dispatch.linear(w, last + 1, "bfloat16", built).path == "dequantize"
            assert all(dispatch.linear(w, t, "bfloat16", forced).path == "cutlass" for t in (1, last + 1, 32768))
            assert all(dispatch.linear(w, t, "bfloat16", unbuilt).path != "cutlass" for t in (1, last, last + 1))


def test_over_the_small_models_fused_window_from_its_token_count():
    """Inside the fused kernel's window on the small models' table CUTLASS takes bfloat16 calls
    from cutlass_over_fused's count, every weight (a fill of 0): the 300M's q/k/v, o_proj and
    down_proj; the fused kernel keeps the rest, float16 calls, calls with the fused path forced
    and all calls without CUTLASS."""
    built = dispatch.Target.of(HOPPER_GPU, cutlass=True)
    lo, hi = HOPPER.fused["small"]["affine4"]
    first, fill = HOPPER.cutlass_over_fused["small"]
    assert fill == 0 and lo < first < hi
    for rows, k in ((2880, 960), (960, 960), (960, 2560)):
        w = Weight("affine", 4, 64, rows, k)
        paths = [dispatch.linear(w, t, "bfloat16", built).path for t in (lo, first - 1, first, hi - 1)]
        assert paths == ["fused", "fused", "cutlass", "cutlass"], (rows, k)
        assert dispatch.linear(w, first, "float16", built).path == "fused"
        for other in (dataclasses.replace(built, force="fused"), dataclasses.replace(built, cutlass=False)):
            assert dispatch.linear(w, first, "bfloat16", other).path == "fused"


def test_over_the_6b_s_fused_window_where_its_tiles_fill_the_sms():
    """On the 6B's table CUTLASS takes the fused window's bfloat16 calls from cutlass_over_fused's
    count for a weight whose tiles keep enough of the SMs busy, each tile counted once a slab
    where K is split: the gate/up (13824 rows: 108 tiles) and the down_proj (2560 by 6912: 20
    tiles in 6 slabs), not 2560 by 2368 (20 tiles; K 37 tiles of 64, in no whole slabs)."""
    built = dispatch.Target.of(HOPPER_GPU, cutlass=True)
    fewest, fill = HOPPER.cutlass_over_fused["large"]
    lo, hi = HOPPER.fused["large"]["affine4"]
    assert lo < fewest < hi
    down = Weight("affine", 4, 64, 2560, 6912)
    assert dispatch._sm_fill(down, hi - 1, HOPPER, HOPPER_GPU.sms) == pytest.approx(120 / 132)
    for w, takes in (
        (Weight("affine", 4, 64, 13824, 2560), True),
        (down, True),
        (Weight("affine", 4, 64, 2560, 2368), False),
    ):
        assert (dispatch._sm_fill(w, hi - 1, HOPPER, HOPPER_GPU.sms) >= fill) == takes
        paths = [dispatch.linear(w, t, "bfloat16", built).path for t in (lo, fewest - 1, fewest, hi - 1)]
        assert paths == ["fused", "fused", *(["cutlass"] * 2 if takes else ["fused"] * 2)], w
    assert [dispatch.linear(down, t, "bfloat16", built).splits for t in (fewest, hi - 1)] == [6, 6]


def schedule(rows, k, tokens, added=False, group_size=64, sms=HOPPER_GPU.sms):
    return dispatch.cutlass_schedule(Weight("affine", 4, group_size, rows, k), tokens, HOPPER, sms, added)


def test_schedule_stream_k_for_a_short_last_wave_else_the_narrow_tile_where_it_takes_no_more_waves():
    """Whole 128 x 256 tiles on 132 SMs: the 6B's 2560-row weights at 1024 tokens make 80 tiles
    (0.61 of a wave), its q/k/v (7680 rows) 240 (two waves, 0.91), its gate/up (13824) 432 (four
    waves, 0.82). Stream-K takes a short wave with enough K iterations to share: the down_proj
    (K 6912: 8640), not the o_proj (K 2560: 3200). The 128 x 192 tile takes the o_proj (120
    tiles, still one wave) and the 300M's gate/up (5120 x 960: 2400 iterations; 160 or 240
    tiles, two waves either way), not the 6B's q/k/v (360 tiles: three waves) nor anything at
    2048 tokens, where it would take more waves; the 128 x 128 tile takes what it fits in as few
    waves (at 128-256 tokens)."""
    assert dispatch._wave_fill(2560, 1024, 132) == pytest.approx(80 / 132)
    assert dispatch._wave_fill(7680, 1024, 132) == pytest.approx(240 / 264)
    assert dispatch._wave_fill(2560, 1000, 132) == dispatch._wave_fill(2560, 1024, 132)  # ragged counts whole
    assert dispatch._waves(7680, 1024, 132, 192) == 3 and dispatch._waves(7680, 1024, 132) == 2
    six_b = [(2560, 6912), (13824, 2560), (2560, 2560), (7680, 2560)]  # down, gate/up, o, q/k/v
    assert [schedule(rows, k, 1024)[0] for rows, k in six_b] == ["stream-k", "stream-k", "persistent-192", "persistent"]
    assert schedule(5120, 960, 1024) == ("persistent-192", 1)
    assert [schedule(rows, k, 2048)[0] for rows, k in six_b] == [
        "stream-k",
        "persistent",  # 864 tiles, 0.94 of seven waves; nine narrow
        "stream-k",
        "persistent",
    ]
    # One wave: stream-K only where whole tiles leave at least stream_k_one_wave_below idle.
    assert schedule(13824, 2560, 256) == ("persistent", 1)  # 108 tiles (0.82), 4320 iterations
    assert schedule(13824, 2560, 128) == ("persistent-128", 1)  # as many narrowest tiles
    assert schedule(7680, 2560, 256) == ("persistent-128", 1)  # 120 of 128 tokens: one wave
    assert dispatch.tile_width("persistent-192") == 192 and dispatch.tile_width("stream-k") == 256


def test_split_k_cuts_k_into_as_many_slabs_as_still_fill_one_wave():
    """Whole tiles filling less than split_k_below of one wave (132 SMs) and K at least
    split_k_min_k: K in the most slabs that keep one wave, each whole K tiles and scale groups
    (split_unit) and at least split_k_min_slab. The 6B at 256 tokens: o_proj and down_proj 20
    tiles (0.15 of the wave), q/k/v 60 (0.45), gate/up 108 (0.82)."""
    assert dispatch.split_unit(Weight("affine", 4, 128, 2560, 2560)) == 128
    assert dispatch.split_unit(Weight("mxfp4", 4, 32, 2560, 2560, "uint8")) == 64
    # 6 slabs would fit the wave, but 2560 is no multiple of 6 x 128 either
    assert schedule(2560, 2560, 256, group_size=128) == ("split-k", 5)
    assert schedule(2560, 6912, 256, group_size=128) == ("split-k", 6)
    assert schedule(7680, 2560, 256) == ("persistent-128", 1)  # the tiles fill 0.45
    assert schedule(13824, 2560, 256) == ("persistent", 1)
    assert schedule(2560, 384, 256) == ("persistent-128", 1)  # nothing to split
    assert schedule(960, 960, 256) == ("persistent-128", 1)  # K too short to pay for the slabs
    # unless the slabs' sum adds the residual stream (the 300M's o_proj): it replaces the add's kernel
    assert schedule(960, 960, 256, added=True) == ("split-k-128", 3)  # 5 slabs would be 192 of K
    assert schedule(960, 384, 256, added=True) == ("persistent-128", 1)  # K under split_k_min_k_added
    assert schedule(2560, 2560, 256, sms=114) == ("split-k", 5)  # an H100 PCIe: the wave holds 5 still
    assert schedule(2560, 2560, 256, sms=80) == ("split-k", 4)  # a smaller wave: fewer slabs
    assert schedule(2560, 2560, 256, sms=60) == ("persistent-128", 1)  # 20 tiles fill 0.33 of it


def test_split_k_runs_the_tiles_that_leave_each_the_least_work():
    """Split-K's tiles are 128 tokens wide where their slabs leave each tile less K x tokens than
    the 256-token tiles' (the wider on a tie)."""
    # The 300M's o_proj and down_proj at 256 tokens: 48 tiles of 128 tokens x 320 of K against 24
    # of 256 x 320; 128 of 128 x 320 against 80 of 256 x 256
    assert schedule(960, 2560, 256, added=True) == ("split-k-128", 8)
    # At 128 tokens or fewer a 256-token tile is half empty: as many slabs of 128-token tiles
    assert schedule(2560, 6912, 128, added=True) == ("split-k-128", 6)
    assert schedule(960, 2560, 1024, added=True) == ("split-k", 4)  # 4 x 256 x 640 = 2 x 128 x 1280
    assert dispatch.tile_width("split-k-128") == 128 and dispatch.tile_width("split-k") == 256
    # the SMs it keeps busy: 16 tiles of 128 tokens in 8 slabs
    assert dispatch._sm_fill(Weight("affine", 4, 64, 960, 2560), 256, HOPPER, 132) == pytest.approx(128 / 132)


# ---- the build -------------------------------------------------------------------------------
def test_off_unless_built(monkeypatch, tmp_path):
    monkeypatch.setattr(cutlass_qmm.device, "arch", lambda: "sm_90a")
    cutlass_qmm._extension.cache_clear()
    try:
        with settings.override(cache=tmp_path):
            folder = cutlass_qmm.build_dir()
            assert folder.parent == tmp_path / "cutlass_qmm" and folder.name.startswith(f"mlx-{mx.__version__}-")
            assert cutlass_qmm._extension() is None and not cutlass_qmm.available()  # nothing built there
            assert "esmc-mlx build-cutlass builds it" in cutlass_qmm.why_unused()
            with settings.override(kernels=False):
                assert cutlass_qmm.why_unused() == "turned off (ESMC_MLX_KERNELS=0)"
            # A build of another cutlass_qmm.cu (another signature) lies elsewhere and is not loaded.
            old = tmp_path / "cutlass_qmm" / f"mlx-{mx.__version__}" / f"{cutlass_qmm.MODULE}{EXTENSION_SUFFIX}"
            old.parent.mkdir(parents=True)
            old.write_bytes(b"not this source's build")
            cutlass_qmm._extension.cache_clear()
            with pytest.warns(
                EsmcMlxWarning, match=rf"for another MLX or esmc-mlx \(mlx-{mx.__version__}\).*build-cutlass"
            ):
                assert cutlass_qmm._extension() is None
            assert not cutlass_qmm.available()  # said once (cached)
        with settings.override(cache=None):
            assert cutlass_qmm.build_dir() is None
            with pytest.raises(cutlass_qmm.BuildError, match="cache is off"):
                cutlass_qmm.build()
    finally:
        cutlass_qmm._extension.cache_clear()


def test_a_built_extension_is_used_on_hopper(monkeypatch):
    monkeypatch.setattr(cutlass_qmm.device, "arch", lambda: "sm_90a")
    monkeypatch.setattr(cutlass_qmm, "_extension", lambda: StandIn())
    assert cutlass_qmm.available() and cutlass_qmm.why_unused() is None
    assert cutlass_qmm.sm_count() == HOPPER_GPU.sms


def test_the_build_is_named_by_its_source_and_every_header_of_ours_it_includes(monkeypatch, tmp_path):
    """A change to a header cutlass_qmm.cu includes from this package (layer_norm_rows.cuh, which
    the row kernels share) names another build, as a change to the .cu does: an old build is
    never loaded against new arithmetic. HEADERS lists every such include."""
    compiled = (cutlass_qmm.SOURCE, cutlass_qmm.GEMM_SOURCE, cutlass_qmm.SOURCE.with_name("cutlass_qmm_gemm.cuh"))
    included = {n for f in compiled for n in re.findall(r'^#include "([^/"]+)"', f.read_text(), flags=re.MULTILINE)}
    assert included and included | {cutlass_qmm.GEMM_SOURCE.name} == {h.name for h in cutlass_qmm.HEADERS}
    assert all(h.parent == cutlass_qmm.SOURCE.parent and h.exists() for h in cutlass_qmm.HEADERS)
    shipped_header = cutlass_qmm.SOURCE.with_name(row_kernels.ROW_HEADER)
    assert shipped_header in cutlass_qmm.HEADERS
    with settings.override(cache=tmp_path):
        shipped = cutlass_qmm.build_dir()
        header = tmp_path / row_kernels.ROW_HEADER
        header.write_bytes(shipped_header.read_bytes() + b"// changed\n")
        monkeypatch.setattr(
            cutlass_qmm, "HEADERS", tuple(header if h == shipped_header else h for h in cutlass_qmm.HEADERS)
        )
        assert cutlass_qmm.build_dir() != shipped and cutlass_qmm.build_dir().parent == shipped.parent
        header.write_bytes(shipped_header.read_bytes())
        assert cutlass_qmm.build_dir() == shipped


def test_a_build_that_does_not_load_says_so(monkeypatch, tmp_path, on_cpu):
    """A broken build is one BuildError naming the file, met where a Hopper GPU asks whether the
    extension is there and where a quantized layer calls it."""
    monkeypatch.setattr(cutlass_qmm.device, "arch", lambda: "sm_90a")
    cutlass_qmm._extension.cache_clear()
    try:
        with settings.override(cache=tmp_path):
            broken = cutlass_qmm.build_dir() / (cutlass_qmm.MODULE + EXTENSION_SUFFIX)
            broken.parent.mkdir(parents=True)
            broken.write_bytes(b"not a shared library")
            with pytest.raises(cutlass_qmm.BuildError, match=f"{broken} does not load .*rebuild it"):
                cutlass_qmm._extension()
            with pytest.raises(cutlass_qmm.BuildError, match="does not load"):
                cutlass_qmm.available()
            with dispatch.use(hopper(force="cutlass")), pytest.raises(EsmcMlxError, match="does not load"):
                layer()(mx.zeros((1, 4, 128), dtype=mx.bfloat16))
    finally:
        cutlass_qmm._extension.cache_clear()


def test_build_names_what_is_missing(monkeypatch, tmp_path):
    out = tmp_path / "x.so"
    with pytest.raises(cutlass_qmm.BuildError, match="no-such-nvcc not found"):
        cutlass_qmm.build_commands(out, tmp_path, nvcc="no-such-nvcc")
    monkeypatch.setattr(cutlass_qmm.shutil, "which", lambda name: "/usr/bin/" + name)
    cuda_mlx = tmp_path / "mlx"  # the layout of MLX's CUDA wheel
    (cuda_mlx / "include" / "cutlass").mkdir(parents=True)
    (cuda_mlx / "lib").mkdir()
    monkeypatch.setattr(cutlass_qmm.mx, "__file__", str(cuda_mlx / "__init__.py"))
    monkeypatch.setitem(sys.modules, "nanobind", None)  # not installed
    with pytest.raises(cutlass_qmm.BuildError, match="nanobind not found"):
        cutlass_qmm.build_commands(out, tmp_path)

    class OldNanobind:
        __version__ = "2.9.2"

    monkeypatch.setitem(sys.modules, "nanobind", OldNanobind)
    with pytest.raises(cutlass_qmm.BuildError, match="nanobind 2.9.2 does not share"):
        cutlass_qmm.build_commands(out, tmp_path)
    failed = cutlass_qmm.BuildError("nvcc failed: x")
    monkeypatch.setattr(cutlass_qmm, "build", lambda nvcc, log, **kw: (_ for _ in ()).throw(failed))
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
    compiles, link = cutlass_qmm.build_commands(
        tmp_path / "x.so", tmp_path / "work", mlx_root=other, python_include="/py312/include"
    )
    assert f"-L{other / 'lib'}" in link and link[-2:] == ["-o", str(tmp_path / "x.so")]
    for command in compiles:
        assert f"-I{other / 'include'}" in command and "-I/py312/include" in command
        assert f"-arch={cutlass_qmm.HOPPER}" in command and command[-4] == "-c"
    # the primitive, nanobind, and the GEMMs once per weight type and layout, each its own object
    assert compiles[0][-3] == str(cutlass_qmm.SOURCE)
    gemms = [c for c in compiles if str(cutlass_qmm.GEMM_SOURCE) in c]
    assert len(gemms) == 6 and len({tuple(c) for c in gemms}) == 6
    assert sorted(c[-1] for c in compiles) == sorted(a for a in link if a.endswith(".o"))
    here = str(Path(cutlass_qmm.mx.__file__).resolve().parent)
    assert not [flag for command in [*compiles, link] for flag in command if here in flag]


def test_the_build_runs_its_compiles_side_by_side_then_links(tmp_path):
    """run_build starts up to ``jobs`` compiles at once, links once all of them succeeded, and
    stops at the first that fails, naming nvcc's error, with no link."""
    log = tmp_path / "log"

    def step(name, seconds=0.3, fails=False):
        code = f"import time,sys; open({str(log)!r},'a').write('start {name}\\n'); time.sleep({seconds}); "
        code += f"open({str(log)!r},'a').write('end {name}\\n'); "
        code += "sys.stderr.write('k.cu(3): error: bad\\n'); sys.exit(1)" if fails else "pass"
        return [sys.executable, "-c", code]

    cutlass_qmm.run_build([step("a"), step("b"), step("c")], step("link", 0))
    events = [tuple(line.split()) for line in log.read_text().splitlines()]
    assert sorted(events[:2]) == [("start", "a"), ("start", "b")]  # both running before either ends
    assert events[-2:] == [("start", "link"), ("end", "link")]
    log.unlink()
    with pytest.raises(cutlass_qmm.BuildError, match="k.cu\\(3\\): error: bad"):
        cutlass_qmm.run_build([step("a", 0, fails=True), step("b", 5)], step("link", 0), jobs=1)
    assert "link" not in log.read_text() and "b" not in log.read_text()


def test_build_cutlass_help_explains_without_building(monkeypatch):
    monkeypatch.setattr(cutlass_qmm, "build", lambda nvcc, log, **kw: pytest.fail("--help built the extension"))
    out = CliRunner().invoke(main, ["build-cutlass", "--help"])
    assert out.exit_code == 0
    text = " ".join(out.output.split())
    assert "build-cutlass [OPTIONS]" in text and "ESMC_MLX_KERNELS=0 turns every custom kernel off" in text
    assert "esmc-mlx info MODEL --plan" in text


def test_build_cutlass_passes_its_compiler_and_says_where_it_went(monkeypatch, tmp_path):
    made = tmp_path / "x.so"
    monkeypatch.setattr(cutlass_qmm, "build", lambda nvcc, log, **kw: log(f"with {nvcc}") or made)
    out = CliRunner().invoke(main, ["build-cutlass", "--nvcc", "/opt/cuda/bin/nvcc"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines() == [
        "with /opt/cuda/bin/nvcc",
        f"Built {made}. Quantized models use it from now on (esmc-mlx info MODEL --plan shows where).",
    ]


def test_build_command_reads_mlx_s_cutlass_headers(monkeypatch, tmp_path):
    """A CPU build of MLX has no CUTLASS headers: the build says so, naming the folder."""
    monkeypatch.setattr(cutlass_qmm.shutil, "which", lambda name: "/usr/bin/" + name)
    fake_mlx = tmp_path / "mlx"
    fake_mlx.mkdir()
    monkeypatch.setattr(cutlass_qmm.mx, "__file__", str(fake_mlx / "__init__.py"))
    with pytest.raises(cutlass_qmm.BuildError, match=f"{fake_mlx} has no CUTLASS headers"):
        cutlass_qmm.build_commands(tmp_path / "x.so", tmp_path)


# ---- the real extension (a Hopper GPU, built) -----------------------------------------------
def forced_cutlass() -> dispatch.Target:
    """This GPU's target with CUTLASS taking every call it can."""
    return dataclasses.replace(dispatch.current(), force="cutlass")


def error_bound(m, x):
    """Twice the bf16 matmul's own error from x @ dequantize(w).T in float32, and that product."""
    exact = reference(m, x.astype(mx.float32))
    return 2 * float(mx.abs(reference(m, x).astype(mx.float32) - exact).max()) + 1e-3, exact


@pytest.mark.cutlass
@pytest.mark.parametrize(
    "bits,group_size,mode", [(4, 64, "affine"), (8, 64, "affine"), (4, 128, "affine"), (4, 32, "mxfp4")]
)
@pytest.mark.parametrize("tokens", [1, 3, 300, 1024])
@pytest.mark.parametrize("schedule,splits", SCHEDULES)
def test_extension_matches_dequantize_and_matmul(bits, group_size, mode, tokens, schedule, splits):
    """The real kernel, every schedule and tile, against x @ dequantize(w).T in float32: at most the
    bf16 matmul's own error from it, and the same bits on a second call (stream-K's and split-K's
    partial sums are added in a fixed order)."""
    m = layer(bits, group_size, mode, in_dims=2560, out_dims=1024, bias=True)
    x = mx.random.normal((1, tokens, 2560), key=mx.random.key(tokens)).astype(mx.bfloat16)
    got = cutlass_qmm.matmul(m, x, schedule, splits)
    assert got.shape == (1, tokens, 1024) and got.dtype == mx.bfloat16
    assert mx.array_equal(got, cutlass_qmm.matmul(m, x, schedule, splits)).item()
    bound, exact = error_bound(m, x)
    assert float(mx.abs(got.astype(mx.float32) - exact).max()) <= bound


@pytest.mark.cutlass
@pytest.mark.parametrize(
    "bits,group_size,mode", [(4, 64, "affine"), (8, 64, "affine"), (4, 128, "affine"), (4, 32, "mxfp4")]
)
@pytest.mark.parametrize("tokens", [1, 300, 1024])
@pytest.mark.parametrize("schedule,splits", SCHEDULES)
def test_a_reordered_weight_gives_the_same_bits(bits, group_size, mode, tokens, schedule, splits, monkeypatch):
    """The kernel on cutlass_qmm.reorder's copy of the weight (as the layers hand it over): the
    same products summed in the same order as on MLX's layout, so the same output bit for bit
    (which the tests around hold to dequantize + matmul and mx.dequantize)."""
    m = layer(bits, group_size, mode, in_dims=2560, out_dims=1024, bias=True)
    x = mx.random.normal((1, tokens, 2560), key=mx.random.key(tokens)).astype(mx.bfloat16)
    reordered = cutlass_qmm.matmul(m, x, schedule, splits)
    assert hasattr(m, "cutlass_weight")
    monkeypatch.setattr(cutlass_qmm, "reorders", lambda layer: False)  # MLX's layout handed over
    assert mx.array_equal(cutlass_qmm.matmul(m, x, schedule, splits), reordered).item()


@pytest.mark.cutlass
@pytest.mark.parametrize("splits", [2, 5, 10])  # 10: more slabs than the sum's kernel loads at once
@pytest.mark.parametrize("schedule", ["split-k", "split-k-128"])
def test_split_k_in_any_number_of_slabs(splits, schedule):
    """Split-K in as many slabs as it is handed, in either tile, gives x @ dequantize(w).T within
    the bf16 matmul's own error of the float32 product, and its sum adds the residual and
    normalizes as MLX's ops do, bit for bit."""
    m = layer(4, 64, "affine", in_dims=2560, out_dims=1024)
    x = mx.random.normal((1, 77, 2560), key=mx.random.key(splits)).astype(mx.bfloat16)
    got = cutlass_qmm.matmul(m, x, schedule, splits)
    bound, exact = error_bound(m, x)
    assert float(mx.abs(got.astype(mx.float32) - exact).max()) <= bound
    r = mx.random.normal((1, 77, 1024), key=mx.random.key(99)).astype(mx.bfloat16)
    norm = layer_norm(1024)
    added, normed = cutlass_qmm.matmul(m, x, schedule, splits, residual=r, scale=SCALE_6B, norm=norm)
    assert mx.array_equal(added, r + got / SCALE_6B).item() and mx.array_equal(normed, norm(added)).item()


@pytest.mark.cutlass
@pytest.mark.parametrize("mode,bits,group_size", [("mxfp4", 4, 32), ("affine", 4, 64), ("affine", 8, 128)])
@pytest.mark.parametrize("tokens", [1, 77, 256])
@pytest.mark.parametrize("scale", [SCALE_6B, (30 / 36) ** 0.5, 1.0])  # the 6B's, the 300M's, none
def test_the_residual_added_in_split_k_s_sum_is_the_ops_bit_for_bit(mode, bits, group_size, tokens, scale):
    """residual + x @ w.T / scale from the kernel that sums the slabs, and mx.fast.layer_norm of
    it from the same kernel, equal MLX's ops on the kernel's own product, bit for bit, eager and
    compiled: the 6B's o_proj and down_proj (2560 wide) and products as wide as the 300M's (960)
    and the 600M's (1152), each with a LayerNorm with a bias and one without (the final one)."""
    with dispatch.use(forced_cutlass()):
        for k, n in ((2560, 2560), (6912, 2560), (2560, 960), (2560, 1152)):
            m = layer(bits, group_size, mode, in_dims=k, out_dims=n)
            x = mx.random.normal((1, tokens, k), key=mx.random.key(tokens)).astype(mx.bfloat16)
            r = (4 * mx.random.normal((1, tokens, n), key=mx.random.key(k))).astype(mx.bfloat16)
            plan = m.plan(tokens, added=True)
            assert plan.path == "cutlass" and plan.splits > 1, (k, n, plan)
            want = r + cutlass_qmm.matmul(m, x, plan.tile, plan.splits) / scale
            for norm in (layer_norm(n, seed=k), layer_norm(n, bias=False, seed=n)):
                assert cutlass_qmm.norms_in_sum(norm, n)
                compiled = mx.compile(lambda a, b: fusions.CUDA.add_norm(a, m, b, scale, norm))  # noqa: B023
                for got in (fusions.CUDA.add_norm(r, m, x, scale, norm), compiled(r, x), compiled(r, x)):
                    for g, w in zip(got, (want, norm(want)), strict=True):
                        assert g.shape == w.shape and g.dtype == mx.bfloat16
                        assert mx.array_equal(g, w).item(), (k, n, int(mx.sum(g != w).item()))


@pytest.mark.cutlass
@pytest.mark.parametrize("schedule,splits", [("persistent-128", 1), ("split-k", 8)])
def test_the_extension_copies_strided_and_broadcast_inputs(schedule, splits):
    """A transposed x, a strided slice of one and a broadcast or misaligned residual give what
    their contiguous copies give, bit for bit (the primitive copies them itself), and 1-D and 4-D
    x keep their shape."""
    m = layer(4, 64, "affine", in_dims=2048, out_dims=256)

    def run(x, **added):
        return cutlass_qmm.matmul(m, x, schedule, splits, **added)

    transposed = mx.random.normal((2048, 20), key=mx.random.key(6)).astype(mx.bfloat16).T[None]
    sliced = mx.random.normal((1, 40, 2048), key=mx.random.key(7)).astype(mx.bfloat16)[:, ::2]
    for x in (transposed, sliced):
        assert mx.array_equal(run(x), run(mx.contiguous(x))).item()
    four_d = mx.contiguous(transposed).reshape(2, 2, 5, 2048)
    assert run(four_d).shape == (2, 2, 5, 256) and run(transposed[0, 3]).shape == (256,)
    assert mx.array_equal(run(four_d).reshape(1, 20, 256), run(transposed)).item()
    if splits > 1:
        norm = layer_norm(256)
        broadcast = mx.broadcast_to(mx.random.normal((256,), key=mx.random.key(8)).astype(mx.bfloat16), (1, 20, 256))
        # row-contiguous, 2 bytes past a 16-byte boundary: the sum reads it a value at a time
        offset = mx.random.normal((20 * 256 + 1,), key=mx.random.key(9)).astype(mx.bfloat16)[1:].reshape(1, 20, 256)
        for r in (broadcast, offset):
            got = run(transposed, residual=r, scale=SCALE_6B, norm=norm)
            want = run(mx.contiguous(transposed), residual=mx.contiguous(r), scale=SCALE_6B, norm=norm)
            assert all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))


def assert_same_forwards(model, ids, target, reference):
    """``model`` gives the same logits and hidden states planned for ``target`` as for
    ``reference``: eager, compiled (the trace made, then reused) and compiled block by block."""
    outs = {}
    for side, planned in (("target", target), ("reference", reference)):
        with dispatch.use(planned):
            out = model(ids, output_hidden_states=True)
            runs = [(out.logits, *out.hidden_states)]
            for every in (None, 1):  # one graph, and evaluated block by block (compiled blocks)
                model.chunk_layers(every).compile()
                for _ in range(3):  # eager, traced, trace reused
                    out = model(ids)
                    runs.append((out.logits, out.last_hidden_state))
        outs[side] = runs
    for call, (got, want) in enumerate(zip(outs["target"], outs["reference"], strict=True)):
        for g, w in zip(got, want, strict=True):
            assert mx.array_equal(g, w).item(), call


@pytest.mark.cutlass
@pytest.mark.parametrize("mode", ["affine4", "mxfp4"])
def test_forward_with_the_residual_in_split_k_s_sum(mode, monkeypatch):
    """A quantized model whose o_proj and down_proj run split-K gives the same logits and hidden
    states with the residual added (and normalized) in the slabs' sum as with MLX's add and
    LayerNorm on the same products (a table where no residual goes into the sum): eager,
    compiled, and evaluated block by block."""
    from esmc_mlx.bench import mlx_model

    config = testing.tiny_config(hidden_size=2048, intermediate_size=2048, num_attention_heads=32, num_hidden_layers=3)
    weights = dict(tree_flatten(testing.random_mlx_model(config).parameters()))
    quant = (
        {"mode": "affine", "bits": 4, "group_size": 64}
        if mode == "affine4"
        else {"mode": "mxfp4", "bits": 4, "group_size": 32}
    )
    model = mlx_model(config, weights, fuse=True, quant=quant)
    assert model.ops is fusions.CUDA
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(1, 200)))
    in_sum = dispatch.current()
    ops_after = dataclasses.replace(
        in_sum, tuning=dataclasses.replace(in_sum.tuning, split_k_min_k_added=math.inf, add_norm_from=math.inf)
    )
    for product in (model.esmc.layers[0].self_attn.o_proj, model.esmc.layers[0].mlp.down_proj):
        with dispatch.use(in_sum):
            added = product.plan(200, added=True)
            assert added.path == "cutlass" and added.splits > 1
        with dispatch.use(ops_after):
            assert product.plan(200, added=True).splits == 1
            alone = product.plan(200)  # the same products
            assert (alone.path, alone.tile, alone.splits) == (added.path, added.tile, added.splits)
    assert cutlass_qmm.norms_in_sum(model.esmc.layers[0].post_attention_layernorm, 2048)
    assert cutlass_qmm.norms_in_sum(model.esmc.norm, 2048)  # no bias
    residuals = []
    matmul = cutlass_qmm.matmul
    monkeypatch.setattr(
        cutlass_qmm, "matmul", lambda *a, **kw: residuals.append(kw.get("residual") is not None) or matmul(*a, **kw)
    )
    for planned in (in_sum, ops_after):
        with dispatch.use(planned):
            model(ids, output_hidden_states=True)
    assert residuals.count(True) == 2 * config.num_hidden_layers  # o_proj's and down_proj's, eager, in_sum only
    assert_same_forwards(model, ids, in_sum, ops_after)


@pytest.mark.cutlass
@pytest.mark.parametrize("mode,bits,group_size", [("mxfp4", 4, 32), ("affine", 4, 64), ("affine", 8, 128)])
def test_extension_dequantizes_as_mx_dequantize(mode, bits, group_size):
    """Each weight the kernel multiplies is mx.dequantize's, bit for bit: x the identity makes
    y = w.T, every output one product and a sum of zeros (exact in the fp32 accumulators). For
    mxfp4 every byte of two codes in every place, under every e8m0 scale the scale pairs hold that
    keeps the weights normal (2-128; a subnormal weight is the tensor cores' to round, an inf or
    NaN would spread along its row through the zeros)."""
    m = layer(bits, group_size, mode, in_dims=512, out_dims=256)
    if mode == "mxfp4":
        codes = (np.arange(256)[:, None] + np.arange(256)[None, :]) % 256  # row r: bytes r, r + 1, ...
        m.weight = mx.array(codes.astype(np.uint8).view(np.uint32))
        top = cutlass_qmm.MXFP4_MAX_EXPONENT
        m.scales = (2 + mx.arange(256 * 16, dtype=mx.uint32) % (top - 1)).reshape(256, 16).astype(mx.uint8)
    w = mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=group_size, bits=bits, mode=mode)
    with dispatch.use(forced_cutlass()):
        assert m.plan(512).path == "cutlass"
        got = m(mx.eye(512, dtype=mx.bfloat16))
    assert np.array_equal(as_f32(got.T), as_f32(w.astype(mx.bfloat16)))


ADDED = {"splits": 2, "residual": mx.zeros((8, 64), mx.bfloat16)}  # a residual the sum adds


@pytest.mark.cutlass
@pytest.mark.parametrize(
    "arguments,says",
    [
        ({"tile_tokens": 64}, "tile_tokens must be 128, 192 or 256"),
        ({"tile_tokens": 192, "stream_k": True}, "stream-K runs 256-token tiles only"),
        ({"group_size": 32}, "group_size must be 64 or 128"),
        ({"bits": 2}, "bits must be 4 or 8"),
        ({"splits": 0}, "splits must be at least 1"),
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
