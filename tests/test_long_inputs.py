"""Long inputs run in chunks of layers (runtime/model.py, ACTIVATION_BUDGET): the outputs are
bit-identical to one lazy graph, and the activation memory stays within a few layers'."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from esmc_mlx.errors import ScoringError
from esmc_mlx.runtime.execution import layer_activation_bytes, layers_per_eval
from esmc_mlx.runtime.model import ESMC
from esmc_mlx.testing import SHAPES, random_mlx_model, tiny_config


def random_model(config) -> ESMC:
    return random_mlx_model(config, mx.float32)


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


def test_long_inputs_are_chunked_short_ones_are_not():
    # 6B at 1x4096: one block's activations (1.6 GB with unfused attention scores) exceed the
    # budget: evaluate after every block. A 300M at 1x256 runs as one graph (no syncs).
    assert layers_per_eval(SHAPES["6B"], 1, 4096, 2) == 1
    assert layers_per_eval(SHAPES["6B"], 1, 8192, 2) == 1
    assert layers_per_eval(SHAPES["300M"], 1, 256, 2) is None
    assert 1 < layers_per_eval(SHAPES["6B"], 1, 256, 2) < 80


@pytest.mark.parametrize("fuse", [False, True])
def test_chunked_forward_is_bit_identical(fuse):
    model = random_model(tiny_config(num_hidden_layers=5))
    if fuse:
        model.fuse()
    rng = np.random.default_rng(1)
    ids = rng.integers(4, 24, size=(2, 37))
    mask = np.ones((2, 37), np.int32)
    mask[1, 25:] = 0
    chains = np.zeros((2, 37), np.int32)
    chains[:, 20:] = 1
    chains[1, 30:] = -1
    for kwargs in ({}, {"attention_mask": mask}, {"sequence_id": chains}):
        ref = model.chunk_layers(None)(ids, output_hidden_states=True, **kwargs)
        for every in (1, 2, 3):
            out = model.chunk_layers(every)(ids, output_hidden_states=True, **kwargs)
            assert same(out.logits, ref.logits) and same(out.last_hidden_state, ref.last_hidden_state)
            assert len(out.hidden_states) == len(ref.hidden_states) == 6
            assert all(same(a, b) for a, b in zip(out.hidden_states, ref.hidden_states))


@pytest.mark.slow  # JIT-builds the compiled kernels on the CPU
def test_chunked_compiled_forward_is_bit_identical():
    # Long inputs run one compiled function per block (a whole-model trace cannot evaluate in
    # between); fp32 on the CPU, compiled and eager outputs are equal too.
    model = random_model(tiny_config(num_hidden_layers=3)).fuse()
    ids = np.random.default_rng(2).integers(4, 24, size=(2, 29))
    mask = np.ones((2, 29), np.int32)
    mask[0, 20:] = 0
    for kwargs in ({}, {"attention_mask": mask}):
        ref = model.chunk_layers(None)(ids, **kwargs).logits
        for every in (None, 2):
            model.compile().chunk_layers(every)
            for _ in range(2):  # the first sighting of a shape runs eagerly, the second compiled
                out = model(ids, **kwargs)
            assert same(out.logits, ref)
        assert any(key[0] == "blocks" for key in model._compiled)  # the per-block trace ran
        model.compile(False)


def test_chunk_layers_rejects_nonsense():
    # each refused with the ScoringError naming the argument; True is not taken as 1
    model = random_model(tiny_config())
    for bad in (0, -1, "all", 1.5, True):
        with pytest.raises(ScoringError, match=r"chunk_layers\(every="):
            model.chunk_layers(bad)
    assert model._layers_per_eval == "auto"  # a refused value leaves the setting as it was


@pytest.mark.skipif(
    mx.default_device() == mx.gpu,
    reason="the analytic two-block bound holds on the CPU; on CUDA the allocator's peak also holds work queued "
    "ahead (86 and 146 MB against 61 MB on an H200): the GPU's bound is benchmarks/long_memory.py's",
)
def test_chunked_peak_memory_is_a_few_layers():
    # MLX's CPU allocator tracks its peak (mx.get_peak_memory after mx.reset_peak_memory).
    # On the CPU a whole lazy graph also runs in about one block's memory (the GPU queues
    # blocks ahead, see ACTIVATION_BUDGET), so the check here is the analytic bound: the
    # chunked forward holds at most two blocks' intermediates beyond the weights.
    config = tiny_config(hidden_size=256, num_attention_heads=4, num_hidden_layers=8, intermediate_size=768)
    model = random_model(config).chunk_layers(1)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    ids = mx.array(np.random.default_rng(3).integers(4, 24, size=(1, 1024)))
    mx.eval(model(ids).logits)  # warm: allocator caches, the RoPE tables, cuBLAS's workspace
    mx.reset_peak_memory()
    base = mx.get_active_memory()  # the weights and what the backend keeps (32 MiB more on an H200)
    assert mx.get_peak_memory() <= base + 1024 and base >= weights
    out = model(ids)
    mx.eval(out.logits)
    peak = mx.get_peak_memory() - base
    per_layer = layer_activation_bytes(config, 1, 1024, 4)
    assert per_layer / 4 < peak < 2 * per_layer, (peak, per_layer)
    # with every hidden state kept, those add up on top, and nothing else does
    mx.reset_peak_memory()
    out = model(ids, output_hidden_states=True)
    mx.eval(out.logits, *out.hidden_states)
    kept = sum(h.nbytes for h in out.hidden_states)
    assert mx.get_peak_memory() - base < 2 * per_layer + kept


def test_chunking_steps_aside_under_grad():
    # Evaluation is not allowed inside mx.grad; a training step gets the unchunked graph.

    model = random_model(tiny_config(num_hidden_layers=3))
    ids = mx.array(np.random.default_rng(4).integers(4, 24, size=(2, 16)))

    def loss(m):
        return m(ids).logits.mean()

    chunked = nn.value_and_grad(model, loss)(model.chunk_layers(1))
    whole = nn.value_and_grad(model, loss)(model.chunk_layers(None))
    assert same(chunked[0], whole[0])
    for (name, a), (_, b) in zip(tree_flatten(chunked[1]), tree_flatten(whole[1])):
        if mx.default_device() == mx.gpu:  # the embedding's gradient sums repeated ids with atomic
            # adds there, in no fixed order: two runs of one graph differ in the last bits
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-7, err_msg=name)
        else:
            assert same(a, b), name


def test_the_forward_warns_past_the_trained_length_where_scoring_does():
    # one limit for the forward (embed, validate) and scoring: 2,046 residues (2,048 tokens with
    # <cls> and <eos>, docs/scoring.md), so a 2,047-residue protein warns in both
    import warnings

    from esmc_mlx.errors import EsmcMlxWarning
    from esmc_mlx.runtime.tokenizer import ESMCTokenizer
    from esmc_mlx.testing import random_sequences

    model = random_model(tiny_config(num_hidden_layers=1))
    seq = random_sequences(1, 2047, 2047, seed=3)[0]
    ids = ESMCTokenizer()([seq])["input_ids"]
    with pytest.warns(EsmcMlxWarning, match="2,047 residues is longer than the 2,046 residues"):
        model(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ESMCTokenizer()([seq[:2046]])["input_ids"])
