"""This project's dequantize on CUDA: ``mx.dequantize``'s output bit for bit, faster.

MLX's CUDA dequantize gives each thread one packed byte and reloads its group's scale per
byte. Here a thread takes 8 values at a time (an octet: ``bits`` packed bytes, one aligned load
where the address allows) and their one scale (an octet never straddles a group), and writes
them with one 128-bit store from registers; a grid-stride loop over a capped grid. The
arithmetic is MLX's CUDA arithmetic written as the same expressions (octets.cuh says how), so
the same compiler makes the same instructions of them. ``dequantize_together`` runs the same
octets for several weights in one launch, into one output. Where a call runs it is the plan's
decision (runtime/dispatch.py); ``supported`` is what the kernel itself takes.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import source
from .kernel_cache import Kernel

THREADS_PER_BLOCK = 256
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}  # mode -> (bits, group)
FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def _body(mode: str, dtype) -> str:
    """The octet body for ``mode`` into ``dtype``: mxfp4 into bf16 two values at a time (the fused
    matmul's pair arithmetic, the same values), else one octet at a time."""
    if mode == "affine":
        return "affine"
    return "fp_pairs" if mode == "mxfp4" and dtype == mx.bfloat16 else "fp"


def _source(n: int, affine: bool, body: str) -> str:
    """The grid-stride loop over the octets of ``n`` weights, each octet through ``body``."""
    cu = source.bodies("dequantize.cu")
    ends = ", ".join(cu["end_decl"].replace("%K", str(k)) for k in range(n))
    text = cu["start"].replace("ENDS", ends)
    for k in range(n):
        text += cu["size"].replace("%K", str(k)).replace("%J", str(k - 1) if k else "_")
    text += cu["loop"].replace("%L", str(n - 1))
    for k in range(n):
        part = cu["weight_octets"].replace("%K", str(k)).replace("%J", str(k - 1) if k else "_")
        if not affine:
            part = part.replace(f"      const auto* biases = biases{k};\n", "")
        text += part.replace("BODY", cu[body])
    return text + cu["close"]


@functools.cache
def _kernel(n: int, mode: str, bits: int, group_size: int, body: str) -> Kernel:
    """The kernel that dequantizes ``n`` weights of one (mode, bits, group size) (inputs w0,
    scales0[, biases0], w1, ...; one output, each weight's values after the last one's)."""
    affine = mode == "affine"
    names = ["w", "scales", "biases"] if affine else ["w", "scales"]
    return Kernel(
        name=f"esmc_dequantize{n}_{mode}_{bits}_{group_size}" + ("_pairs" if body == "fp_pairs" else ""),
        input_names=[f"{name}{k}" for k in range(n) for name in names],
        output_names=["values"],
        source=_source(n, affine, body),
        header=source.text("octets.cuh"),
    )


def dequantized_shape(w: mx.array, bits: int) -> tuple:
    """The shape of packed weight ``w`` unpacked: its last dimension times 32 / ``bits``."""
    return (*w.shape[:-1], w.shape[-1] * 32 // bits)


def supported(w, scales, biases, group_size: int, bits: int, mode: str, dtype) -> bool:
    """Whether the kernel takes these arrays."""
    if w.dtype != mx.uint32 or w.ndim < 2 or dtype not in FLOATS or w.size * 4 % bits:  # whole octets
        return False
    if mode == "affine":
        return (
            bits in AFFINE_BITS
            and group_size in AFFINE_GROUPS
            and biases is not None
            and scales.dtype in FLOATS
            and biases.dtype == scales.dtype
            and scales.shape == biases.shape
            and scales.size * group_size == w.size * 32 // bits
        )
    return (
        FP_MODES.get(mode) == (bits, group_size)
        and scales.dtype == mx.uint8
        and scales.size * group_size == w.size * 32 // bits
    )


def _scales_template(mode: str, scales_dtype: mx.Dtype) -> tuple:
    """The template argument that tells a kernel its scales' format: their dtype T (affine), or
    MX (1: e8m0 scales, mxfp4/mxfp8; 0: e4m3, nvfp4)."""
    return ("T", scales_dtype) if mode == "affine" else ("MX", int(mode != "nvfp4"))


def _launch(weights: list[tuple], group_size: int, bits: int, mode: str, dtype: mx.Dtype, max_blocks: int, shape=None):
    """One launch over the octets of ``weights`` (w, scales, biases), handed as MLX holds them
    (a reshape would be one more graph node to encode); one output of ``dtype``, each weight's
    values after the last one's (``shape``, default flat)."""
    kernel = _kernel(len(weights), mode, bits, group_size, _body(mode, dtype))
    inputs = [a for w, s, b in weights for a in ((w, s, b) if mode == "affine" else (w, s))]
    template = [("O", dtype), ("BITS", bits), ("GROUP", group_size), _scales_template(mode, weights[0][1].dtype)]
    octets = sum(w.size * 4 // bits for w, _, _ in weights)
    threads = min(-(-octets // THREADS_PER_BLOCK), max_blocks) * THREADS_PER_BLOCK
    return kernel(
        inputs=inputs,
        template=template,
        grid=(threads, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[shape or (octets * 8,)],
        output_dtypes=[dtype],
    )[0]


def dequantize(w, scales, biases, group_size: int, bits: int, mode: str, dtype: mx.Dtype, max_blocks: int):
    """``mx.dequantize(w, scales, biases, group_size, bits, mode, dtype=dtype)``, bit for bit;
    the caller checked ``supported``."""
    return _launch([(w, scales, biases)], group_size, bits, mode, dtype, max_blocks, dequantized_shape(w, bits))


def dequantize_together(weights: list[tuple], group_size: int, bits: int, mode: str, dtype: mx.Dtype, max_blocks: int):
    """The (w, scales, biases) of ``weights``, quantized alike, dequantized by one launch into one
    flat output, each weight's values after the last one's (each ``mx.dequantize``'s, bit for
    bit, flattened); None where a weight is not ``supported`` or the scales' dtypes differ."""
    if len({s.dtype for _, s, _ in weights}) != 1:
        return None
    if not all(supported(w, s, b, group_size, bits, mode, dtype) for w, s, b in weights):
        return None
    return _launch(weights, group_size, bits, mode, dtype, max_blocks)
