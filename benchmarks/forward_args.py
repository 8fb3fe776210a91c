"""Arguments shared by the benchmarks that time whole MLX forwards (kept out of the package's
``__init__`` so that scripts timing torch alone do not load MLX)."""

from __future__ import annotations

import argparse
import dataclasses

import mlx.core as mx
from mlx.utils import tree_flatten

from esmc_mlx.bench import config_for, mlx_model
from esmc_mlx.testing import random_mlx_model


def add_forward_arguments(
    p: argparse.ArgumentParser,
    model: str = "6B",
    budget: float = 1.0,
    modes: str | None = None,
    shapes: str | None = None,
) -> None:
    """--model, --device, --budget and --json: what every whole-forward benchmark here takes;
    --modes and --shapes too, with these defaults, when given."""
    if modes is not None:
        p.add_argument("--modes", default=modes, help="quantizations, comma-separated (crossover_forward.RECORDS)")
    if shapes is not None:
        p.add_argument("--shapes", default=shapes, help="BxL shapes, comma-separated")
    p.add_argument("--model", default=model, help="6B, 600M, 300M or tiny (random weights)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--budget", type=float, default=budget, help="seconds of timed forwards per side and shape")
    p.add_argument("--json", help="write the results here")


def parse_forward_arguments(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The parsed arguments, with MLX's default device set from --device."""
    a = p.parse_args(argv)
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    return a


def random_bf16(model: str) -> tuple:
    """(config, weights, model) for --model: random bf16 weights and the shipped bf16 model on
    them (fused, compiled); quantized twins are built from the same weights."""
    config = config_for(model)
    weights = dict(tree_flatten(random_mlx_model(config, mx.bfloat16).parameters()))
    return config, weights, mlx_model(config, weights, fuse=True, compile=True)


def models_per_mode(a: argparse.Namespace, modes: list[str]) -> tuple:
    """(config, {mode: model}) for parsed --model, --device and ``a.layers`` (None: the model's
    own count): one set of random weights (bf16 on a GPU, float32 on the CPU), the shipped model
    on them per mode (fused, compiled; "bf16" unquantized, else crossover_forward.RECORDS')."""
    from benchmarks.crossover_forward import RECORDS

    config = config_for(a.model)
    if a.layers:
        config = dataclasses.replace(config, num_hidden_layers=a.layers)
    dtype = mx.bfloat16 if a.device == "gpu" else mx.float32
    weights = dict(tree_flatten(random_mlx_model(config, dtype).parameters()))
    quant = {m: None if m == "bf16" else RECORDS[m] for m in modes}
    return config, {m: mlx_model(config, weights, fuse=True, compile=True, quant=quant[m]) for m in modes}
