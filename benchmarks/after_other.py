"""What a forward's time depends on besides its own work (issue 16): one model's forward timed
right after a forward of itself, of the bf16 model, of an identical quantized copy (same kernels
and CUDA-graph keys, other weight buffers), after 0.2 s of sleep, and after itself or the bf16
model followed by ``mx.clear_cache()`` (every buffer then comes fresh from the allocator); the
SM clock and the power-cap throttle flag read from NVML just before and after each timed call.
Run it once more with ``MLX_USE_CUDA_GRAPHS=0`` (a process each) to see whether MLX's graph
reuse is the cause. The thirty-fifth session found the quantized 6B 2-3% slower right after bf16
than after itself, graphs on or off, and no slower after its identical copy; with the cache
emptied, 7-9% slower (docs/benchmarks.md).

    python -m benchmarks.after_other --model 6B --modes mxfp4 --shapes 1x1024,16x256      # GPU
    MLX_USE_CUDA_GRAPHS=0 python -m benchmarks.after_other --model 6B --modes mxfp4
    python -m benchmarks.after_other --model tiny --device cpu --modes affine4 --shapes 1x16 --rounds 2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import time

import mlx.core as mx

from benchmarks import save_json
from benchmarks.crossover_forward import RECORDS
from benchmarks.forward_args import add_forward_arguments, parse_forward_arguments, random_bf16
from esmc_mlx.bench import forward_fns, machine, mlx_model, parse_shapes

# (run first, then timed): "q" is the quantized model, "q2" its identical copy; "+clear": the
# model, then MLX's buffer cache emptied.
PAIRS = [
    *[(first, "q") for first in ("q", "bf16", "q2", "sleep", "q+clear", "bf16+clear")],
    *[(first, "bf16") for first in ("bf16", "q", "sleep", "bf16+clear")],
]
SM_CLOCK, SW_POWER_CAP = 1, 0x4  # NVML_CLOCK_SM; nvmlClocksThrottleReasonSwPowerCap


class Nvml:
    """The GPU's SM clock (MHz) and whether the power cap throttles it, from the driver's NVML
    (ctypes: a query costs microseconds); (0, False) where there is no NVIDIA driver."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            self.lib = None
            return
        self.lib.nvmlInit_v2()
        self.handle = ctypes.c_void_p()
        self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle))

    def read(self) -> tuple[int, bool]:
        if self.lib is None:
            return 0, False
        mhz, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
        self.lib.nvmlDeviceGetClockInfo(self.handle, SM_CLOCK, ctypes.byref(mhz))
        self.lib.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle, ctypes.byref(reasons))
        return mhz.value, bool(reasons.value & SW_POWER_CAP)


def time_pairs(fns: dict, rounds: int, nvml: Nvml) -> dict[str, dict]:
    """Per pair: median ms of the second fn right after the first, rounds rotated, with the
    median SM clock and the share of calls under the power cap before and after it."""
    samples = {pair: [] for pair in PAIRS}
    for r in range(rounds):
        for first, timed in PAIRS[r % len(PAIRS) :] + PAIRS[: r % len(PAIRS)]:
            fns[first]()
            before = nvml.read()
            start = time.perf_counter()
            fns[timed]()
            samples[first, timed].append((time.perf_counter() - start, before, nvml.read()))
    return {
        f"{timed} after {first}": {
            "median_ms": statistics.median(s[0] for s in got) * 1e3,
            "sm_mhz_before": statistics.median(s[1][0] for s in got),
            "sm_mhz_after": statistics.median(s[2][0] for s in got),
            "power_capped_before": sum(s[1][1] for s in got) / len(got),
            "power_capped_after": sum(s[2][1] for s in got) / len(got),
        }
        for (first, timed), got in samples.items()
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_forward_arguments(p, model="6B", modes="mxfp4", shapes="1x1024,16x256")
    p.add_argument("--rounds", type=int, default=10, help="timed calls per pair")
    a = parse_forward_arguments(p, argv)
    config, weights, bf16 = random_bf16(a.model)
    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "1")
    result = {"machine": machine(with_torch=False), "model": a.model, "cuda_graphs": graphs, "rows": []}
    nvml = Nvml()
    for mode in a.modes.split(","):
        q, q2 = (mlx_model(config, weights, fuse=True, compile=True, quant=RECORDS[mode]) for _ in range(2))
        for batch, length in parse_shapes(a.shapes):
            fns = forward_fns(None, {"bf16": bf16, "q": q, "q2": q2}, batch, length)
            for fn in fns.values():
                fn(), fn(), fn()  # traced, compiled, warm
            fns["sleep"] = lambda: time.sleep(0.2)
            for name in ("q", "bf16"):
                fns[name + "+clear"] = lambda fn=fns[name]: (fn(), mx.clear_cache())
            t = time_pairs(fns, a.rounds, nvml)
            result["rows"].append({"mode": mode, "batch": batch, "length": length, "pairs": t})
            ms = {k: v["median_ms"] for k, v in t.items()}
            print(
                f"{a.model} {mode} {batch}x{length}, MLX_USE_CUDA_GRAPHS={graphs}: q after bf16 / after q "
                f"{ms['q after bf16'] / ms['q after q']:.3f}, after q2 {ms['q after q2'] / ms['q after q']:.3f}, "
                f"after sleep {ms['q after sleep'] / ms['q after q']:.3f}, after q+clear "
                f"{ms['q after q+clear'] / ms['q after q']:.3f}, after bf16+clear "
                f"{ms['q after bf16+clear'] / ms['q after q']:.3f}; bf16 after q / after bf16 "
                f"{ms['bf16 after q'] / ms['bf16 after bf16']:.3f}, after sleep {ms['bf16 after sleep'] / ms['bf16 after bf16']:.3f}",
                flush=True,
            )
            for name, v in t.items():
                print(
                    f"    {name:16s} {v['median_ms']:8.2f} ms, SM {v['sm_mhz_before']:.0f} -> {v['sm_mhz_after']:.0f} MHz, "
                    f"power-capped {v['power_capped_before']:.0%} -> {v['power_capped_after']:.0%}",
                    flush=True,
                )
        del q, q2
        gc.collect()
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
