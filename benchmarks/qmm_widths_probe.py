"""Where MLX's own ``mx.quantized_matmul`` is right (issue 16, thirtieth session).

For weights 64-256 wide (k) and 64 or 192 out (n), group sizes 32-128, 4- and 8-bit affine,
x in float32 / bfloat16 / float16 with 1, 3 or 16 rows: three calls of ``mx.quantized_matmul``
(each evaluated), compared with each other and with x @ dequantize(w).T in float32. A line
reads "BAD" where the three differ or any is off by more than 5% of the reference's largest
value. Each case is printed before it runs: a call that never returns (the H200 with mlx
0.32.4 at k = 128, group 128, 3 rows) shows where it stopped.

Run on the H200 (mlx 0.32.4): every case with k <= group_size and more than one row was BAD
(36 of 36 before the hang), every other case agreed; raw docs/bench/qmm_widths_probe_h200_session30.log.
esmc_mlx.runtime.quantized.mlx_quantized_matmul_fails keeps QuantizedLinear off those calls;
run this again on a new MLX to see whether it still must.

    python -m benchmarks.qmm_widths_probe    # on the GPU machine; any machine runs it
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np


def main() -> None:
    print("device", mx.default_device(), "mlx", mx.__version__, flush=True)
    cases = itertools.product(
        (64, 128, 256), (64, 192), (32, 64, 128), (4, 8), (mx.float32, mx.bfloat16, mx.float16), (1, 3, 16)
    )
    for k, n, group_size, bits, dtype, rows in cases:
        if k % group_size:
            continue
        print(f"k={k} n={n} group={group_size} bits={bits} {dtype} rows={rows}: ", end="", flush=True)
        w = mx.random.normal((n, k), key=mx.random.key(k + n)) * 0.1
        packed = mx.quantize(w, group_size=group_size, bits=bits)
        x = mx.random.normal((1, rows, k), key=mx.random.key(1)).astype(dtype)
        outs = []
        for _ in range(3):
            y = mx.quantized_matmul(x, *packed, group_size=group_size, bits=bits)
            mx.eval(y)
            outs.append(np.array(y.astype(mx.float32)))
        ref = np.array(x.astype(mx.float32) @ mx.dequantize(*packed, group_size=group_size, bits=bits).T)
        err = max(float(np.abs(o - ref).max()) for o in outs)
        same = all(np.array_equal(outs[0], o) for o in outs[1:])
        bad = not same or not err <= 0.05 * float(np.abs(ref).max())  # NaN is bad too
        print(
            f"{'BAD' if bad else 'ok'} max error {err:.3g}, the three calls {'equal' if same else 'differ'}", flush=True
        )


if __name__ == "__main__":
    main()
