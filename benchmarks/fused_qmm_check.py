"""Correctness of kernels.quantized_matmul (the Marlin-style fused kernel) on a CUDA GPU.

1. Bit-exact weights: with x the identity (K tokens), y = W.T exactly (one product of 1.0 per
   output, fp32 sums of zeros), so y must equal dequantize(w).T value for value (a -0 weight
   comes out +0; NaN where NaN): checks the in-register dequantize (both the octet functions
   and the FAST pair arithmetic).
2. Errors against an fp32 reference: each within twice that of dequantize + matmul (bf16 and
   fp16, odd shapes, a 2-byte-misaligned x, split and unsplit K).
Prints one line per failure and 'BAD n' at the end. python -m benchmarks.fused_qmm_check [--quick|--extended]"""

import sys

import mlx.core as mx

from esmc_mlx.runtime import kernels

MODES = {
    "affine4": ("affine", 4, 64),
    "mxfp4": ("mxfp4", 4, 32),
    "affine8": ("affine", 8, 64),
    "affine4g32": ("affine", 4, 32),
    "affine4g128": ("affine", 4, 128),
    "mxfp8": ("mxfp8", 8, 32),
    "nvfp4": ("nvfp4", 4, 16),
}
extended = "--extended" in sys.argv
quick = "--quick" in sys.argv
bad = 0
checked = 0
mx.random.seed(1)


def quant(n, k, mode, bits, gs, dtype, scale=0.05):
    wf = (mx.random.normal((n, k)) * scale).astype(dtype)
    q = mx.quantize(wf, group_size=gs, bits=bits, mode=mode)
    return q[0], q[1], (q[2] if mode == "affine" else None)


# 1. bit-exact dequantize inside the kernel
exact_modes = list(MODES) if extended else ["affine4", "mxfp4", "affine8"]
exact_shapes = [(2880, 960), (7680, 2560)] if not quick else [(2880, 960)]
for name in exact_modes:
    mode, bits, gs = MODES[name]
    for n, k in exact_shapes:
        for dtype in (mx.bfloat16, mx.float16):
            wq, sc, bi = quant(n, k, mode, bits, gs, dtype)
            deq = kernels.dequantize(wq, sc, bi, gs, bits, mode, dtype)
            for fast, tile in (
                (True, None),
                (False, None),
                (True, "1d"),
                (True, "2d128"),
                (True, "2d32"),
                (True, "wg"),
                (False, "wg"),
            ):
                if tile and (dtype != mx.bfloat16 or n != 7680) and tile != "wg":
                    continue
                for rows in (k,):
                    x = mx.eye(k, dtype=dtype)[:rows]
                    y = kernels.quantized_matmul(x, wq, sc, bi, gs, bits, mode, fast=fast, tile=tile)
                    d = deq[:, :rows].T
                    # equal values (the fp32 sum turns a -0 weight into +0), NaN where NaN
                    agree = (y == d) | (mx.isnan(y) & mx.isnan(d))
                    same = mx.all(agree).item()
                    checked += 1
                    if not same:
                        bad += 1
                        diff = mx.sum(~agree).item()
                        print(
                            f"NOT BIT-EXACT {name} {n}x{k} rows {rows} {dtype} fast={fast} tile={tile}: {diff} values differ",
                            flush=True,
                        )
                        if bad <= 3:  # where: (token, weight row) -> kernel, dequantize
                            ys, ds = y.astype(mx.float32), d.astype(mx.float32)
                            for r_ in range(0, min(rows, 20)):
                                print("  tok", r_, "y", ys[r_, :6].tolist(), "d", ds[r_, :6].tolist(), flush=True)
print(f"bit-exact: {checked} cases, {bad} bad", flush=True)

# 2. errors against fp32
cases = [
    (960, 960, 100),
    (2880, 960, 1),
    (2560, 6912, 300),
    (7680, 2560, 256),
    (136, 64, 5),
    (2560, 2560, 16),
    (5120, 960, 1024),
]
if quick:
    cases = cases[:4]
err_modes = list(MODES) if extended else ["affine4", "mxfp4", "affine8"]
for name in err_modes:
    mode, bits, gs = MODES[name]
    for n, k, rows in cases:
        if k % gs:
            continue
        for dtype, mis in ((mx.bfloat16, False), (mx.bfloat16, True), (mx.float16, False)):
            wq, sc, bi = quant(n, k, mode, bits, gs, dtype)
            big = mx.random.normal((rows * k + 8,)).astype(dtype)
            x = big[1 : 1 + rows * k].reshape(rows, k) if mis else big[: rows * k].reshape(rows, k)
            deq = kernels.dequantize(wq, sc, bi, gs, bits, mode, dtype)
            ref = (x.astype(mx.float32) + 0) @ deq.astype(mx.float32).T
            dm = (x + 0) @ deq.T  # a fresh buffer: cuBLAS fails on a 2-byte-misaligned x (mlx 0.32.4)
            if not kernels.quantized_matmul_supported(x, wq, sc, bi, gs, bits, mode):
                print("UNSUPPORTED", name, n, k, rows, dtype, flush=True)
                bad += 1
                continue
            for waves, bt, tile in (
                (1.0, None, None),
                (1.0, 16, None),
                (1.0, 128, None),
                (1.0, None, "2d128"),
                (1.0, None, "2d32"),
                (1.0, None, "wg"),
                (4.0, None, "wg"),
            ):
                if (mis or dtype != mx.bfloat16) and (bt or tile) and tile != "wg":
                    continue
                y = kernels.quantized_matmul(x, wq, sc, bi, gs, bits, mode, waves=waves, bt=bt, tile=tile)
                s = mx.abs(ref).max().item()
                e = mx.abs(y.astype(mx.float32) - ref).max().item() / s
                e_dm = mx.abs(dm.astype(mx.float32) - ref).max().item() / s
                ok = e <= 2 * e_dm + 1e-4 and y.shape == dm.shape and y.dtype == dtype
                checked += 1
                if not ok or (rows == 256 and waves == 1.0 and bt is None and not mis):
                    t_ = kernels.qmm_tile(rows, tile if bt is None else "1d")
                    plan = (
                        t_,
                        kernels.qmm_plan(rows, n, k, waves, bt)
                        if t_ == "1d"
                        else kernels.qmm2_plan(rows, n, k, t_, waves),
                    )
                    print(
                        f"{'BAD ' if not ok else ''}{name:11s} {n}x{k} rows {rows:5d} {dtype} mis={mis} plan={plan} err {e:.2e} (dequant+matmul {e_dm:.2e})",
                        flush=True,
                    )
                bad += not ok
print(f"checked {checked}", flush=True)
print("BAD", bad, flush=True)
