"""A sparse autoencoder folder with its matrices in bfloat16 or 8-bit (``esmc-mlx quantize-sae``).

The published format is already safetensors, so nothing is renamed: each ``layer_{i}.safetensors``
is read, its two matrices cast or quantized, the vectors (``b_dec``, ``idf``, ``max``) kept in
float32, and written, one layer at a time (a 6B SAE layer at codebook 65,536 is 1.3 GB). The
layout of the result is ``sae_artifact``'s. The caller stages the folder and validates it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx

from .._version import __version__
from ..artifact import FLOAT_DTYPES, check_finite, load_safetensors
from ..errors import ConfigError, QuantizeError
from ..outputs import disk_full, disk_full_error
from ..quantize import QuantParams, parse_spec, quantize_tensor
from ..sae_artifact import CONFIG_NAME, MATRICES, VECTORS, SAEConfig, layer_file

FLOAT_SPECS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
SAE_SPECS = ("bf16", "fp16", "8")


def parse_sae_spec(spec: str, group_size: int | None = None) -> str | QuantParams:
    """``--q`` for an SAE: a float dtype name (bf16, fp16) or 8 (affine 8-bit, ``group_size``
    default 64). QuantizeError naming the option otherwise."""
    text = str(spec).strip().lower()
    if text in FLOAT_SPECS:
        if group_size is not None:
            raise QuantizeError(f"--group-size applies to 8-bit quantization, not to --q {spec}")
        return FLOAT_SPECS[text]
    if text != "8":
        raise QuantizeError(f"--q {spec!r} for an SAE: choose one of {', '.join(SAE_SPECS)}")
    return parse_spec(text, group_size)[1]


def spec_config(config: SAEConfig, spec: str | QuantParams, layers: Iterable[int]) -> SAEConfig:
    """The config of the SAE ``spec`` makes from ``config`` (holding ``layers``)."""
    if isinstance(spec, str):
        return dataclasses.replace(config, available_layers=tuple(layers), dtype=spec, quantization=None)
    for name, width in (("d_model", config.d_model), ("codebook_dim", config.codebook_dim)):
        if width % spec.group_size:
            raise QuantizeError(f"--group-size {spec.group_size} does not divide the SAE's {name} ({width})")
    return dataclasses.replace(config, available_layers=tuple(layers), dtype="float32", quantization=spec.as_dict())


def layer_tensors(tensors: dict[str, mx.array], spec: str | QuantParams, where: str = "the SAE") -> dict[str, mx.array]:
    """One layer's tensors as ``spec`` stores them (the layout in ``sae_artifact``). QuantizeError
    naming the tensor of ``where`` (its file) when a cast overflows float16 (or bfloat16)."""
    out = {name: tensors[name].astype(mx.float32) for name in VECTORS}
    for name in MATRICES:
        matrix = tensors[name].astype(mx.float32)
        if isinstance(spec, str):
            out[name] = matrix.astype(FLOAT_DTYPES[spec])
            check_finite(name, tensors[name], out[name], where=where, error=QuantizeError, fix=_OVERFLOW_FIX)
        else:  # as nn.QuantizedLinear holds its weight: rows = outputs, groups along the inputs
            out.update(quantize_tensor(f"{name}.weight", matrix.T, spec))
    return out


_OVERFLOW_FIX = "store it as bf16 or 8 instead (--q bf16)"


def write_sae(
    config: SAEConfig,
    layer_path: Callable[[int], Path],
    out: Path,
    spec: str | QuantParams,
    layers: Iterable[int] | None = None,
    source: dict | None = None,
    on_layer: Callable[[int], None] | None = None,
) -> SAEConfig:
    """Write ``config``'s SAE (``layer_path(i)``: the local file of layer i) with its matrices as
    ``spec`` makes them into the existing folder ``out``: config.json and each of ``layers``
    (default: all) as ``layer_{i}.safetensors``. ``source`` (id, revision) is recorded in
    config.json. Raises ConfigError for a damaged layer file (its header, a NaN or Inf value),
    QuantizeError for a matrix whose cast overflows."""
    layers = tuple(config.available_layers if layers is None else layers)
    made = spec_config(config, spec, layers)
    for i in layers:
        path = layer_path(i)
        tensors = load_safetensors(path, ConfigError)  # header checked, every value finite
        stored = layer_tensors(tensors, spec, str(path))
        mx.eval(stored)
        try:
            mx.save_safetensors(str(out / layer_file(i)), stored, metadata={"format": "mlx"})
        except (OSError, RuntimeError) as e:  # MLX says only "[write] Unable to write N bytes"
            if disk_full(e, out / layer_file(i)):
                raise disk_full_error(out / layer_file(i)) from None  # named as OUT/layer_i (shown_path)
            raise
        del tensors, stored
        if on_layer is not None:
            on_layer(i)
    record = dict(
        made.to_dict(), esmc_mlx={"source": source or {}, "converter": {"name": "esmc-mlx", "version": __version__}}
    )
    (out / CONFIG_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return made
