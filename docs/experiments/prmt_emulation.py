"""Derives the byte-permute selectors of runtime/kernels.py's mxfp4_pairs_bf16 and
affine4_pairs on the CPU: PTX prmt (sign-replicating selector msb included) emulated in Python,
the mxfp4 pairs against e2m1's values and signs, the affine4 words against the shifts and masks
they replaced, on 20,000 random octets and the corner ones. The kernels themselves are checked
bit for bit against mx.dequantize by tests/test_kernels.py on a CUDA GPU.

    python docs/experiments/prmt_emulation.py
"""

import random
import struct

M32 = 0xFFFFFFFF
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def prmt(a: int, b: int, s: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte s[4i+2:4i] of {b, a}, or that
    byte's bit 7 replicated when s[4i+3] is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (s >> (4 * i)) & 0xF
        byte = src[n & 7]
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def mxfp4_words(q: int) -> list[int]:
    """mxfp4_pairs_bf16 before the scale: word p holds values 2p, 2p + 1."""
    m = q & 0x77777777
    lo03, hi03 = prmt(0xC0800000, 0xC0804000, m & 0xFFFF), prmt(0x3F3F3F00, 0x40404040, m & 0xFFFF)
    lo47, hi47 = prmt(0xC0800000, 0xC0804000, m >> 16), prmt(0x3F3F3F00, 0x40404040, m >> 16)
    s = (q << 4) & M32
    words = []
    for p in range(4):
        a = 2 * (p & 1)
        lo, hi = (lo03, hi03) if p < 2 else (lo47, hi47)
        word = prmt(lo, hi, a | (4 + a) << 4 | (a + 1) << 8 | (5 + a) << 12)
        words.append(word | (prmt(s, q, (8 | p) << 4 | (12 | p) << 12) & 0x80008000))
    return words


def affine4_words(q: int) -> tuple[list[int], list[int]]:
    """affine4_pairs' words and the shifts-and-masks words they replaced."""
    new = [(prmt(q, q >> 4, p | (4 + p) << 8) & 0x000F000F) | 0x43004300 for p in range(4)]
    old = [(((q >> 8 * p) & 0xF) | (((q >> 8 * p) << 12) & 0xF0000) | 0x43004300) & M32 for p in range(4)]
    return new, old


random.seed(0)
for q in [random.getrandbits(32) for _ in range(20000)] + [0, M32, 0x88888888, 0x77777777]:
    for p, word in enumerate(mxfp4_words(q)):
        for half, v in ((word & 0xFFFF, 2 * p), (word >> 16, 2 * p + 1)):
            n = (q >> (4 * v)) & 0xF
            assert bf16(half) == (-1 if n & 8 else 1) * E2M1[n & 7], (hex(q), v)
            assert bool(half & 0x8000) == bool(n & 8), (hex(q), v)  # -0 too
    new, old = affine4_words(q)
    assert new == old, hex(q)
print("kernels.py's prmt selectors: mxfp4 pairs and affine4 words as specified")
