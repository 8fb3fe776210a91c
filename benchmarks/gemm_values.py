"""Does a bf16 GEMM's speed depend on the weight's values? (issue 16, twenty-eighth session)

`esmc-mlx bench` had the 6B's mxfp4 twin at 64x512 take 0.93-0.94x its bf16 twin's time (ninth
and twenty-eighth issue-16 sessions), though at that shape it runs dequantize + the same bf16
GEMM, and affine4 / affine8 read 1.01. This times MLX's ``x @ w.T`` on the 6B's gate/up shape
(13824 x 2560) at 32,768 tokens with one x and weights that differ only in their values:

- ``normal``: N(0, 0.02) in bf16 (the random twins' weights);
- ``mxfp4``, ``affine4``, ``affine8``: that weight through ``mx.quantize`` / ``mx.dequantize``;
- ``normal_m1``: ``normal`` with the low 6 of bf16's 7 mantissa bits cleared (mxfp4's values
  keep one), to separate the mantissa's bits from the values' spread.

The variants run interleaved, rotated each round, bursts of ``--gemms`` calls; ``nvidia-smi``
samples the SM clock and the board power every 50 ms, and each burst gets the samples taken
during it. Prints per-GEMM ms, TFLOP/s, clock and power per variant.

    python -m benchmarks.gemm_values --json $OUT/gemm_values.json     # H200, about 20 s
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import time

import mlx.core as mx
import numpy as np

from benchmarks import save_json

N, K = 13824, 2560  # the 6B's fused gate/up weight
QUANT = {"mxfp4": {"mode": "mxfp4", "group_size": 32, "bits": 4}, "affine4": {"bits": 4}, "affine8": {"bits": 8}}


def weights(seed: int = 0) -> dict[str, mx.array]:
    key = mx.random.key(seed)
    normal = (0.02 * mx.random.normal((N, K), key=key)).astype(mx.bfloat16)
    out = {"normal": normal}
    for name, q in QUANT.items():
        packed = mx.quantize(normal, **q)
        biases = packed[2] if len(packed) > 2 else None
        out[name] = mx.dequantize(packed[0], packed[1], biases, **q, dtype=mx.bfloat16)
    bits = np.array(normal.view(mx.uint16)) & np.uint16(0xFFC0)  # sign, exponent, top mantissa bit
    out["normal_m1"] = mx.array(bits).view(mx.bfloat16)
    mx.eval(out)
    return out


class PowerLog:
    """``nvidia-smi`` sampling (time, SM clock MHz, power W) every 50 ms in the background."""

    def __init__(self):
        query = "--query-gpu=timestamp,clocks.sm,power.draw"
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=subprocess.PIPE,
                text=True,
            )
        except FileNotFoundError:  # no NVIDIA driver tools (a CPU smoke run): times only
            self.proc = None

    def stop(self) -> list[tuple[float, float, float]]:
        if self.proc is None:
            return []
        self.proc.terminate()
        out, _ = self.proc.communicate()
        samples = []
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((stamp, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue
        return samples


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--gemms", type=int, default=100, help="GEMMs a burst (evaluated 10 at a time)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    ws = weights()
    x = (mx.random.normal((args.tokens, K), key=mx.random.key(1))).astype(mx.bfloat16)
    names = list(ws)

    evals = max(1, args.gemms // 10)

    def burst(w) -> float:
        start = time.perf_counter()
        for _ in range(evals):
            mx.eval([x @ w.T for _ in range(10)])
        return (time.perf_counter() - start) / (evals * 10)

    for name in names:  # warm-up: cuBLAS's plan, the clocks
        burst(ws[name])
    log = PowerLog()
    time.sleep(0.2)
    spans: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.time()
            per_gemm = burst(ws[name])
            spans[name].append((t0, time.time(), per_gemm))
    samples = log.stop()

    flop = 2.0 * args.tokens * N * K
    rows = []
    for name in names:
        inside = [s for s in samples for t0, t1, _ in spans[name] if t0 <= s[0] <= t1]
        ms = statistics.median(p for _, _, p in spans[name]) * 1e3
        row = {
            "weight": name,
            "ms": ms,
            "tflops": flop / (ms * 1e-3) / 1e12,
            "sm_mhz": statistics.mean(s[1] for s in inside) if inside else None,
            "power_w": statistics.mean(s[2] for s in inside) if inside else None,
            "samples": len(inside),
        }
        rows.append(row)
    base = rows[0]["ms"]
    for row in rows:
        row["vs_normal"] = row["ms"] / base
        clock = f"{row['sm_mhz']:.0f} MHz, {row['power_w']:.0f} W" if row["samples"] else "no nvidia-smi samples"
        print(
            f"{row['weight']:10s} {row['ms']:7.3f} ms  {row['tflops']:6.1f} TFLOP/s  x{row['vs_normal']:.3f}  {clock}"
        )
    return save_json(args.json, {"tokens": args.tokens, "shape": [N, K], "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
