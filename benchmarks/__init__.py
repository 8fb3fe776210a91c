"""Measurement scripts, run from the repository root as modules: ``python -m benchmarks.NAME``."""

import json
from pathlib import Path

import mlx.core as mx


def save_json(path: str | Path | None, result: dict, device: str | None = None) -> dict:
    """Write ``result`` to ``path`` as indented JSON when a path is given (``--json``), with its
    ``provenance`` (the source commit, whether the tree differed from it, the device that ran
    MLX: ``device`` "gpu" or "cpu", default MLX's default), which ``python -m
    benchmarks.compare`` prints beside the figures it compares. Returns ``result``."""
    if path:
        from esmc_mlx.bench import provenance

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**result, "provenance": provenance(device)}, indent=1, default=str) + "\n")
    return result


def with_attribute(owner, name: str, value, fn):
    """``fn`` as a callable that runs with ``owner.name`` set to ``value`` and restores it after
    (a compiled trace made inside keeps what the attribute chose)."""

    def run():
        saved = getattr(owner, name)
        setattr(owner, name, value)
        try:
            return fn()
        finally:
            setattr(owner, name, saved)

    return run


def batched(fn, batch: int):
    """``fn`` as a callable that evaluates ``batch`` of its calls together and waits for them:
    a kernel timed GPU-bound (per call: divide by ``batch``). Calls that do not read each other's
    outputs may run side by side in MLX's CUDA graph, which hides a kernel's idle SMs: compare
    kernels that fill the GPU alike, or time them one after another under Nsight Compute."""

    def run():
        mx.eval([fn() for _ in range(batch)])
        mx.synchronize()

    return run
