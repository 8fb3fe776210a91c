"""runtime/kernels.py: the CUDA dequantize, bit for bit against mx.dequantize.

CUDA cannot run on the CI host, so the kernel's arithmetic is proven on the CPU through
``emulate``, a numpy copy of what one kernel thread computes (same unpacking, same scale
decoding, same roundings). MLX's CPU and CUDA dequantize differ in one place: affine
``q * scale + bias`` is one fused multiply-add on CUDA (one rounding in the scales' dtype) and
two ops on the CPU (a rounding after each, through fp32). ``emulate(..., fused=False)`` is the
CPU's arithmetic and must equal the CPU's mx.dequantize everywhere; ``fused=True`` is the
kernel's and must equal the CPU wherever the two roundings give the one-rounding result. On a
CUDA GPU the kernel itself is compared with mx.dequantize (and with ``emulate(fused=True)``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from esmc_mlx.runtime import kernels

FLOATS = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
AFFINE = [(b, g) for b in kernels.AFFINE_BITS for g in kernels.AFFINE_GROUPS]
FP = list(kernels.FP_MODES)
ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu


# ---- numpy emulation of the kernel ------------------------------------------------------


@pytest.fixture(autouse=True)
def kernel_at_every_size(monkeypatch):
    """The tests' weights are small: let the kernel take them (kernels.MIN_VALUES routes small
    weights to mx.dequantize, which is faster there)."""
    monkeypatch.setattr(kernels, "MIN_VALUES", 0)


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
    bits, group_size = kernels.FP_MODES[mode]
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
def test_fallback_on_cpu_is_mx_dequantize(mode, bits, group_size):
    with mx.stream(mx.cpu):
        w, s, b = quantized(mode, bits, group_size, mx.bfloat16)
        assert not kernels.supported(w, s, b, group_size, bits, mode, mx.bfloat16)
        ref = mx.dequantize(w, s, b, group_size=group_size, bits=bits, mode=mode, dtype=mx.float16)
        got = kernels.dequantize(w, s, b, group_size, bits, mode, mx.float16)
        assert got.dtype == mx.float16 and got.shape == ref.shape
        np.testing.assert_array_equal(as_bits(got), as_bits(ref))
        default = kernels.dequantize(w, s, b, group_size, bits, mode)  # mx.dequantize's dtype
        assert default.dtype == mx.dequantize(w, s, b, group_size=group_size, bits=bits, mode=mode).dtype


# ---- GPU: the kernel itself (skipped unless the default device is a CUDA GPU) ---------------

GPU_CASES = [("affine", b, g, sdt) for b, g in AFFINE for sdt in FLOATS] + [
    (m, *kernels.FP_MODES[m], "float32") for m in FP
]


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX on a CUDA GPU")
@pytest.mark.parametrize(("mode", "bits", "group_size", "sdt"), GPU_CASES)
def test_kernel_bit_exact_on_cuda(mode, bits, group_size, sdt):
    # 6B-like width; one row sliced off the front makes the words start 4- or 8-byte aligned
    # only (for 2, 3, 5, 6 bits at group 32), the kernel's scalar-load paths.
    w, s, b = quantized(mode, bits, group_size, FLOATS[sdt], rows=40, cols=2560 + group_size)
    views = [(w, s, b), (w[1:], s[1:], None if b is None else b[1:])]
    for ww, ss, bb in views:
        for odt in FLOATS.values():
            assert kernels.supported(ww, ss, bb, group_size, bits, mode, odt)
            ref = mx.dequantize(ww, ss, bb, group_size=group_size, bits=bits, mode=mode, dtype=odt)
            got = kernels.dequantize(ww, ss, bb, group_size, bits, mode, odt)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_array_equal(
                as_bits(got), as_bits(ref), err_msg=f"{mode} {bits} {group_size} {sdt}->{odt}"
            )
            # The emulation is the kernel's arithmetic (proves the CPU tests above cover CUDA).
            emu = emulate(ww, ss, bb, group_size, bits, mode, odt).view(np.uint32)
            np.testing.assert_array_equal(
                emu, as_bits(got), err_msg="kernel == mx.dequantize but not the fused emulation"
            )


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX on a CUDA GPU")
def test_unsupported_cases_fall_back_on_cuda():
    w, s, b = quantized("affine", 4, 64, mx.bfloat16)
    w2, s2, _ = quantized("nvfp4", 4, 16, mx.float32)
    gs = mx.array(3.0)
    assert not kernels.supported(w2, s2, None, 16, 4, "nvfp4", mx.bfloat16, global_scale=gs)
    ref = mx.dequantize(w2, s2, mode="nvfp4", global_scale=gs, dtype=mx.bfloat16)
    got = kernels.dequantize(w2, s2, None, 16, 4, "nvfp4", mx.bfloat16, global_scale=gs)
    np.testing.assert_array_equal(as_bits(got), as_bits(ref))
    assert kernels.dequantize(w, s, b, 64, 4).dtype == mx.bfloat16


def test_dequantize_stream_only_on_cuda(monkeypatch):
    """The per-call dequantize gets a stream of its own on CUDA alone, and the switch turns it off."""
    from esmc_mlx.runtime import quantized

    if not ON_CUDA:
        assert quantized.dequantize_stream() is None
        return
    assert quantized.dequantize_stream() is not None
    monkeypatch.setenv(quantized.STREAM_ENV, "0")
    assert quantized.dequantize_stream() is None


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX on a CUDA GPU")
@pytest.mark.parametrize("mode, bits, group_size", [("affine", 4, 64), ("affine", 8, 64), ("mxfp4", 4, 32)])
def test_side_stream_matmul_equals_default_stream(monkeypatch, mode, bits, group_size):
    """A quantized linear above the crossover gives the same bits with the dequantize on its own
    stream as on the default one."""
    import mlx.nn as nn

    from esmc_mlx.runtime import quantized

    layer = quantized.QuantizedLinear.from_linear(nn.Linear(512, 384, bias=False), group_size, bits, mode=mode)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((4, 300, 512), key=mx.random.key(3)).astype(mx.bfloat16)
    monkeypatch.setenv(quantized.POLICY_ENV, "dequantize")
    side = layer(x)
    monkeypatch.setenv(quantized.STREAM_ENV, "0")
    plain = layer(x)
    assert mx.array_equal(side, plain).item()
