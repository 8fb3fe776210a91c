"""Measurement scripts, run from the repository root as modules: ``python -m benchmarks.NAME``."""

import json


def save_json(path: str | None, result: dict) -> dict:
    """Write ``result`` to ``path`` as indented JSON when a path is given (``--json``); return it."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result
