"""Runtime optimizations (fused projections, compiled forward, additive masks) compute the same
function as the plain model. Speed is shown by benchmarks/, not tested here."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_torch

from esmc_mlx import bench
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

    from esmc_mlx.runtime.model import concat_linears

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


def test_a_forced_warp_tile_gets_its_own_compiled_trace(tiny_config, weights, monkeypatch):
    """A trace bakes in the fused kernel's warp tile (chosen in Python while tracing), so
    ESMC_MLX_QMM_TILE keys the compiled forwards as the forced matmul path does: otherwise a
    benchmark forcing another tile times the first tile's trace (the twelfth issue-16
    session's first run read identical times for three tiles)."""
    from esmc_mlx.runtime import kernels

    model = bench.mlx_model(tiny_config, weights, fuse=True, compile=True)
    ids = np.random.default_rng(1).integers(4, 24, size=(2, 9))
    monkeypatch.delenv(kernels.QMM_TILE_ENV, raising=False)
    for _ in range(2):  # eager, then traced
        ref = np.array(model(ids).logits)
    before = set(model._compiled)
    monkeypatch.setenv(kernels.QMM_TILE_ENV, kernels.QMM_WG_TILE)
    for _ in range(2):
        out = np.array(model(ids).logits)
    assert set(model._compiled) - before, "the forced tile reused the unforced trace"
    assert rel(out, ref) <= 1e-6  # a float model: the tile changes nothing but the key


def test_the_warp_tile_names_are_checked():
    from esmc_mlx.runtime import kernels

    assert kernels.qmm_tile(300, kernels.QMM_WG_TILE) == kernels.QMM_WG_TILE
    assert kernels.qmm_tile(300) == "wg" and kernels.qmm_tile(100) == "2d" and kernels.qmm_tile(16) == "1d"
    # 8-bit weights take "wg" by default only from QMM_WG_8BIT_VALUES values; forcing it still works
    large, small = kernels.QMM_WG_8BIT_VALUES, kernels.QMM_WG_8BIT_VALUES - 1
    assert kernels.qmm_tile(300, bits=8, values=large) == "wg" and kernels.qmm_tile(300, bits=8, values=small) == "2d"
    assert kernels.qmm_tile(300, bits=4, values=small) == "wg" and kernels.qmm_tile(16, bits=8, values=large) == "1d"
    assert kernels.qmm_tile(300, kernels.QMM_WG_TILE, bits=8, values=small) == kernels.QMM_WG_TILE
    with pytest.raises(ValueError, match="wg"):
        kernels.qmm_tile(300, "wg64")
    assert kernels.wg_tile_supported(4, 32) and kernels.wg_tile_supported(4, 128)
    assert kernels.wg_tile_supported(8, 32) and kernels.wg_tile_supported(8, 64)
    assert not kernels.wg_tile_supported(4, 16) and not kernels.wg_tile_supported(6, 64)
    # split K by qmm_plan's rule: 60 tiles of 128 x 256 fill less than half of 132 slots (one
    # block an SM), 240 fill them
    assert kernels.qmm2_plan(256, 7680, 2560, kernels.QMM_WG_TILE) == 2
    assert kernels.qmm2_plan(1024, 7680, 2560, kernels.QMM_WG_TILE) == 1
    assert kernels.qmm2_plan(256, 2560, 6912, kernels.QMM_WG_TILE) == 6  # 20 tiles, 108 steps


def test_the_split_waves_are_read_checked_and_key_the_traces(monkeypatch):
    """ESMC_MLX_QMM_WAVES sets the split rule's waves (0: K never split); anything but a
    number >= 0 is refused naming the variable; a trace bakes the split in, so it keys them."""
    from esmc_mlx.runtime import kernels
    from esmc_mlx.runtime.model import kernel_choices

    monkeypatch.delenv(kernels.QMM_WAVES_ENV, raising=False)
    unset = kernel_choices()
    assert kernels.qmm_waves() == 1.0
    assert kernels.qmm2_plan(256, 7680, 2560, kernels.QMM_WG_TILE, kernels.qmm_waves()) == 2
    monkeypatch.setenv(kernels.QMM_WAVES_ENV, "0")
    assert kernels.qmm_waves() == 0.0 and kernel_choices() != unset
    assert kernels.qmm2_plan(256, 7680, 2560, kernels.QMM_WG_TILE, kernels.qmm_waves()) == 1
    assert kernels.qmm_plan(16, 2560, 6912, kernels.qmm_waves()) == (16, 1)
    for bad in ("two", "-1", "nan", "inf"):
        monkeypatch.setenv(kernels.QMM_WAVES_ENV, bad)
        with pytest.raises(ValueError, match=f"ESMC_MLX_QMM_WAVES: '{bad}' is not a number"):
            kernels.qmm_waves()
