"""runtime/cuda: this project's CUDA kernels, bit for bit against the MLX ops they replace.

CUDA cannot run on the CI host, so the dequantize kernel's arithmetic is proven on the CPU
through ``emulate``, a numpy copy of what one kernel thread computes (same unpacking, same scale
decoding, same roundings). MLX's CPU and CUDA dequantize differ in one place: affine
``q * scale + bias`` is one fused multiply-add on CUDA (one rounding in the scales' dtype) and
two ops on the CPU (a rounding after each, through fp32). ``emulate(..., fused=False)`` is the
CPU's arithmetic and must equal the CPU's mx.dequantize everywhere; ``fused=True`` is the
kernel's and must equal the CPU wherever the two roundings give the one-rounding result. The
kernels' sources compile here with nvcc; on a CUDA GPU (``@pytest.mark.gpu``) each kernel is
compared with the MLX ops it replaces.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from esmc_mlx import bench, testing
from esmc_mlx.runtime import dispatch
from esmc_mlx.runtime import quantized as rq
from esmc_mlx.runtime.cuda import dequantize, fusions, kernel_cache, qmm, rows, source
from esmc_mlx.runtime.model import PLAIN, Attention

FLOATS = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
AFFINE = [(b, g) for b in dequantize.AFFINE_BITS for g in dequantize.AFFINE_GROUPS]
FP = list(dequantize.FP_MODES)
BLOCKS = 132 * 32  # the dequantize kernel's grid cap on the H200 (dispatch.HOPPER)


def gpu_target(**tuning) -> dispatch.Target:
    """The default device's target, with some fields of its table replaced."""
    target = dispatch.current()
    return dataclasses.replace(target, tuning=dataclasses.replace(target.tuning, **tuning)) if tuning else target


# ---- numpy emulation of the dequantize kernel -----------------------------------------------


def round_to(x: np.ndarray, dtype) -> np.ndarray:
    """fp32 values rounded (nearest even) to ``dtype``, returned as fp32."""
    x = np.asarray(x, np.float32)
    if dtype == mx.float32:
        return x
    if dtype == mx.float16:
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def fma_round(p: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """p + b (p = q * scale, exact in fp64) rounded once to ``dtype``: the fused multiply-add.
    Exact: the fp64 sum is made round-to-odd with its TwoSum error, which then rounds
    correctly to any format of 24 bits or fewer (via fp32, also rounded to odd)."""
    t = p + b
    bb = t - p
    err = (p - (t - bb)) + (b - bb)
    even = (t.view(np.int64) & 1) == 0
    t = np.where((err != 0) & even, np.nextafter(t, np.where(err > 0, np.inf, -np.inf)), t)
    if dtype == mx.float32:
        return t.astype(np.float32)
    f = t.astype(np.float32)
    f = np.where(np.abs(f) > np.abs(t), np.nextafter(f, np.float32(0)), f).astype(np.float32)
    f = np.where(f != t, (f.view(np.uint32) | 1).view(np.float32), f)
    return round_to(f, dtype)


def unpack(w: np.ndarray, bits: int) -> np.ndarray:
    """Values of a little-endian bit stream of ``bits``-bit fields (how MLX packs, 3/5/6 bits
    straddling words included)."""
    stream = np.unpackbits(np.ascontiguousarray(w).view(np.uint8), bitorder="little")
    fields = stream.reshape(-1, bits).astype(np.uint32)
    return (fields << np.arange(bits, dtype=np.uint32)).sum(axis=1).astype(np.uint32)


def e4m3(b: np.ndarray) -> np.ndarray:
    e, m = (b >> 3) & 15, (b & 7).astype(np.float32)
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * np.exp2(e.astype(np.float32) - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


def e2m1(b: np.ndarray) -> np.ndarray:
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    return lut[b & 15]


def e8m0(e: np.ndarray) -> np.ndarray:
    return np.where(e == 255, np.nan, np.exp2(e.astype(np.float64) - 127)).astype(np.float32)


def emulate(w, scales, biases, group_size, bits, mode, dtype, fused=True) -> np.ndarray:
    """What the kernel writes, as fp32 values of ``dtype`` (flat)."""
    q = unpack(np.array(w), bits)
    g = np.arange(q.size) // group_size
    if mode == "affine":
        t = scales.dtype
        s = np.array(scales.astype(mx.float32)).reshape(-1)[g]
        b = np.array(biases.astype(mx.float32)).reshape(-1)[g]
        if fused:
            r = fma_round(q.astype(np.float64) * s.astype(np.float64), b.astype(np.float64), t)
        else:
            r = round_to(round_to(q.astype(np.float32) * s, t) + b, t)
        return round_to(r, dtype)
    sc = np.array(scales).reshape(-1)[g]
    scale = e8m0(sc) if mode != "nvfp4" else e4m3(sc) * np.float32(1)
    vals = e4m3(q) if bits == 8 else e2m1(q)
    return round_to(scale * vals, dtype)


def as_bits(x: mx.array) -> np.ndarray:
    """Bit patterns of an mx float array, widened to fp32 (exact) so all dtypes compare."""
    return np.array(x.astype(mx.float32)).reshape(-1).view(np.uint32)


def weights(rows: int, cols: int, dtype, scale: float = 1.0, seed: int = 0) -> mx.array:
    """Random weights with the edge cases: an all-zero row, a constant row, a negative-only
    row, one row 1e3x larger and one 1e-3x smaller."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * scale
    x[0] = 0
    x[1] = 0.25
    x[2] = -np.abs(x[2])
    x[3] *= 1e3
    x[4] *= 1e-3
    return mx.array(x).astype(dtype)


def quantized(mode, bits, group_size, wdtype, rows=8, cols=512, scale=1.0):
    w = weights(rows, cols, wdtype, scale)
    parts = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    mx.eval(parts)
    return parts[0], parts[1], parts[2] if mode == "affine" else None


# ---- CPU: the emulation against MLX's CPU ---------------------------------------------


@pytest.mark.parametrize("sdt", FLOATS)
@pytest.mark.parametrize(("bits", "group_size"), AFFINE)
def test_affine_emulation_matches_cpu(bits, group_size, sdt):
    with mx.stream(mx.cpu):
        w, s, b = quantized("affine", bits, group_size, FLOATS[sdt])
        total = same = 0
        for odt in FLOATS.values():
            ref = as_bits(mx.dequantize(w, s, b, group_size=group_size, bits=bits, dtype=odt))
            cpu = round_to(emulate(w, s, b, group_size, bits, "affine", odt, fused=False), odt)
            np.testing.assert_array_equal(cpu.view(np.uint32), ref)
            fused = emulate(w, s, b, group_size, bits, "affine", odt, fused=True).view(np.uint32)
            agree = cpu.view(np.uint32) == fused
            # Where one rounding and two agree, the kernel's arithmetic is the CPU's result.
            np.testing.assert_array_equal(fused[agree], ref[agree])
            total, same = total + agree.size, same + agree.sum()
        # They differ by one rounding in a share of elements (~12% with bf16 scales).
        assert same / total > 0.5


def test_fused_differs_from_two_roundings_where_expected():
    """1 * 1.00390625 + 2^-8 in bf16: two roundings give 1.0 + 2^-8 -> 1.0 (tie to even);
    the fused sum 1.0078125 is exactly representable, so the kernel gives 1.0078125."""
    p, b = np.array([1.00390625]), np.array([2.0**-8])
    assert round_to(round_to(np.float32(p), mx.bfloat16) + np.float32(b), mx.bfloat16)[0] == 1.0
    assert fma_round(p, b, mx.bfloat16)[0] == 1.0078125
    # 3 * 1.0234375 = 3.0703125 is a bf16 tie (to even: 3.0625); + 2^-30 lifts it above the
    # tie, so the one rounding goes up. A rounding through fp32 first would lose the 2^-30.
    assert fma_round(np.array([3 * 1.0234375]), np.array([2.0**-30]), mx.bfloat16)[0] == 3.078125
    assert fma_round(np.array([3 * 1.0234375]), np.array([0.0]), mx.bfloat16)[0] == 3.0625


def test_fma_round_is_the_exact_rounding():
    """fma_round against the exact rational sum, nearest representable by brute force."""
    from fractions import Fraction

    rng = np.random.default_rng(1)
    q = rng.integers(0, 256, 400).astype(np.float64)
    s = round_to(rng.standard_normal(400).astype(np.float32) * 1e-2, mx.bfloat16).astype(np.float64)
    b = round_to(rng.standard_normal(400).astype(np.float32) * 10 ** rng.uniform(-6, 2, 400), mx.bfloat16)
    got = fma_round(q * s, b.astype(np.float64), mx.bfloat16)
    for qi, si, bi, gi in zip(q, s, b, got):
        exact = Fraction(qi) * Fraction(si) + Fraction(float(bi))
        c = float(gi)
        u = 2.0 ** (np.floor(np.log2(abs(c))) - 7) if c else 2.0**-133  # one bf16 ulp above |c|
        # No bf16 value (c +/- ulp, and c - ulp/2 below a power of two) is nearer the exact sum.
        for n in (c - u, c + u, c - u / 2, c + u / 2):
            if n in (c - u / 2, c + u / 2) and round_to(np.array([n], np.float32), mx.bfloat16)[0] != np.float32(n):
                continue
            assert abs(Fraction(c) - exact) <= abs(Fraction(n) - exact)


@pytest.mark.parametrize("mode", FP)
def test_fp_emulation_matches_cpu(mode):
    bits, group_size = dequantize.FP_MODES[mode]
    with mx.stream(mx.cpu):
        w, s, _ = quantized(mode, bits, group_size, mx.float32)
        for odt in FLOATS.values():
            # fp16 out: MLX's CPU makes 2^(e-127) in fp16, inf/0 outside 2^-24..2^15, where
            # CUDA scales in fp32; the weights here keep every scale inside that range.
            ref = as_bits(mx.dequantize(w, s, group_size=group_size, bits=bits, mode=mode, dtype=odt))
            got = emulate(w, s, None, group_size, bits, mode, odt).view(np.uint32)
            np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    ("mode", "bits", "group_size"), [("affine", 4, 64), ("affine", 3, 32), ("mxfp4", 4, 32), ("nvfp4", 4, 16)]
)
def test_a_layer_dequantizes_with_mx_dequantize_where_no_kernel_runs(mode, bits, group_size, on_cpu):
    """On the CPU no plan names this project's dequantize: a layer's weight is mx.dequantize's."""
    layer = rq.QuantizedLinear(512, 8, bias=False, group_size=group_size, bits=bits, mode=mode)
    plan = layer.plan(64, mx.float32)
    assert plan.path == "dequantize" and plan.kernels[0] == dispatch.Launch("mx.dequantize", None)
    got = rq.dequantized_weight(layer, mx.float16, plan.kernels[0])
    ref = mx.dequantize(
        layer.weight, layer.scales, layer.get("biases"), group_size=group_size, bits=bits, mode=mode, dtype=mx.float16
    )
    assert got.dtype == mx.float16 and got.shape == ref.shape
    np.testing.assert_array_equal(as_bits(got), as_bits(ref))


# ---- GPU: the dequantize kernel itself --------------------------------------------------------

GPU_CASES = [("affine", b, g, sdt) for b, g in AFFINE for sdt in FLOATS] + [
    (m, *dequantize.FP_MODES[m], "float32") for m in FP
]


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "bits", "group_size", "sdt"), GPU_CASES)
def test_kernel_bit_exact_on_cuda(mode, bits, group_size, sdt):
    # 6B-like width; one row sliced off the front makes the words start 4- or 8-byte aligned
    # only (for 2, 3, 5, 6 bits at group 32), the kernel's scalar-load paths.
    w, s, b = quantized(mode, bits, group_size, FLOATS[sdt], rows=40, cols=2560 + group_size)
    views = [(w, s, b), (w[1:], s[1:], None if b is None else b[1:])]
    for ww, ss, bb in views:
        for odt in FLOATS.values():
            assert dequantize.supported(ww, ss, bb, group_size, bits, mode, odt)
            ref = mx.dequantize(ww, ss, bb, group_size=group_size, bits=bits, mode=mode, dtype=odt)
            got = dequantize.dequantize(ww, ss, bb, group_size, bits, mode, odt, BLOCKS)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_array_equal(
                as_bits(got), as_bits(ref), err_msg=f"{mode} {bits} {group_size} {sdt}->{odt}"
            )
            # The emulation is the kernel's arithmetic (proves the CPU tests above cover CUDA).
            emu = emulate(ww, ss, bb, group_size, bits, mode, odt).view(np.uint32)
            np.testing.assert_array_equal(
                emu, as_bits(got), err_msg="kernel == mx.dequantize but not the fused emulation"
            )


def every_code_and_scale(mode: str, sdt) -> tuple:
    """Packed weights holding every 4-bit code in every group, one row per scale: mxfp4 rows
    have every e8m0 exponent 0..255 (subnormal 2^-127 and NaN included), affine rows scales and
    biases from a spread of signs and magnitudes (zero, tiny, huge)."""
    codes = np.tile(np.concatenate([np.arange(16), np.arange(16)[::-1]]), 2).astype(np.uint32)  # 64 values
    words = (codes.reshape(-1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(axis=1).astype(np.uint32)
    if mode == "mxfp4":
        w = np.tile(words, (256, 1))
        scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 2, axis=1)  # groups of 32
        return mx.array(w), mx.array(scales), None
    rng = np.random.default_rng(0)
    mags = np.concatenate([[0.0, 1e-8, 1e-3, 1.0, 7.5, 300.0, 6e4], rng.lognormal(0, 3, 57)])
    s = (mags * rng.choice([-1, 1], mags.size)).astype(np.float32)[:, None]  # one group of 64 a row
    b = rng.permutation(s[:, 0])[:, None] * 3
    return mx.array(np.tile(words[:8], (s.shape[0], 1))), mx.array(s).astype(sdt), mx.array(b).astype(sdt)


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "sdt"), [("mxfp4", None), ("affine", mx.bfloat16), ("affine", mx.float16)])
def test_kernel_bit_exact_for_every_code_and_scale_on_cuda(mode, sdt):
    """mxfp4 into bf16 (the two-at-a-time body) and 4-bit affine give mx.dequantize's bits for
    every code, every e8m0 scale (scale and bias spreads for affine); NaN scales give NaN."""
    w, s, b = every_code_and_scale(mode, sdt)
    gs, odt = (32, mx.bfloat16) if mode == "mxfp4" else (64, sdt)
    assert dequantize._body(mode, odt) == ("fp_pairs" if mode == "mxfp4" else "affine")
    ref = as_bits(mx.dequantize(w, s, b, group_size=gs, bits=4, mode=mode, dtype=odt))
    got = as_bits(dequantize.dequantize(w, s, b, gs, 4, mode, odt, BLOCKS))
    nan = np.isnan(ref.view(np.float32))
    np.testing.assert_array_equal(np.isnan(got.view(np.float32)), nan)
    np.testing.assert_array_equal(got[~nan], ref[~nan])


@pytest.mark.gpu
def test_a_layer_takes_the_kernel_from_the_tables_width_on_cuda(monkeypatch):
    """A layer planned to dequantize runs this project's kernel for weights whose smaller
    dimension is the table's dequantize_from_width or more (the 600M's and the 6B's),
    mx.dequantize for narrower ones (the 300M's); the same values either way."""
    built, real = [], dequantize._kernel
    monkeypatch.setattr(dequantize, "_kernel", lambda *key: built.append(key) or real(*key))
    target = dataclasses.replace(dispatch.current(), force="dequantize")
    for out_dims, in_dims, ours in ((2880, 960, False), (960, 2560, False), (1024, 1024, True), (6144, 1152, True)):
        layer = rq.QuantizedLinear(in_dims, out_dims, bias=False, group_size=64, bits=4)
        with dispatch.use(target):
            launch = layer.plan(64, mx.bfloat16).kernels[0]
        assert (launch.requires is not None) == ours, (out_dims, in_dims)
        with dispatch.use(target):
            got = rq.dequantized_weight(layer, mx.bfloat16, launch)
        ref = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=64, bits=4, dtype=mx.bfloat16)
        np.testing.assert_array_equal(as_bits(got), as_bits(ref))
        assert bool(built) == ours, (out_dims, in_dims)
        built.clear()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mode", "bits", "group_size", "sdt"),
    [("affine", b, 64, "bfloat16") for b in dequantize.AFFINE_BITS]
    + [("affine", 4, 32, "float32"), ("affine", 8, 128, "float16")]
    + [c for c in GPU_CASES if c[0] != "affine"],
)
def test_dequantize_together_bit_exact_on_cuda(mode, bits, group_size, sdt):
    """Weights of a block's shapes (q/k/v, o, gate/up, down; one sliced off a row: scalar
    loads; one of three dimensions) dequantized by one launch give mx.dequantize's bits, each;
    None where the scales' dtypes differ. The same kernel for one weight (dequantize) takes
    the three-dimensional one too."""
    shapes = [(3 * 96, 256 + group_size), (96, 256 + group_size), (2 * 160, 256 + group_size), (96, 512)]
    parts = [quantized(mode, bits, group_size, FLOATS[sdt], rows=r, cols=c) for r, c in shapes]
    w, sc, b = parts[1]
    parts[1] = (w[1:], sc[1:], None if b is None else b[1:])
    parts.append(tuple(None if a is None else a.reshape(2, 48, -1) for a in parts[3]))  # the kernel reads the rank
    w, sc, b = parts[-1]
    one = dequantize.dequantize(w, sc, b, group_size, bits, mode, mx.bfloat16, BLOCKS)
    ref = mx.dequantize(w, sc, b, group_size=group_size, bits=bits, mode=mode, dtype=mx.bfloat16)
    assert one.shape == (2, 48, 512)
    np.testing.assert_array_equal(as_bits(one), as_bits(ref))
    for odt in FLOATS.values():
        got = dequantize.dequantize_together(parts, group_size, bits, mode, odt, BLOCKS)
        refs = [mx.dequantize(w, sc, b, group_size=group_size, bits=bits, mode=mode, dtype=odt) for w, sc, b in parts]
        assert got.dtype == odt and got.shape == (sum(r.size for r in refs),)
        ref = mx.concatenate([r.reshape(-1) for r in refs])
        np.testing.assert_array_equal(as_bits(got), as_bits(ref), err_msg=f"{mode} {bits} {group_size} -> {odt}")
        views = fusions.transposed_views(got, [r.shape for r in refs])  # what the layers multiply by
        assert all(mx.array_equal(v, r.T).item() for v, r in zip(views, refs, strict=True))
    if mode == "affine":
        w, sc, b = parts[0]
        other = mx.float32 if sc.dtype != mx.float32 else mx.float16
        mixed = [(w, sc.astype(other), b.astype(other)), parts[1]]  # scales of two dtypes
        assert dequantize.dequantize_together(mixed, group_size, bits, mode, mx.bfloat16, BLOCKS) is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["affine4", "mxfp4", "affine8"])
def test_forward_with_and_without_dequantize_together_on_cuda(name, monkeypatch):
    """A quantized model taking dequantize + matmul gives the same logits, bit for bit, with its
    blocks' four weights dequantized in one launch (one call a block) or one by one."""
    config = testing.tiny_config(hidden_size=256, num_attention_heads=4, num_hidden_layers=3)
    weights = dict(tree_flatten(testing.random_mlx_model(config, mx.bfloat16).parameters()))
    model = bench.mlx_model(config, weights, fuse=True, compile=True, quant=bench.QUANT_MODES[name])
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(2, 96)))
    calls, real = [], dequantize.dequantize_together
    monkeypatch.setattr(
        dequantize, "dequantize_together", lambda parts, *a: calls.append(len(parts)) or real(parts, *a)
    )
    logits = {}
    for together in (2, 5):  # 5: more than a block has, never together
        target = dataclasses.replace(gpu_target(together_min_weights=together), force="dequantize", cutlass=False)
        with dispatch.use(target):
            logits[together] = model(ids).logits
            mx.eval(logits[together])
    assert calls == [4] * config.num_hidden_layers  # the first side's blocks, one call each
    assert mx.array_equal(logits[2], logits[5]).item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "k,n,group_size", [(64, 192, 64), (64, 64, 64), (128, 192, 128), (128, 192, 64), (256, 64, 64)]
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_narrow_quantized_linears_match_dequantize_on_cuda(k, n, group_size, dtype):
    """QuantizedLinear gives one output for one input, within rounding of dequantize + matmul's,
    at widths on both sides of one group. Where k <= group_size MLX's own quantized_matmul gave
    outputs that changed from call to call on the H200, or never returned: the plans keep such
    weights off it."""
    layer = rq.QuantizedLinear(k, n, bias=False, group_size=group_size, bits=4)
    packed = (layer.weight, layer.scales, layer.biases)
    for count in (1, 3, 16):
        x = mx.random.normal((1, count, k), key=mx.random.key(count)).astype(dtype)
        once = layer(x)
        mx.eval(once)
        assert mx.array_equal(layer(x), once).item()
        ref = x.astype(mx.float32) @ mx.dequantize(*packed, group_size=group_size, bits=4).T
        tolerance = 1e-4 if dtype == mx.float32 else 3e-2  # bf16 x and outputs
        np.testing.assert_allclose(np.array(once.astype(mx.float32)), np.array(ref), rtol=tolerance, atol=tolerance)


# ---- qkv_heads: QK LayerNorm + RoPE + head layout in one kernel ------------------------------

QKV_CASES = [(2, 17), (1, 300)]
EPS, THETA = 1e-5, 10000.0


def qkv_inputs(B, L, heads, dtype, seed=0):
    """A fused projection output with a per-row offset and scale (LayerNorm has work to do)
    and norm weights around 1, as trained ESMC's."""
    rng = np.random.default_rng(seed)
    d = heads * 64
    x = rng.standard_normal((B, L, 3 * d)).astype(np.float32) * rng.uniform(0.5, 4, (B, L, 1))
    x += rng.standard_normal((B, L, 1)).astype(np.float32)
    wq = 1 + 0.3 * rng.standard_normal(d).astype(np.float32)
    wk = 1 + 0.3 * rng.standard_normal(d).astype(np.float32)
    return mx.array(x).astype(dtype), mx.array(wq).astype(dtype), mx.array(wk).astype(dtype)


def ulps(a: mx.array, b: mx.array) -> np.ndarray:
    """|a - b| in units in the last place of a's dtype, elementwise (same-sign values)."""
    width = {mx.bfloat16: np.int16, mx.float16: np.int16, mx.float32: np.int32}[a.dtype]
    ia = np.array(a.view(mx.int16 if width is np.int16 else mx.int32)).astype(np.int64)
    ib = np.array(b.view(mx.int16 if width is np.int16 else mx.int32)).astype(np.int64)
    sign = np.int64(1) << (8 * np.dtype(width).itemsize - 1)
    ia = np.where(ia < 0, -(ia + sign), ia)  # sign-magnitude to a monotone integer line
    ib = np.where(ib < 0, -(ib + sign), ib)
    return np.abs(ia - ib)


def qkv_reference(qkv, wq, wk, eps, theta, heads):
    """What the model computes without the kernel: split, LayerNorm without bias over the whole
    width, (B, H, L, Dh) heads, RoPE."""
    B, L, _ = qkv.shape
    q, k, v = mx.split(qkv, 3, axis=-1)

    def split(x):
        return x.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)

    def rope(x):
        return mx.fast.rope(x, x.shape[-1], traditional=False, base=theta, scale=1.0, offset=0)

    return (
        rope(split(mx.fast.layer_norm(q, wq, None, eps))),
        rope(split(mx.fast.layer_norm(k, wk, None, eps))),
        split(v),
    )


def test_rope_log2_base_is_fp32_log2():
    assert rows.rope_log2_base(THETA) == float(np.log2(np.float32(THETA)))
    assert rows.rope_log2_base(THETA) == float(np.float32(13.287712379549449))


def test_cuda_steps_are_the_plain_ops_where_no_kernel_is_planned(on_cpu):
    """The fused steps a CUDA GPU's model runs give MLX's plain ops where their plans name no
    kernel (here: the CPU), so a model moved off the GPU computes the same function."""
    cfg = testing.tiny_config(hidden_size=128, num_attention_heads=2)
    attn = Attention(cfg)
    _, wq, wk = qkv_inputs(2, 17, 2, mx.float32)
    attn.q_norm.weight, attn.k_norm.weight = wq, wk
    attn["qkv_proj"] = attn.q_proj  # the fused layout's name, any linear
    attn.qkv_proj.weight = mx.random.normal((3 * 128, 128), key=mx.random.key(0))
    x = mx.random.normal((2, 17, 128), key=mx.random.key(1))
    for got, ref in zip(fusions.CUDA.heads(attn, x), PLAIN.heads(attn, x), strict=True):
        assert mx.array_equal(got, ref).item()
    x, h, w, b = norm_inputs(6, 256, mx.float32)
    norm = nn.LayerNorm(256)
    norm.weight, norm.bias = w, b
    linear = lambda a: a  # noqa: E731
    for got, ref in zip(
        fusions.CUDA.add_norm(x, linear, h, SCALE_6B, norm), PLAIN.add_norm(x, linear, h, SCALE_6B, norm), strict=True
    ):
        assert mx.array_equal(got, ref).item()


def _check_qkv(B, L, heads, dtype):
    qkv, wq, wk = qkv_inputs(B, L, heads, dtype, seed=B * L)
    assert rows.qkv_heads_supported(qkv, wq, wk, EPS, THETA, heads)
    assert not rows.qkv_heads_supported(qkv, wq, wk, EPS, 0.5, heads)  # log2 < 0
    got = rows.qkv_heads(qkv, wq, wk, EPS, THETA, heads)
    ref = qkv_reference(qkv, wq, wk, EPS, THETA, heads)
    out = []
    for name, g, r in zip("qkv", got, ref, strict=True):
        assert g.shape == r.shape == (B, heads, L, 64) and g.dtype == r.dtype
        u = ulps(g, r)
        out.append((name, int(u.max()), int((u > 0).sum()), u.size))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize(("B", "L"), QKV_CASES)
def test_qkv_heads_bit_exact_on_cuda(B, L, dtype):
    """6B width, every dtype: MLX's own roundings, no element differs."""
    stats = _check_qkv(B, L, 40, FLOATS[dtype])
    assert all(n == 0 for _, _, n, _ in stats), f"(name, max ulps, elements differing, size): {stats}"


@pytest.mark.gpu
@pytest.mark.parametrize(("B", "L"), QKV_CASES)
@pytest.mark.parametrize("dtype", list(FLOATS))
def test_qkv_heads_within_one_ulp_at_15_heads_on_cuda(B, L, dtype):
    """The 300M's odd head count (idle threads in the last warp): at most 1 ulp off."""
    for name, worst, _, _ in _check_qkv(B, L, 15, FLOATS[dtype]):
        assert worst <= 1, f"{name}: {worst} ulps"


@pytest.mark.gpu
def test_qkv_heads_compiled_sliced_and_2d_grid_on_cuda(monkeypatch):
    """Inside mx.compile, on an input whose rows start 2-byte aligned (scalar loads), and
    with the rows spread over a 2D grid of blocks (as past 2^31 threads) whose last row of
    blocks is partial."""
    qkv, wq, wk = qkv_inputs(1, 33, 40, mx.bfloat16)
    ref = qkv_reference(qkv, wq, wk, EPS, THETA, 40)
    fn = mx.compile(lambda a: rows.qkv_heads(a, wq, wk, EPS, THETA, 40))
    for g, r in zip(fn(qkv), ref, strict=True):
        assert int(ulps(g, r).max()) <= 1
    flat = mx.concatenate([mx.zeros((1,), mx.bfloat16), qkv.reshape(-1)])[1:].reshape(qkv.shape)
    for g, r in zip(rows.qkv_heads(flat, wq, wk, EPS, THETA, 40), ref, strict=True):
        assert int(ulps(g, r).max()) <= 1
    monkeypatch.setattr(rows, "GRID_X_THREADS", 640 * 7)  # 33 rows: 5 rows of 7 blocks
    for g, r in zip(rows.qkv_heads(qkv, wq, wk, EPS, THETA, 40), ref, strict=True):
        assert int(ulps(g, r).max()) <= 1


@pytest.mark.gpu
def test_forward_with_and_without_qkv_kernel_on_cuda():
    """A float model's logits with the q/k/v kernel and with MLX's ops (custom kernels off),
    eager, compiled and block by block, with and without padding: the same within bf16."""
    config = testing.tiny_config(hidden_size=256, num_attention_heads=4, num_hidden_layers=3)
    model = bench.mlx_model(config, dict(tree_flatten(testing.random_mlx_model(config).parameters())), fuse=True)
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(2, 40)))
    # and a padded batch: cuDNN's attention with a mask, on the kernel's strided heads
    padded = mx.array(np.arange(40)[None, :] < np.array([[40], [25]]))
    valid = np.array(padded)
    shipped = dispatch.current()
    assert dispatch.attention_heads(64, True, "bfloat16", shipped).path == "qkv_heads"
    for mask in (None, padded):
        with dispatch.use(dataclasses.replace(shipped, kernels=False)):
            model.chunk_layers(None)
            ref = model(ids, attention_mask=mask).logits.astype(mx.float32)
        for every in (None, 1):  # one graph, and evaluated block by block (compiled blocks)
            model.chunk_layers(every).compile()
            for _ in range(3):  # eager, then traced, then the trace reused
                out = model(ids, attention_mask=mask).logits.astype(mx.float32)
                diff = np.abs(np.array(out - ref))[valid]
                err = float(diff.max() / np.abs(np.array(ref))[valid].max())
                assert err <= 2e-2, err


# ---- add_layer_norm: the residual add and the LayerNorm after it -----------------------------

SCALE_6B = (80 / 36) ** 0.5  # ESMC's residual scale: sqrt(layers / 36)


def norm_inputs(rows, d, dtype, bias=True, seed=0):
    """A residual stream with a per-row offset and spread, a block output, norm weights around 1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)).astype(np.float32) * rng.uniform(0.5, 4, (rows, 1))
    x += rng.standard_normal((rows, 1)).astype(np.float32)
    h = rng.standard_normal((rows, d)).astype(np.float32)
    w = 1 + 0.3 * rng.standard_normal(d).astype(np.float32)
    b = 0.1 * rng.standard_normal(d).astype(np.float32) if bias else None
    cast = lambda a: None if a is None else mx.array(a).astype(dtype)  # noqa: E731
    return cast(x), cast(h), cast(w), cast(b)


def add_norm_reference(x, h, scale, w, b, eps):
    residual = x + h / scale
    return residual, mx.fast.layer_norm(residual, w, b, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("d", [2560, 960, 1152])  # the 6B's, 300M's and 600M's widths
@pytest.mark.parametrize("bias", [True, False])
def test_add_layer_norm_bit_exact_on_cuda(d, dtype, bias):
    """Both outputs equal MLX's ops bit for bit, eager and inside mx.compile."""
    x, h, w, b = norm_inputs(67, d, FLOATS[dtype], bias, seed=d)
    assert rows.add_layer_norm_supported(x, h, w, b, EPS)
    ref = add_norm_reference(x, h, SCALE_6B, w, b, EPS)
    compiled_ref = mx.compile(lambda a, c: add_norm_reference(a, c, SCALE_6B, w, b, EPS))(x, h)
    compiled = mx.compile(lambda a, c: rows.add_layer_norm(a, c, SCALE_6B, w, b, EPS))(x, h)
    for name, got in (("eager", rows.add_layer_norm(x, h, SCALE_6B, w, b, EPS)), ("compiled", compiled)):
        for part, g, r, cr in zip(("residual", "normed"), got, ref, compiled_ref, strict=True):
            assert g.shape == r.shape and g.dtype == r.dtype
            u, cu = ulps(g, r), ulps(g, cr)
            assert u.max() == 0 and cu.max() == 0, (name, part, int(u.max()), int((u > 0).sum()), int(cu.max()))


@pytest.mark.gpu
def test_add_layer_norm_misaligned_3d_and_2d_grid_on_cuda(monkeypatch):
    """(B, L, d) input, rows starting 2-byte aligned (element loads), and the rows spread over
    a 2D grid of blocks whose last row of blocks is partial."""
    x, h, w, b = norm_inputs(2 * 33, 2560, mx.bfloat16, seed=3)
    x, h = x.reshape(2, 33, 2560), h.reshape(2, 33, 2560)
    ref = add_norm_reference(x, h, SCALE_6B, w, b, EPS)
    flat = mx.concatenate([mx.zeros((1,), mx.bfloat16), x.reshape(-1)])[1:].reshape(x.shape)
    for g, r in zip(rows.add_layer_norm(flat, h, SCALE_6B, w, b, EPS), ref, strict=True):
        assert g.shape == r.shape and int(ulps(g, r).max()) == 0
    monkeypatch.setattr(rows, "GRID_X_THREADS", 320 * 7)  # 66 rows: 10 rows of 7 blocks
    for g, r in zip(rows.add_layer_norm(x, h, SCALE_6B, w, b, EPS), ref, strict=True):
        assert int(ulps(g, r).max()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forward_with_and_without_norm_kernel_on_cuda(dtype):
    """The whole model gives the same logits and hidden states with the fused residual
    add + LayerNorm (at every size) as with MLX's ops: eager, compiled, block by block."""
    config = testing.tiny_config(hidden_size=256, num_attention_heads=4, num_hidden_layers=3)
    weights = dict(tree_flatten(testing.random_mlx_model(config, FLOATS[dtype]).parameters()))
    model = bench.mlx_model(config, weights, fuse=True)
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(2, 40)))
    on, off = gpu_target(add_norm_from=0), gpu_target(add_norm_from=math.inf)
    assert dispatch.residual_norm(2 * 40 * 256, dtype, on).path == "add_layer_norm"
    assert_same_forwards_under(model, ids, on, off)


def assert_same_forwards_under(model, ids, on: dispatch.Target, off: dispatch.Target):
    """``model`` gives the same logits and hidden states planned for ``on`` as for ``off``:
    eager, compiled, and evaluated block by block."""
    with dispatch.use(off):
        ref = model(ids, output_hidden_states=True)
    with dispatch.use(on):
        out = model(ids, output_hidden_states=True)
    for g, r in zip((out.logits, *out.hidden_states), (ref.logits, *ref.hidden_states), strict=True):
        assert mx.array_equal(g, r).item()
    for every in (None, 1):  # one graph, and evaluated block by block (compiled blocks)
        runs = {}
        for name, target in (("on", on), ("off", off)):
            model.chunk_layers(every).compile()
            with dispatch.use(target):
                runs[name] = [model(ids).logits for _ in range(3)]  # eager, traced, trace reused
        for call, (got, want) in enumerate(zip(runs["on"], runs["off"], strict=True)):
            assert mx.array_equal(got, want).item(), (every, call)


# The source MLX generates for a kernel (mlx/backend/cuda/custom_kernel.cpp, build_kernel),
# with runtime/kernel_cache.py's stand-in for MLX's device header: what that module compiles.
def _mlx_source(name, header, body, params, template) -> str:
    src = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n' + header
    src += f"namespace mlx::core::cu {{\n\nnamespace cg = cooperative_groups;\n\n__global__ void {name}(\n"
    src += ",\n".join(f"    {p}" for p in params) + ") {\n"
    for key, value in template:
        src += f"  using {key} = {value};\n" if isinstance(value, str) else f"  constexpr int {key} = {value};\n"
    return src + "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n"


def _device_headers(root: Path) -> None:
    """MLX's device includes under ``root``: kernel_cache's stand-in and MAX_NDIM as MLX's
    config.h has it."""
    device = root / "mlx" / "backend" / "cuda" / "device"
    device.mkdir(parents=True)
    (device / "utils.cuh").write_text(kernel_cache.DEVICE_HEADER)
    (device / "config.h").write_text("#pragma once\n#define MAX_NDIM 10\n#define WARP_SIZE 32\n")


ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100")
SHAPE = "const __grid_constant__ Shape"


def qmm_unit(tile: str, variant: str, bits: int, group: int) -> tuple[str, str]:
    """(header, source) of one fused-kernel instantiation, wrapped as MLX wraps it."""
    affine = variant.startswith("affine")
    params = ["const __nv_bfloat16* x", f"{SHAPE} x_shape", "const uint32_t* w", f"{SHAPE} w_shape"]
    params += ["const __nv_bfloat16* scales", "const __nv_bfloat16* biases"] if affine else ["const uint8_t* scales"]
    params.append("__nv_bfloat16* y")
    bt = {"wg": qmm.WG_TOKENS, "2d": qmm.TILE_2D[0], "1d": 64}[tile]
    template = [("O", "__nv_bfloat16"), ("BITS", bits), ("GROUP", group), ("BT", bt), ("SPLIT", 1)]
    if tile == "2d":
        template += [("MI", qmm.TILE_2D[1]), ("WN", qmm.TILE_2D[2])]
    template.append(("T", "__nv_bfloat16") if affine else ("MX", 1))
    name = f"qmm_{tile}_{variant}_{bits}"
    return qmm._header(tile), _mlx_source(name, "", qmm._body(tile, variant), params, template)


def every_unit() -> list[tuple[str, str, str]]:
    """(required architecture, header, source) of each kernel family's instantiations."""
    units = []
    row_header = source.text(rows.ROW_HEADER)
    for T in ("__nv_bfloat16", "__half", "float"):
        params = [f"const {T}* qkv", f"{SHAPE} qkv_shape", f"const {T}* q_weight", f"const {T}* k_weight"]
        params += [f"{T}* q", f"{T}* k"]
        template = [("T", T), ("HEADS", 40), ("EPS_BITS", rows._f32_bits(EPS))]
        template.append(("LOG2_BASE_BITS", rows._f32_bits(rows.rope_log2_base(THETA))))
        body = source.bodies("rows.cu")["qkv_heads"]
        units.append(("qkv_heads", row_header, _mlx_source(f"qkv_{T.strip('_')}", "", body, params, template)))
        params = [f"const {T}* x", f"{SHAPE} x_shape"] + [f"const {T}* {n}" for n in ("h", "scale", "weight", "bias")]
        params += [f"{T}* residual", f"{T}* normed"]
        template = [("T", T), ("D", 2560), ("EPS_BITS", rows._f32_bits(EPS))]
        body = source.bodies("rows.cu")["add_layer_norm"]
        units.append(("add_layer_norm", row_header, _mlx_source(f"norm_{T.strip('_')}", "", body, params, template)))
    modes = [("affine", b) for b in dequantize.AFFINE_BITS] + [(m, dequantize.FP_MODES[m][0]) for m in FP]
    for mode, bits in modes:
        affine = mode == "affine"
        params = ["const uint32_t* w", f"{SHAPE} w_shape"]
        params += (
            ["const __nv_bfloat16* scales", "const __nv_bfloat16* biases"] if affine else ["const uint8_t* scales"]
        )
        for O, mdt in (("__nv_bfloat16", mx.bfloat16), ("__half", mx.float16), ("float", mx.float32)):
            entry = dequantize._body(mode, mdt)
            template = [("O", O), ("BITS", bits), ("GROUP", 64 if affine else dequantize.FP_MODES[mode][1])]
            template.append(("T", "__nv_bfloat16") if affine else ("MX", int(mode != "nvfp4")))
            for n in (1, 4):  # dequantize's one weight, dequantize_together's block of four
                one = [*params[:2], "const int w_ndim", *params[2:]]  # the kernel reads w_ndim
                parts = [
                    p.replace(" w", f" w{k}").replace("scales", f"scales{k}").replace("biases", f"biases{k}")
                    for k in range(n)
                    for p in one
                ]
                parts.append(f"{O}* values")
                name = f"dq{n}_{mode}{bits}_{O.strip('_')}_{entry}"
                text = dequantize._source(n, affine, entry)
                units.append(("dequantize", source.text("octets.cuh"), _mlx_source(name, "", text, parts, template)))
    for O in ("__nv_bfloat16", "__half"):
        params = ["const float* parts", f"{SHAPE} parts_shape", f"{O}* y"]
        body = source.bodies("qmm.cu")["split_sum"]
        units.append(
            (
                "split_sum",
                source.text("octets.cuh"),
                _mlx_source(f"split_sum_{O.strip('_')}", "", body, params, [("O", O)]),
            )
        )
    for tile in ("1d", "2d", "wg"):
        for variant, bits, group in (("affine_fast", 4, 64), ("fp_fast", 4, 32), ("affine", 8, 64), ("fp", 8, 32)):
            units.append((f"qmm_{tile}", *qmm_unit(tile, variant, bits, group)))
    return units


def compile_units(units, archs, folder: Path) -> subprocess.CompletedProcess:
    """nvcc over ``units`` (header, source), one file per header (nvcc's start-up dominates),
    for every architecture of ``archs`` at once."""
    by_header: dict[str, list[str]] = {}
    for header, text in units:
        head, rest = text.split("namespace mlx::core::cu {", 1)
        by_header.setdefault(head + header, []).append("namespace mlx::core::cu {" + rest)
    files = []
    for i, (head, bodies) in enumerate(by_header.items()):
        files.append(str(folder / f"k{i}.cu"))
        Path(files[-1]).write_text(head + "".join(bodies))
    (arch,) = archs
    command = [
        "nvcc",
        f"-gencode=arch=compute_{arch[3:]},code={arch}",
        "-I",
        str(folder),
        "-cubin",
        "-odir",
        str(folder),
        *files,
    ]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_for_the_architectures_the_plans_give_it(arch, tmp_path):
    """Every kernel of runtime/cuda, wrapped as MLX wraps it, compiles for each architecture
    whose devices may plan it (dispatch.REQUIRES: sm_80 and later for all but the warpgroup tile,
    sm_90a alone for that), against kernel_cache.DEVICE_HEADER (nvcc for NVRTC, here without a
    GPU); and the warpgroup tile does not compile for any other (what the plans keep it off)."""
    _device_headers(tmp_path)
    device = dispatch.Device.parse(f"cuda:{arch}")
    units = every_unit()
    runs = [(h, s) for family, h, s in units if device.runs(dispatch.REQUIRES[family])]
    assert runs and len({family for family, _, _ in units}) == 7
    done = compile_units(runs, [arch], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    if not device.runs(dispatch.REQUIRES["qmm_wg"]):
        wg = [(h, s) for family, h, s in units if family == "qmm_wg"][:1]
        refused = compile_units(wg, [arch], tmp_path)
        assert refused.returncode != 0 and "wgmma" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_warpgroup_tile_fits_its_resident_blocks(tmp_path):
    """The warpgroup tile, as MLX wraps it, for every weight it takes (4-bit pairs, 8-bit
    octets, affine and mx; split K), compiles for sm_90a with no spills, in the registers and
    shared memory that one block an SM (256 threads) needs: 65,536 registers and 227 KB,
    without ptxas serializing its MMAs (warning C7513)."""
    _device_headers(tmp_path)
    resident = dispatch.QMM_RESIDENT["wg"]
    files = []
    for variant, bits, group in (("affine_fast", 4, 64), ("fp_fast", 4, 32), ("affine", 8, 64), ("fp", 8, 32)):
        header, text = qmm_unit("wg", variant, bits, group)
        files.append(tmp_path / f"wg_{variant}_{bits}.cu")
        head, rest = text.split("namespace mlx::core::cu {", 1)
        files[-1].write_text(head + header + "namespace mlx::core::cu {" + rest)
    nvcc = ["nvcc", "-arch=sm_90a", "-I", str(tmp_path), "-cubin", "-Xptxas", "-v", "-odir", str(tmp_path)]
    run = subprocess.run([*nvcc, *map(str, files)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", run.stderr)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill", run.stderr)]
    assert len(registers) == len(files) and max(registers) <= 65536 // (resident * 256), registers
    static = max(int(n) for n in re.findall(r"(\d+) bytes smem", run.stderr))  # the copies' xbase
    shared = [qmm._shared_bytes(qmm.WG_TOKENS, qmm.BW, bits) + 1024 + static for bits in (4, 8)]
    assert all(resident * n <= 227 * 1024 for n in shared), shared
    assert "C7513" not in run.stderr, run.stderr[-3000:]
    assert spills and not any(spills), run.stderr[-3000:]


# ---- runtime/kernel_cache.py: our kernels in MLX's disk cache ---------------------------------

SOURCE = '\n#include "mlx/backend/cuda/device/utils.cuh"\nnamespace mlx::core::cu {\n__global__ void k() {}\n}\n'


def _printing(name: str, source: str):
    """A stand-in for a mx.fast.cuda_kernel call: prints as MLX's verbose=True does (on fd 1)."""

    def make(verbose):
        assert verbose
        os.write(1, f"Generated source code for `{name}`:\n```\n{source}\n```\n".encode())

    return make


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_std_hash_is_libstdcxx_std_hash(tmp_path):
    """MLX names a JIT module by std::hash of its source: kernel_cache.std_hash must give the
    same 64-bit value, for every length mod 8 and for a real kernel's source."""
    (tmp_path / "h.cpp").write_text(
        "#include <fstream>\n#include <functional>\n#include <iostream>\n#include <sstream>\n#include <string>\n"
        "int main(int argc, char** argv) { for (int i = 1; i < argc; ++i) { std::ifstream f(argv[i]);"
        " std::stringstream s; s << f.rdbuf(); std::cout << std::hex << std::hash<std::string>{}(s.str()) << '\\n'; } }\n"
    )
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(tmp_path / "h.cpp")], check=True)
    texts = [
        "",
        "a",
        "abcdefgh",
        "abcdefghi",
        "héllo\n" * 7,
        SOURCE,
        source.text(rows.ROW_HEADER) + source.bodies("rows.cu")["qkv_heads"],
    ]
    for i, t in enumerate(texts):
        (tmp_path / f"t{i}").write_bytes(t.encode())
    out = subprocess.run(
        [str(tmp_path / "h"), *(str(tmp_path / f"t{i}") for i in range(len(texts)))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [f"{kernel_cache.std_hash(t.encode()):x}" for t in texts]


def test_generated_source_is_read_from_what_mlx_prints(capfd):
    assert kernel_cache.generated_source(_printing("custom_kernel_x_bfloat16_t", SOURCE)) == (
        "custom_kernel_x_bfloat16_t",
        SOURCE,
    )
    assert kernel_cache.generated_source(lambda verbose: None) is None  # printed nothing: no seeding
    print("stdout still works")
    assert "stdout still works" in capfd.readouterr().out


def test_seed_writes_the_module_where_mlx_reads_it(monkeypatch, tmp_path):
    """<MLX_PTX_CACHE_DIR>/<name>_<hex std::hash>.ptx holds the cubin, .txt the kernel's name and
    its mangled name; a second process finds them; other sources get other files."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache.device, "arch", lambda: "sm_90a")
    compiled = []

    def fake_compile(source, kernel, arch):
        compiled.append((kernel, arch))
        return b"\x7fELF cubin", "_ZN3mlx4core2cu1kEv"

    monkeypatch.setattr(kernel_cache, "compile_cubin", fake_compile)
    assert kernel_cache.seed(_printing("custom_kernel_k", SOURCE)) == "seeded"
    module = f"custom_kernel_k_{kernel_cache.std_hash(SOURCE.encode()):x}"
    assert (tmp_path / f"{module}.ptx").read_bytes() == b"\x7fELF cubin"
    assert (tmp_path / f"{module}.txt").read_text() == "mlx::core::cu::custom_kernel_k\t_ZN3mlx4core2cu1kEv\n"
    assert compiled == [("mlx::core::cu::custom_kernel_k", "sm_90a")]
    assert kernel_cache.seed(_printing("custom_kernel_k", SOURCE)) == "cached"
    assert kernel_cache.seed(_printing("custom_kernel_k", SOURCE + " ")) == "seeded"
    assert len(compiled) == 2 and len(list(tmp_path.glob("*.ptx"))) == 2


def test_seed_leaves_mlx_to_compile_when_it_cannot(monkeypatch, tmp_path):
    """Nothing printed, a compile error, no stdout, no GPU, no cache directory: no file at all
    (MLX compiles the kernel itself, as it always did)."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache.device, "arch", lambda: "sm_90a")
    assert kernel_cache.seed(lambda verbose: None) == "MLX printed no source"

    def failing(source, kernel, arch):
        raise kernel_cache.CompileError("no NVRTC library found")

    monkeypatch.setattr(kernel_cache, "compile_cubin", failing)
    assert kernel_cache.seed(_printing("custom_kernel_k", SOURCE)) == "not compiled: no NVRTC library found"

    def no_fd(fd):
        raise OSError(9, "Bad file descriptor")

    with monkeypatch.context() as m:  # no stdout to borrow: the kernel call still goes ahead
        m.setattr(kernel_cache.os, "dup", no_fd)
        assert kernel_cache.seed(_printing("custom_kernel_k", SOURCE)).startswith("MLX's source not readable")
    monkeypatch.setattr(kernel_cache.device, "arch", lambda: None)
    assert kernel_cache.seed(_printing("custom_kernel_k", SOURCE)) == "no CUDA device"
    monkeypatch.setattr(kernel_cache.device, "arch", lambda: "sm_90a")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")  # ESMC_MLX_CACHE=off: esmc_mlx did not set it
    assert kernel_cache.seed(_printing("custom_kernel_k", SOURCE)) == "no cache directory"
    assert not list(tmp_path.iterdir())


def _kernel_args(name: str) -> dict:
    """mx.fast.cuda_kernel's arguments for two of runtime/cuda's kernels: the warpgroup tile for
    mxfp4 (the longest source) and the q/k/v row kernel (shape arguments used)."""
    if name == "wg":
        return dict(
            name="wg",
            input_names=["x", "w", "scales"],
            output_names=["y"],
            source=qmm._body("wg", "fp_fast"),
            header=qmm._header("wg"),
        )
    return dict(
        name="qkv",
        input_names=["qkv", "q_weight", "k_weight"],
        output_names=["q", "k"],
        source=source.bodies("rows.cu")["qkv_heads"],
        header=source.text(rows.ROW_HEADER),
    )


def test_by_include_hands_mlx_short_includes_of_the_same_text(monkeypatch, tmp_path):
    """Each kernel's header and body go to files named by their sha256 under
    <MLX_PTX_CACHE_DIR>/esmc-include, and MLX gets two #include lines (what it hashes on every
    call); the <input>_shape/_strides/_ndim names MLX looks for in the source stay visible; a
    file that holds anything else is rewritten; other code gets other files."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    for name in ("wg", "qkv"):
        args = _kernel_args(name)
        got = kernel_cache.by_include(args)
        assert len(got["header"]) + len(got["source"]) < 400 < len(args["header"]) + len(args["source"])
        header, body = (
            Path(re.fullmatch(r'#include "([^"]+)"\n(?:// .*\n)?', got[k]).group(1)) for k in ("header", "source")
        )
        assert header.parent == body.parent == tmp_path.resolve() / kernel_cache.INCLUDE_DIR
        assert header.read_text() == args["header"] and body.read_text() == args["source"]
        for n in args["input_names"]:
            for k in ("shape", "strides", "ndim"):
                assert (f"{n}_{k}" in got["source"]) == (f"{n}_{k}" in args["source"]), (name, n, k)
        assert kernel_cache.by_include(args) == got  # the same files, found again
        body.write_text(args["source"][:-1])  # spoilt: rewritten, same name
        assert kernel_cache.by_include(args) == got and body.read_text() == args["source"]
        changed = kernel_cache.by_include(args | {"source": args["source"] + "\n"})
        assert changed["source"] != got["source"] and changed["header"] == got["header"]
    assert "wg_shape" not in kernel_cache.by_include(_kernel_args("wg"))["source"]
    assert "x_shape" in kernel_cache.by_include(_kernel_args("wg"))["source"]


def test_by_include_keeps_the_text_when_it_cannot_write(monkeypatch, tmp_path):
    """No cache directory (ESMC_MLX_CACHE=off), one that cannot be made (a file in the way), one
    whose path an #include line cannot hold: the arguments as they were, and nothing written."""
    args = _kernel_args("qkv")
    (tmp_path / "file").write_text("mine")
    for directory in (tmp_path / "file", tmp_path / 'a"b', tmp_path / "a\nb"):
        monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(directory))
        assert kernel_cache.by_include(args) == args
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert kernel_cache.by_include(args) == args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "mine"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_included_kernels_compile_to_the_same_code(monkeypatch, tmp_path):
    """The warpgroup tile and the q/k/v kernel, wrapped as MLX wraps them, give the same PTX
    with their text inline and through by_include's #include lines, but for the translation
    unit's id in internal names."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "cache"))
    _device_headers(tmp_path)
    bf16 = "__nv_bfloat16"
    params = {
        "wg": [
            f"const {bf16}* x",
            f"{SHAPE} x_shape",
            "const uint32_t* w",
            f"{SHAPE} w_shape",
            "const uint8_t* scales",
            f"{bf16}* y",
        ],
        "qkv": [
            f"const {bf16}* qkv",
            f"{SHAPE} qkv_shape",
            f"const {bf16}* q_weight",
            f"const {bf16}* k_weight",
            f"{bf16}* q",
            f"{bf16}* k",
        ],
    }
    templates = {
        "wg": [("O", bf16), ("BITS", 4), ("GROUP", 32), ("BT", qmm.WG_TOKENS), ("SPLIT", 0), ("MX", 1)],
        "qkv": [
            ("T", bf16),
            ("HEADS", 40),
            ("EPS_BITS", rows._f32_bits(EPS)),
            ("LOG2_BASE_BITS", rows._f32_bits(rows.rope_log2_base(THETA))),
        ],
    }
    tu_id = re.compile(r"_(?:INTERNAL|GLOBAL__N_)_[0-9a-f]+_\d+_k_cu_[0-9a-f]+")
    for name in ("wg", "qkv"):
        ptx = []
        for form, args in (("inline", _kernel_args(name)), ("included", kernel_cache.by_include(_kernel_args(name)))):
            folder = tmp_path / form
            folder.mkdir(exist_ok=True)
            (folder / "k.cu").write_text(
                _mlx_source(name, args["header"], args["source"], params[name], templates[name])
            )
            cmd = [
                "nvcc",
                "-arch=sm_90a",
                "-I",
                str(tmp_path),
                "-ptx",
                "-o",
                str(folder / "k.ptx"),
                str(folder / "k.cu"),
            ]
            run = subprocess.run(cmd, capture_output=True, text=True)
            assert run.returncode == 0, run.stderr[-3000:]
            text = (folder / "k.ptx").read_text()
            ptx.append(tu_id.sub("TU", "\n".join(line for line in text.splitlines() if not line.startswith("//"))))
        assert ptx[0] == ptx[1] and ".entry" in ptx[0], name


SEEDED_RUN = """
import os, sys, mlx.core as mx, numpy as np
from esmc_mlx.runtime.cuda import dequantize
w, s = mx.quantize(mx.random.normal((64, 2560), key=mx.random.key(0)).astype(mx.bfloat16), group_size=32, bits=4, mode="mxfp4")[:2]
got = dequantize.dequantize(w, s, None, 32, 4, "mxfp4", mx.bfloat16, 4224)
ref = mx.dequantize(w, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.bfloat16)
print("STATUS", list(dequantize._kernel(1, "mxfp4", 4, 32, "fp_pairs").seen.values()))
print("EQUAL", bool(mx.array_equal(got.view(mx.uint16), ref.view(mx.uint16))))
"""


@pytest.mark.gpu
def test_mlx_runs_the_seeded_kernel_on_cuda(tmp_path):
    """Fresh processes, one MLX cache: the first compiles and seeds the kernel, the second finds
    it; both bit-exact with mx.dequantize. MLX really loads our files: with the mangled name in
    the .txt spoilt, a third process fails to find the kernel."""
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(tmp_path)}

    def run():
        return subprocess.run([sys.executable, "-c", SEEDED_RUN], capture_output=True, text=True, env=env)

    first = run()
    assert "STATUS ['seeded']" in first.stdout and "EQUAL True" in first.stdout, first.stdout + first.stderr
    second = run()
    assert "STATUS ['cached']" in second.stdout and "EQUAL True" in second.stdout, second.stdout + second.stderr
    (txt,) = tmp_path.glob("custom_kernel_esmc_dequantize1_mxfp4*.txt")
    name, _ = txt.read_text().split("\t")
    txt.write_text(f"{name}\t_Z_not_there\n")
    spoilt = run()
    assert spoilt.returncode != 0 and "EQUAL" not in spoilt.stdout


# ---- the fused quantized matmul (cuda/qmm.py) ---------------------------------------------------

QMM_MODES = {
    "affine4": ("affine", 4, 64),
    "affine4g32": ("affine", 4, 32),
    "mxfp4": ("mxfp4", 4, 32),
    "affine8": ("affine", 8, 64),
    "mxfp8": ("mxfp8", 8, 32),
}


def qmm_weight(n, k, name, dtype, seed=0):
    mode, bits, gs = QMM_MODES[name]
    mx.random.seed(seed)
    q = mx.quantize((mx.random.normal((n, k)) * 0.05).astype(dtype), group_size=gs, bits=bits, mode=mode)
    return q[0], q[1], (q[2] if mode == "affine" else None), gs, bits, mode


def spec(w, gs, bits, mode) -> dispatch.Weight:
    rows_, k = dequantize.dequantized_shape(w, bits)
    return dispatch.Weight(mode, bits, gs, rows_, k)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QMM_MODES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fast", [True, False])
def test_qmm_weights_bit_exact_on_cuda(name, dtype, fast):
    """x = the identity: y is the dequantized weight, transposed, exactly (each output one
    product with 1.0 and fp32 sums of zeros), so the kernel's in-register dequantize must give
    dequantize's values (a -0 weight comes out +0), in a block short of its 128 (256) rows."""
    w, s, b, gs, bits, mode = qmm_weight(200, 192, name, FLOATS[dtype])
    x = mx.eye(192, dtype=FLOATS[dtype])
    assert qmm.supported(x, w, gs, bits) and dispatch.qmm_can_implement(spec(w, gs, bits, mode), dtype)[0]
    d = dequantize.dequantize(w, s, b, gs, bits, mode, FLOATS[dtype], BLOCKS).T
    tiles = [("2d", 0), ("1d", 16), ("1d", 128)] + ([("wg", 0)] if gs >= 32 else [])
    for tile, bt in tiles:
        y = qmm.quantized_matmul(x, w, s, b, gs, bits, mode, tile, bt, 1, fast=fast)
        assert y.dtype == FLOATS[dtype] and y.shape == d.shape
        assert mx.all((y == d) | (mx.isnan(y) & mx.isnan(d))).item(), (name, dtype, fast, tile, bt)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QMM_MODES))
@pytest.mark.parametrize("count", [1, 37, 300])
def test_qmm_error_within_dequantize_matmul_on_cuda(name, count):
    """Against an fp32 reference each output's error is within twice dequantize + matmul's, in
    each tile, K split into the plans' slabs (for one wave of SMs, and for four) or not, with a
    2-byte-misaligned x, and batch dims kept. K is 640 (10 steps of 64) or, at 37 rows, the
    300M's 960 (15: odd step counts in every split)."""
    k = 960 if count == 37 else 640
    w, s, b, gs, bits, mode = qmm_weight(520, k, name, mx.bfloat16, seed=count)
    d = dequantize.dequantize(w, s, b, gs, bits, mode, mx.bfloat16, BLOCKS)
    weight = spec(w, gs, bits, mode)
    big = mx.random.normal((count * k + 8,)).astype(mx.bfloat16)
    tiles = ["1d", "2d"] + (["wg"] if gs >= 32 else [])
    for x in (big[: count * k].reshape(1, count, k), big[1 : 1 + count * k].reshape(1, count, k)):
        ref = x.astype(mx.float32) @ d.astype(mx.float32).T
        # dm and every y stay alive: a kernel that never ran would leave y holding a freed
        # buffer of the same size, such as dm's, and pass
        dm = (x + 0) @ d.T
        e_dm = mx.abs(dm.astype(mx.float32) - ref).max().item()
        ys = []
        for tile in tiles:
            for sms in (132, 4 * 132, 0):  # the plans' splits for one wave, four waves; 0: never split
                bt, splits = (
                    dispatch.qmm_splits(weight, count, tile, sms)
                    if sms
                    else (dispatch.qmm_splits(weight, count, tile, 132)[0], 1)
                )
                y = qmm.quantized_matmul(x, w, s, b, gs, bits, mode, tile, bt, splits)
                ys.append(y)
                assert y.shape == (1, count, 520) and y.dtype == mx.bfloat16
                assert mx.abs(y.astype(mx.float32) - ref).max().item() <= 2 * e_dm + 1e-4 * mx.abs(ref).max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["affine4", "mxfp4", "affine8"])
@pytest.mark.parametrize("wg", [False, True])
def test_quantized_forward_in_the_fused_window_on_cuda(name, wg, monkeypatch):
    """A quantized model whose weights are small (the table's "small" entries) inside its fused
    window runs every block weight through the fused kernel, and its logits are those of
    dequantize + matmul up to the fp32 summation order; also in the warpgroup tile at 160
    tokens (8-bit weights this small take "2d" by the table)."""
    config = testing.tiny_config(hidden_size=256, num_attention_heads=4, num_hidden_layers=3)
    weights = dict(tree_flatten(testing.random_mlx_model(config, mx.bfloat16).parameters()))
    record = bench.QUANT_MODES[name]
    model = bench.mlx_model(config, weights, fuse=True, quant=record)
    shipped = dataclasses.replace(gpu_target(**({"qmm_wg_8bit_values": 0} if wg else {})), cutlass=False)
    lo, _ = shipped.tuning.fused["small"][f"affine{record['bits']}" if record["mode"] == "affine" else record["mode"]]
    ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(1, 160 if wg else max(lo, 64))))
    calls, tiles = [], []  # the packed weights the fused kernel was called with, and its tiles
    real = qmm.quantized_matmul

    def counted(x, w, *a, **k):
        calls.append(w)
        tiles.append(k["tile"])
        return real(x, w, *a, **k)

    monkeypatch.setattr(qmm, "quantized_matmul", counted)
    block_weights = {id(m.weight) for _, m in model.named_modules() if isinstance(m, rq.QuantizedLinear)}
    assert len(block_weights) == 4 * config.num_hidden_layers  # qkv, o, gate/up, down of every block
    with dispatch.use(dataclasses.replace(shipped, force="dequantize")):
        ref = model(ids).logits.astype(mx.float32)
        mx.eval(ref)
    assert not calls
    with dispatch.use(shipped):
        got = model(ids).logits.astype(mx.float32)
        mx.eval(got)
    assert {id(w) for w in calls} == block_weights
    assert ("wg" in tiles) == wg
    assert (mx.sqrt(((got - ref) ** 2).sum() / (ref**2).sum())).item() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_split_sum_is_mlx_sum_then_cast_on_cuda(dtype):
    """The split-K partials' sum: bit for bit MLX's sum over the slabs and cast for two slabs
    (the 6B's split at 256 tokens); for more (another summation order), off MLX's fp32 sum by
    at most twice the cast's own rounding; at sizes that leave a partial block."""
    for splits, m, n in ((2, 256, 7680), (2, 3, 8), (5, 37, 2560)):
        parts = mx.random.normal((splits, m, n)) * 30
        got = qmm.split_sum(parts, FLOATS[dtype])
        sums = parts.sum(axis=0)
        want = sums.astype(FLOATS[dtype])
        assert got.shape == (m, n) and got.dtype == FLOATS[dtype]
        if splits == 2:
            assert mx.array_equal(got, want).item()
        else:
            rounding = mx.abs(want.astype(mx.float32) - sums).max().item()
            assert mx.abs(got.astype(mx.float32) - sums).max().item() <= 2 * rounding + 1e-3


def test_fused_kernel_factories_fill_every_placeholder(monkeypatch, tmp_path):
    """The three fused kernels' text (1d, 2d, wg tiles), checked on any machine
    (mx.fast.cuda_kernel not built): every variant's scale and dequantize code is spliced in,
    the shared setup and store are there once, affine kernels take biases, and the warpgroup
    tile asks for its buffers plus the swizzle's 1024-byte alignment."""
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: None)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))  # by_include's files
    qmm._kernel.cache_clear()
    try:
        for variant in ("affine", "affine_fast", "fp", "fp_fast"):
            for tile, bt in (("1d", 64), ("2d", 64), ("wg", 256)):
                kernel = qmm._kernel(tile, variant, 4, 64, bt)
                kw = kernel.kernel_args
                for placeholder in ("SCALE_REGS", "LOAD_SCALES", "DEQUANT"):
                    assert placeholder not in kw["source"], (kernel.name, placeholder)
                assert kw["source"].count("auto issue = [&]") == 1 and kw["source"].count("if constexpr (SPLIT)") == 1
                assert ("biases" in kw["input_names"]) == variant.startswith("affine")
        for variant, bits in (("affine_fast", 4), ("affine", 8), ("fp", 8)):
            wg = qmm._kernel("wg", variant, bits, 64, 256).kernel_args
            assert "wgmma_rs<256, __nv_bfloat16>" in wg["header"] and "wgmma.mma_async" in wg["header"]
            buffers = qmm.STAGES * (256 * 64 * 2 + 128 * 64 * bits // 8)
            assert wg["shared_memory"] == max(buffers, 256 * (128 + 4) * 4) + 1024
    finally:
        qmm._kernel.cache_clear()
