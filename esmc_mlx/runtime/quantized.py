"""Quantized layers that run each call by its plan (runtime/dispatch.py decides; this runs it).

``mx.quantized_matmul`` reads the packed weights directly: the fastest choice for a few tokens.
For many tokens dequantizing the weight (into a temporary freed right after) and running the
float matmul can be much faster (MLX's CPU quantized matmul runs at a few GFLOP/s); on a CUDA
GPU with a measured table the fused kernel and CUTLASS's GEMM take windows of token counts.
The dequantized weight is not cached: that would cost the float model's memory, which is what
quantization was for. ``dequantize_model`` does it on purpose, for users who have the memory
(and for validation: the same model with the dequantized weights in place).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path, tree_unflatten

from . import dispatch
from .cuda import cutlass_qmm, dequantize, qmm


def backend() -> str:
    """'cpu', 'cuda' or 'metal': where the default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def token_count(x: mx.array) -> int:
    """Rows of ``x`` through a linear (every dim but the last): what plans are keyed by."""
    return x.size // x.shape[-1] if x.shape[-1] else 0


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]


def dequantized_weight(module: nn.Module, dtype: mx.Dtype, launch: dispatch.Launch | None = None) -> mx.array:
    """The float weight of a quantized linear or embedding: by this project's kernel where the
    plan's ``launch`` names it (the same values), else ``mx.dequantize``."""
    packed = (module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits, module.mode)
    if launch is not None and launch.requires is not None and dequantize.supported(*packed, dtype):
        target = dispatch.current()
        return dequantize.dequantize(*packed, dtype, target.device.sms * target.tuning.dequantize_blocks_per_sm)
    weight, scales, biases, group_size, bits, mode = packed
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=dtype)


class QuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` (same parameters, same files) that runs each call by its plan."""

    # The weight, transposed, dequantized with its block's others (cuda/fusions.py; set with
    # object.__setattr__: an array set as a module attribute would become a parameter).
    given_transposed: mx.array | None = None

    def weight_spec(self, target: dispatch.Target) -> dispatch.Weight:
        """This weight as the plans see it, kept on the layer. Whether every mxfp4 scale suits
        CUTLASS is read from the scales once, where CUTLASS could take the layer (on an eager
        call: a compiled model traces a shape the second time it sees it)."""
        spec = self.__dict__.get("_spec")
        if spec is None or (target.cutlass and self.mode == "mxfp4" and "_in_range" not in self.__dict__):
            rows, k = dequantize.dequantized_shape(self["weight"], self.bits)
            in_range = True
            if target.cutlass and self.mode == "mxfp4":
                in_range = bool(cutlass_qmm.kernel_scales(self))
                object.__setattr__(self, "_in_range", in_range)
            spec = dispatch.Weight(
                self.mode,
                self.bits,
                self.group_size,
                rows,
                k,
                dtype_name(self["scales"].dtype),
                "bias" in self,
                in_range,
            )
            object.__setattr__(self, "_spec", spec)
        return spec

    def plan(self, tokens: int, dtype: mx.Dtype = mx.bfloat16, added: bool = False) -> dispatch.Plan:
        """How ``tokens`` rows of ``dtype`` go through this layer on the default device."""
        target = dispatch.current()
        return dispatch.linear(self.weight_spec(target), tokens, dtype_name(dtype), target, added)

    def __call__(self, x: mx.array) -> mx.array:
        return self.run(x, self.plan(token_count(x), x.dtype))

    def run(self, x: mx.array, plan: dispatch.Plan) -> mx.array:
        if plan.path == "quantized":
            return super().__call__(x)
        if plan.path == "cutlass":
            return cutlass_qmm.matmul(self, x, plan.tile, plan.splits)
        if plan.path == "fused" and qmm.supported(x, self["weight"], self.group_size, self.bits):
            tile, _, bt = plan.tile.partition("-")
            packed = (self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode)
            y = qmm.quantized_matmul(x, *packed, tile=tile, bt=int(bt or 0), splits=plan.splits)
            return y + self["bias"] if "bias" in self else y
        wt = self.given_transposed
        if wt is None or wt.dtype != x.dtype:
            wt = dequantized_weight(self, x.dtype, plan.kernels[0] if plan.path == "dequantize" else None).T
        return mx.addmm(self["bias"], x, wt) if "bias" in self else x @ wt


def quantize_modules(model: nn.Module, record: dict, is_quantized) -> None:
    """Replace, in place, the layers the artifact holds quantized: linears by QuantizedLinear,
    the embedding (only with --quantize-head) by nn.QuantizedEmbedding.

    ``record`` is config.json's ``quantization`` (defaults + per-layer overrides, mlx-lm's
    convention); ``is_quantized(path)`` says whether the weights hold ``{path}.scales``. A
    layer is quantized when the record names it or its scales are present (mlx-lm's rule).
    """
    default = {k: record[k] for k in ("group_size", "bits")}
    default["mode"] = record.get("mode", "affine")

    def swap(path, module):
        params = record.get(path)
        if params is None and hasattr(module, "to_quantized") and is_quantized(path):
            params = default
        if not isinstance(params, dict):  # not quantized (or a non-layer key of the record)
            return module
        params = {"mode": "affine", **params}
        if isinstance(module, nn.Linear):
            return QuantizedLinear.from_linear(module, **params)  # lazy: the weights replace it
        return module.to_quantized(**params)

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)


def dequantize_model(model: nn.Module, dtype: mx.Dtype | None = None) -> nn.Module:
    """Replace every quantized layer by its float twin holding the dequantized weights
    (``dtype``: default the model's float dtype). Costs the float model's memory."""
    dtype = dtype or getattr(model, "dtype", mx.float32)
    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            out_dims, in_dims = dequantize.dequantized_shape(m.weight, m.bits)
            layer = nn.Linear(in_dims, out_dims, bias="bias" in m)
            layer.weight = dequantized_weight(m, dtype)
            if "bias" in m:
                layer.bias = m.bias.astype(dtype)
            swaps.append((path, layer))
        elif isinstance(m, nn.QuantizedEmbedding):
            w = dequantized_weight(m, dtype)
            layer = nn.Embedding(*w.shape)
            layer.weight = w
            swaps.append((path, layer))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return model
