"""How often a forward is evaluated in chunks of layers, against its time (issue 16): whole
forwards of the shipped model (fused, compiled, random weights) and its quantized twins, each
with ``ESMC.chunk_layers`` set to every ``--chunks`` value (``auto``: the shipped
``layers_per_eval``; ``none``: one graph; an int: every that many blocks), all sides interleaved
in one process. Printed per shape: each side's median time, quantized / bf16 at the same
setting, each setting against ``auto`` in the same mode, and the peak memory of one steady
forward above what was allocated before it (every model's weights, the earlier sides' logits).
The logits of every setting are compared with ``auto``'s (chunking changes only syncs and
memory: they should be equal to the bit).

Why: a chunked forward waits for the chunk before the previous one, so the host must build and
launch each chunk while the GPU runs one; the 6B at 1x1024 runs every 3 blocks (27 waits). On the
H200 the shipped setting was the fastest in every mode (thirty-third issue-16 session).

    python -m benchmarks.chunk_ab --model 6B --shapes 1x1024 --chunks auto,none,8 --json $OUT/c.json
    python -m benchmarks.chunk_ab --model tiny --device cpu --modes bf16,affine4 --shapes 1x64 --chunks auto,1
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from benchmarks import save_json
from benchmarks.forward_args import add_forward_arguments, models_per_mode, parse_forward_arguments
from esmc_mlx.bench import machine, parse_shapes, rel_l2, time_interleaved


def chunk_setting(text: str) -> int | str | None:
    """``--chunks`` entry -> ESMC.chunk_layers argument."""
    return {"auto": "auto", "none": None}[text] if text in ("auto", "none") else int(text)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_forward_arguments(p, modes="bf16,affine4,mxfp4,affine8", shapes="1x1024")
    p.add_argument("--chunks", default="auto,none", help="chunk_layers settings: auto, none or ints, comma-separated")
    p.add_argument("--layers", type=int, help="layers of the model (default: the model's own)")
    a = parse_forward_arguments(p, argv)
    modes, chunks = a.modes.split(","), a.chunks.split(",")
    config, models = models_per_mode(a, modes)
    result = {"machine": machine(with_torch=False), "model": a.model, "layers": config.num_hidden_layers, "rows": []}
    for batch, length in parse_shapes(a.shapes):
        ids = mx.array(np.random.default_rng(0).integers(4, 24, size=(batch, length)))

        def side(model, setting):
            def run():
                model.chunk_layers(setting)
                return model(ids).logits

            return run

        runs = {(m, c): side(models[m], chunk_setting(c)) for m in modes for c in chunks}
        logits, peaks = {}, {}
        for key, run in runs.items():  # eager, traced, then one steady forward for memory
            mx.eval(run()), mx.eval(run())
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()  # every model's weights, resident
            logits[key] = run().astype(mx.float32)
            mx.eval(logits[key])
            peaks[key] = (mx.get_peak_memory() - before) / 1e9
        timed = time_interleaved(
            {f"{m}/{c}": (lambda run=run: mx.eval(run())) for (m, c), run in runs.items()}, warmup=1, budget_s=a.budget
        )
        for m, c in runs:
            ms = timed[f"{m}/{c}"]["median_ms"]
            row = {"mode": m, "chunks": c, "batch": batch, "length": length, "median_ms": ms, "peak_gb": peaks[m, c]}
            row["every"] = models[m].chunk_layers(chunk_setting(c))._chunk_for(ids)
            row["over_bf16"] = ms / timed[f"bf16/{c}"]["median_ms"] if "bf16" in modes else None
            row["over_auto"] = ms / timed[f"{m}/auto"]["median_ms"] if "auto" in chunks else None
            row["rel_l2_vs_auto"] = rel_l2(logits[m, c], logits[m, "auto"]) if "auto" in chunks else None
            result["rows"].append(row)
            print(
                f"{a.model}/{config.num_hidden_layers} {batch}x{length} {m:8s} chunks {c:5s} (every {row['every']}): "
                f"{ms:8.2f} ms, peak above what was resident {row['peak_gb']:.2f} GB"
                + (f", / bf16 {row['over_bf16']:.3f}" if row["over_bf16"] is not None else "")
                + (
                    f", / auto {row['over_auto']:.3f}, rel L2 vs auto {row['rel_l2_vs_auto']:.1e}"
                    if c != "auto"
                    else ""
                ),
                flush=True,
            )
        save_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
