"""Measurement scripts, run from the repository root as modules: ``python -m benchmarks.NAME``."""

import json

import mlx.core as mx


def save_json(path: str | None, result: dict) -> dict:
    """Write ``result`` to ``path`` as indented JSON when a path is given (``--json``); return it."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
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
