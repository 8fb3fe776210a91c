"""Runtime optimizations (fused projections, compiled forward, additive masks) compute the same
function as the plain model. Speed is shown by benchmarks/, not tested here."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_torch

from esmc_mlx import bench
from esmc_mlx.runtime import dispatch
from esmc_mlx.runtime.model import ESMC


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def weights(tiny_config):
    requires_torch()
    return bench.mlx_weights(bench.torch_model(tiny_config, "float32", "cpu", seed=3), mx.float32)


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_fused_compiled_equals_plain(tiny_config, weights):
    plain = bench.mlx_model(tiny_config, weights)
    fast = bench.mlx_model(tiny_config, weights, fuse=True, compile=True)
    assert fast.is_fused and not plain.is_fused
    assert "qkv_proj" in fast.esmc.layers[0].self_attn and "q_proj" not in fast.esmc.layers[0].self_attn
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 24, size=(3, 17))
    mask = np.ones((3, 17), dtype=np.int32)
    mask[1, 12:] = 0
    chains = np.zeros((3, 17), dtype=np.int32)
    chains[:, 9:] = 1
    for kwargs in ({}, {"attention_mask": mask}, {"sequence_id": chains}):
        ref = np.array(plain(ids, **kwargs).logits)
        for _ in range(3):  # first call eager, then traced, then the compiled trace reused
            out = fast(ids, **kwargs)
            assert rel(np.array(out.logits), ref) <= 1e-5
    hidden = fast(ids, output_hidden_states=True)  # not compiled: all hidden states
    assert len(hidden.hidden_states) == tiny_config.num_hidden_layers + 1


def test_all_ones_mask_is_the_same_as_none(tiny_config, weights):
    model = bench.mlx_model(tiny_config, weights)
    ids = np.random.default_rng(1).integers(4, 24, size=(2, 11))
    a = np.array(model(ids, attention_mask=np.ones((2, 11))).logits)
    b = np.array(model(ids).logits)
    np.testing.assert_array_equal(a, b)


def test_attention_weights_ignore_padded_keys(tiny_config, weights):
    model = bench.mlx_model(tiny_config, weights)
    ids = np.random.default_rng(2).integers(4, 24, size=(1, 9))
    mask = np.array([[1] * 6 + [0] * 3])
    out = model(ids, attention_mask=mask, output_attentions=True)
    w = np.array(out.attentions[0])
    assert np.allclose(w.sum(-1), 1, atol=1e-5)
    assert np.abs(w[..., 6:]).max() == 0


@pytest.mark.parametrize("mode", ["affine4", "mxfp4"])
def test_fused_quantized_is_exact(tiny_config, weights, mode):
    plain = bench.mlx_model(tiny_config, weights, quant=bench.QUANT_MODES[mode])
    fused = bench.mlx_model(tiny_config, weights, fuse=True, quant=bench.QUANT_MODES[mode])
    assert fused.esmc.layers[0].mlp.gate_up_proj.bits == 4
    for part in ("weight", "scales", "biases"):  # the fusion itself is exact: packed rows concatenated
        if part in plain.esmc.layers[0].mlp.gate_proj:
            mlp = plain.esmc.layers[0].mlp
            np.testing.assert_array_equal(
                np.array(fused.esmc.layers[0].mlp.gate_up_proj[part]),
                np.array(mx.concatenate([mlp.gate_proj[part], mlp.up_proj[part]])),
            )
    ids = np.random.default_rng(3).integers(4, 24, size=(2, 13))
    # Equal up to float32 rounding: OpenBLAS 0.3.34's AVX2 sgemm (MLX's BLAS since the
    # scipy-openblas32 wheel) can round a row of the fused GEMM differently in the last bit
    # (measured 3e-6 on logits of size ~1); the reference BLAS and OpenBLAS 0.3.21 gave equality.
    np.testing.assert_allclose(np.array(fused(ids).logits), np.array(plain(ids).logits), rtol=0, atol=2e-5)


def test_mixed_quantization_is_not_fused(tiny_config, weights):
    import mlx.nn as nn

    from esmc_mlx.runtime.execution import concat_linears

    a = nn.QuantizedLinear(128, 128, bits=4)
    b = nn.QuantizedLinear(128, 128, bits=8)
    assert concat_linears([a, b]) is None
    assert concat_linears([a, nn.Linear(128, 128, bias=False)]) is None
    model = ESMC(tiny_config)
    model.esmc.layers[0].mlp.up_proj = nn.QuantizedLinear(128, tiny_config.intermediate_size, bits=8)
    model.fuse()
    assert "gate_proj" in model.esmc.layers[0].mlp and "gate_up_proj" in model.esmc.layers[1].mlp


def test_fast_mxfp4_quantize_is_bit_identical():
    from esmc_mlx.quantize.fast import quantize

    rng = np.random.default_rng(0)
    grid = np.array(
        [0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, 0.5, 1, 1.5, 2, 3, 4, 7, -0.25, -0.75, -5, -6], np.float32
    )
    cases = [rng.standard_normal((64, 256)).astype(np.float32) * 10.0 ** rng.uniform(-6, 3) for _ in range(4)]
    ties = rng.choice(grid, size=(64, 256)) * 2.0 ** rng.integers(-4, 4, size=(64, 8, 1)).repeat(32, -1).reshape(
        64, 256
    )
    cases += [ties, np.zeros((2, 64), np.float32), -np.abs(cases[0])]
    for case in cases:
        for dtype in (mx.bfloat16, mx.float32):
            w = mx.array(case).astype(dtype)
            ref = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
            out = quantize(w, 32, 4, "mxfp4")
            assert len(out) == len(ref)
            for a, b in zip(out, ref):
                assert a.dtype == b.dtype and mx.array_equal(a, b).item()


def test_the_fingerprint_names_the_weights_not_their_runtime_layout(tiny_config):
    """embed and scan resume only with the model that made their files (ESMC.fingerprint): the
    same weights give one fingerprint however they run, other weights another."""
    from mlx.utils import tree_flatten

    from esmc_mlx.testing import random_mlx_model

    want = random_mlx_model(tiny_config, mx.bfloat16, seed=1).fingerprint()
    same = random_mlx_model(tiny_config, mx.bfloat16, seed=1).fuse()
    assert same.is_fused and same.fingerprint() == want
    same.set_dtype(mx.float32)  # what load() does on the CPU: every bfloat16 value is a float32
    assert same.fingerprint() == want
    weights = dict(tree_flatten(random_mlx_model(tiny_config, mx.float32, seed=1).parameters()))
    others = [
        random_mlx_model(tiny_config, mx.bfloat16, seed=2),  # another checkpoint of the same shape
        bench.mlx_model(tiny_config, weights),  # the same checkpoint stored in float32: other values
        *(bench.mlx_model(tiny_config, weights, quant=bench.QUANT_MODES[m]) for m in ("affine8", "affine4", "mxfp4")),
    ]
    prints = [want, *(m.fingerprint() for m in others)]
    assert len(set(prints)) == len(prints)
    fused = bench.mlx_model(tiny_config, weights, fuse=True, quant=bench.QUANT_MODES["mxfp4"])
    assert fused.is_fused and fused.fingerprint() == prints[-1]


def test_another_target_gets_its_own_compiled_trace(tiny_config, weights):
    """A trace bakes in the plans of the target it was traced for, so the compiled forwards are
    keyed by the target: another (a benchmark's side, ESMC_MLX_PATH, another device's plans)
    runs eagerly once and gets a trace of its own, with the same function."""
    model = bench.mlx_model(tiny_config, weights, fuse=True, compile=True, quant=bench.QUANT_MODES["affine4"])
    ids = mx.array(np.random.default_rng(1).integers(4, 24, size=(2, 9)))
    assert [model.use_compiled(ids, None) for _ in range(2)] == [False, True]
    for _ in range(2):  # eager, then traced
        ref = np.array(model(ids).logits)
    before = set(model._compiled)
    other = dataclasses.replace(dispatch.current(), force="dequantize")
    with dispatch.use(other):
        assert [model.use_compiled(ids, None) for _ in range(2)] == [False, True]
        for _ in range(2):
            out = np.array(model(ids).logits)
    assert set(model._compiled) - before, "the other target reused the first target's trace"
    assert rel(out, ref) <= 1e-5


def test_the_fused_kernel_tiles_by_token_count_and_architecture():
    """The fused kernel's tile: 1d below 65 tokens (the smallest of 16-128 tokens a block that
    holds them), 2d from there, wg (Hopper's warpgroup MMA) from 129 where it runs and takes the
    weight (4- and 8-bit, groups of 32 or more; 8-bit only on weights of 8M values or more);
    K split to fill the SMs where the tiles fill less than half of them."""
    hopper = dispatch.Target.of(dispatch.Device.parse("cuda:sm_90a"))
    big, small = dispatch.Weight("affine", 4, 64, 7680, 2560), dispatch.Weight("affine", 8, 64, 960, 960)
    assert [dispatch.qmm_tile(big, t, hopper) for t in (16, 64, 65, 128, 129, 300)] == ["1d"] * 2 + ["2d"] * 2 + [
        "wg"
    ] * 2
    assert dispatch.qmm_tile(small, 300, hopper) == "2d"  # 8-bit, under 8M values
    assert dispatch.qmm_tile(dataclasses.replace(big, bits=8), 300, hopper) == "wg"
    assert dispatch.qmm_tile(dataclasses.replace(big, group_size=16), 300, hopper) == "2d"
    assert [dispatch.qmm_splits(big, t, "1d", 132)[0] for t in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    # 60 tiles of 128 x 256 fill less than half of 132 SMs (one block each), 240 fill them
    assert dispatch.qmm_splits(big, 256, "wg", 132) == (256, 2)
    assert dispatch.qmm_splits(big, 1024, "wg", 132) == (256, 1)
    assert dispatch.qmm_splits(dispatch.Weight("affine", 4, 64, 2560, 6912), 256, "wg", 132) == (256, 6)
