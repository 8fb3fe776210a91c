"""esmc_mlx.runtime.kernels.dequantize against mx.dequantize, and what it does to a linear.

1. Dequantize (bf16 out) of the 6B's weight shapes (out x in: 6912x2560 gate/up,
   2560x6912 down, 7680x2560 fused qkv, 2560x2560 out) for affine 2,3,4,5,6,8 bits at
   group 64, mxfp4, mxfp8 and nvfp4: median time per call, GB/s (packed bytes + scales/biases
   read, bf16 written), the speedup, and whether the two outputs are equal bit for bit.
2. One quantized linear, bf16, at 16..4096 tokens: mx.quantized_matmul vs kernels.dequantize
   + matmul (routed as the runtime routes it: weights narrower than kernels.DEQUANTIZE_MIN_WIDTH
   go to mx.dequantize) vs mx.dequantize + matmul, and per mode, bit width and linear the crossover
   (the smallest token count from which dequantize + matmul beats quantized_matmul at every
   larger count). CROSSOVER_TOKENS no longer takes these: whole forwards disagreed with them
   (benchmarks/crossover_forward.py, which the table now comes from).
Calls are timed in batches (one mx.eval of --batch calls, then a synchronize) so the launch
overhead of a ~20 us kernel does not dominate; the batches of each contender interleave.

    python -m benchmarks.dequant_kernels --json $OUT/dequant.json     # H200, well under 2 min
    python -m benchmarks.dequant_kernels --device cpu                 # tiny shapes, a smoke run

``--against FILE`` times another version of runtime/kernels.py beside this one (for example
``git show REV:esmc_mlx/runtime/kernels.py > old.py``), ``--max-blocks 1056,4224,0`` this
kernel at several grid caps (0: one thread per octet, no cap), ``--models 6B,300M`` the
weight shapes of those models in part 1, ``--linear-models 6B,300M`` their gate/up and down
linears in part 2; ``--skip-dequantize`` / ``--skip-matmul`` run one part only.
"""

from __future__ import annotations

import argparse
import platform

import mlx.core as mx

from benchmarks import batched, save_json
from benchmarks.kernels_ab import load_kernels
from esmc_mlx.bench import time_interleaved
from esmc_mlx.runtime import kernels
from esmc_mlx.runtime.quantized import mode_name

SHIPPED_MIN_WIDTH = kernels.DEQUANTIZE_MIN_WIDTH
kernels.DEQUANTIZE_MIN_WIDTH = 0  # time the kernel at every size, whatever dequantize() routes to MLX

MODES = [("affine", b, 64) for b in (2, 3, 4, 5, 6, 8)] + [(m, *kernels.FP_MODES[m]) for m in kernels.FP_MODES]
# out x in of each model's quantized weights: fused gate/up, down, fused q/k/v, out
MODEL_SHAPES = {
    "6B": [(13824, 2560), (6912, 2560), (2560, 6912), (7680, 2560), (2560, 2560)],
    "300M": [(5120, 960), (960, 2560), (2880, 960), (960, 960)],
}
SHAPES = {"gpu": MODEL_SHAPES["6B"], "cpu": [(256, 128), (128, 256)]}
TOKENS = {"gpu": [16, 32, 64, 128, 256, 512, 1024, 4096], "cpu": [16, 64]}
# The linears of part 2 per model: the fused gate/up and the down projection.
LINEAR = {"6B": [(13824, 2560), (2560, 6912)], "300M": [(5120, 960), (960, 2560)], "cpu": [(256, 128)]}


def quantized_weight(shape, mode, bits, group_size):
    w = mx.random.normal(shape).astype(mx.bfloat16)
    parts = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    mx.eval(parts)
    return parts[0], parts[1], parts[2] if mode == "affine" else None


def bit_equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)))


def load_against(path: str):
    """Another kernels.py (as kernels_ab loads it: its relative imports resolve), routing every
    size to its kernel."""
    module = load_kernels(path)
    module.MIN_VALUES = 0  # a kernels.py from before DEQUANTIZE_MIN_WIDTH gated dequantize by it
    module.DEQUANTIZE_MIN_WIDTH = 0
    return module


def capped(max_blocks: int, args):
    """kernels.dequantize with the grid capped at ``max_blocks`` (0: no cap)."""

    def run():
        saved = kernels.MAX_BLOCKS
        kernels.MAX_BLOCKS = max_blocks or 1 << 30
        try:
            return kernels.dequantize(*args)
        finally:
            kernels.MAX_BLOCKS = saved

    return run


def dequant_rows(device: str, batch: int, reps: int, shapes, against=None, max_blocks=()) -> list[dict]:
    rows = []
    for mode, bits, gs in MODES:
        for shape in shapes:
            w, s, b = quantized_weight(shape, mode, bits, gs)
            args = (w, s, b, gs, bits, mode, mx.bfloat16)
            ref = mx.dequantize(w, s, b, group_size=gs, bits=bits, mode=mode, dtype=mx.bfloat16)
            exact = bit_equal(kernels.dequantize(*args), ref)
            contenders = {
                "mx": batched(
                    lambda: mx.dequantize(w, s, b, group_size=gs, bits=bits, mode=mode, dtype=mx.bfloat16), batch
                ),
                "kernel": batched(lambda: kernels.dequantize(*args), batch),
            }
            if against is not None:
                contenders["against"] = batched(lambda: against.dequantize(*args), batch)
            for n in max_blocks:
                exact = exact and bit_equal(capped(n, args)(), ref)
                contenders[f"kernel@{n}"] = batched(capped(n, args), batch)
            t = time_interleaved(contenders, warmup=1, reps=reps)
            nbytes = w.nbytes + s.nbytes + (b.nbytes if b is not None else 0) + ref.nbytes
            ms = {k: v["median_ms"] / batch for k, v in t.items()}
            extra = {f"{k}_ms": v for k, v in ms.items() if k not in ("mx", "kernel")}
            row = {
                "mode": mode_name(mode, bits),
                "group_size": gs,
                "shape": list(shape),
                "bytes": nbytes,
                "mx_ms": ms["mx"],
                "kernel_ms": ms["kernel"],
                "mx_GBps": nbytes / ms["mx"] / 1e6,
                "kernel_GBps": nbytes / ms["kernel"] / 1e6,
                "speedup": ms["mx"] / ms["kernel"],
                "bit_exact": exact,
                "kernel_used": kernels.supported(*args),
                **extra,
            }
            rows.append(row)
            print(
                f"{row['mode']:8s} {shape[0]:5d}x{shape[1]:<5d} mx {row['mx_ms'] * 1e3:7.1f} us {row['mx_GBps']:6.0f} GB/s"
                f"  kernel {row['kernel_ms'] * 1e3:7.1f} us {row['kernel_GBps']:6.0f} GB/s"
                f"  x{row['speedup']:.2f}  bit-exact={exact}"
                + "".join(f"  {k} {v * 1e3:.1f} us" for k, v in extra.items()),
                flush=True,
            )
    return rows


def matmul_rows(device: str, batch: int, reps: int, linears, modes) -> tuple[list[dict], dict]:
    """Part 2, with kernels.dequantize as the runtime routes it (small weights to MLX)."""
    kernels.DEQUANTIZE_MIN_WIDTH = SHIPPED_MIN_WIDTH
    rows, crossover = [], {}
    for mode, bits, gs in modes:
        name = mode_name(mode, bits)
        for shape in linears:
            w, s, b = quantized_weight(shape, mode, bits, gs)
            per_t = {}
            for tokens in TOKENS[device]:
                x = mx.random.normal((tokens, shape[1])).astype(mx.bfloat16)
                mx.eval(x)

                def qmm():
                    return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits, mode=mode)

                def kernel_mm():
                    return x @ kernels.dequantize(w, s, b, gs, bits, mode, mx.bfloat16).T

                def mx_mm():
                    return x @ mx.dequantize(w, s, b, group_size=gs, bits=bits, mode=mode, dtype=mx.bfloat16).T

                fns = {"qmm": qmm, "kernel+mm": kernel_mm, "mx+mm": mx_mm}
                t = time_interleaved({k: batched(f, batch) for k, f in fns.items()}, warmup=1, reps=reps)
                ms = {k: v["median_ms"] / batch for k, v in t.items()}
                per_t[tokens] = ms
                rows.append(
                    {"mode": name, "shape": list(shape), "tokens": tokens, **{f"{k}_ms": v for k, v in ms.items()}}
                )
                print(
                    f"{name:8s} {shape[0]:5d}x{shape[1]:<5d} T={tokens:5d}  "
                    + "  ".join(f"{k} {v * 1e3:8.1f} us" for k, v in ms.items()),
                    flush=True,
                )
            # Smallest T from which kernel+mm is faster than qmm at every larger measured T.
            cross = None
            for tokens in reversed(TOKENS[device]):
                if per_t[tokens]["kernel+mm"] >= per_t[tokens]["qmm"]:
                    break
                cross = tokens
            crossover[f"{name} {shape[0]}x{shape[1]}"] = cross
            print(f"{name:8s} {shape[0]}x{shape[1]}: kernel dequantize + matmul wins from T={cross}", flush=True)
    return rows, crossover


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--batch", type=int, help="calls per timed batch (default 20 on gpu, 2 on cpu)")
    p.add_argument("--reps", type=int, help="timed batches per contender (default 7 on gpu, 2 on cpu)")
    p.add_argument("--against", help="another kernels.py to time beside this one")
    p.add_argument("--max-blocks", default="", help="comma-separated grid caps to time this kernel at (0: none)")
    p.add_argument("--models", default="6B", help="whose weight shapes, comma-separated: 6B, 300M (gpu)")
    p.add_argument("--skip-matmul", action="store_true", help="only the dequantize table")
    p.add_argument("--skip-dequantize", action="store_true", help="only the matmul table and its crossovers")
    p.add_argument("--linear-models", default="6B", help="whose linears part 2 times, comma-separated (gpu)")
    p.add_argument("--modes", help="part 2's modes, comma-separated (affine4,mxfp4,...; default all)")
    a = p.parse_args(argv)
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    shapes = [s for m in a.models.split(",") for s in MODEL_SHAPES[m]] if a.device == "gpu" else SHAPES["cpu"]
    max_blocks = [int(n) for n in a.max_blocks.split(",") if n]
    against = load_against(a.against) if a.against else None
    batch = a.batch or (20 if a.device == "gpu" else 2)
    reps = a.reps or (7 if a.device == "gpu" else 2)
    result = {
        "device": a.device,
        "cuda": mx.cuda.is_available(),
        "mlx": mx.__version__,
        "host": platform.node(),
        "batch": batch,
        "reps": reps,
        "against": a.against,
    }
    if not a.skip_dequantize:
        result["dequantize"] = dequant_rows(a.device, batch, reps, shapes, against, max_blocks)
        result["all_bit_exact"] = all(r["bit_exact"] for r in result["dequantize"])
        print(f"all bit-exact: {result['all_bit_exact']}")
    if not a.skip_matmul:
        linears = [s for m in a.linear_models.split(",") for s in LINEAR[m]] if a.device == "gpu" else LINEAR["cpu"]
        modes = [m for m in MODES if a.modes is None or mode_name(m[0], m[1]) in a.modes.split(",")]
        result["matmul"], result["crossover_tokens"] = matmul_rows(a.device, max(1, batch // 4), reps, linears, modes)
    return save_json(a.json, result)


if __name__ == "__main__":
    main()
