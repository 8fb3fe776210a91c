"""Arguments shared by the benchmarks that time whole MLX forwards (kept out of the package's
``__init__`` so that scripts timing torch alone do not load MLX)."""

from __future__ import annotations

import argparse

import mlx.core as mx


def add_forward_arguments(p: argparse.ArgumentParser, model: str = "6B", budget: float = 1.0) -> None:
    """--model, --device, --budget and --json: what every whole-forward benchmark here takes."""
    p.add_argument("--model", default=model, help="6B, 600M, 300M or tiny (random weights)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--budget", type=float, default=budget, help="seconds of timed forwards per side and shape")
    p.add_argument("--json", help="write the results here")


def parse_forward_arguments(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The parsed arguments, with MLX's default device set from --device."""
    a = p.parse_args(argv)
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    return a
