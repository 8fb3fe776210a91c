"""Shared fixtures: tiny random-weight ESMC checkpoints built at test time, in every layout.

Tests that need torch/transformers skip without them (with the reason), module by module
(`requires_torch()` at the top) or test by test (every fixture below that builds a torch model);
the rest run anywhere, e.g. on a Mac with the runtime alone.
"""

from __future__ import annotations

import os

import conftest_hub  # noqa: F401  (first: points HF_ENDPOINT, HF_HOME at the local test Hub before huggingface_hub loads)

# The fp32 tests hold MLX to torch at fp32 tolerances (1e-5). MLX's CUDA backend runs float32
# matmuls as TF32 unless this is 0 (read once, at the first float32 matmul of the process); on the
# H200 test_padded_batch_matches_transformers_fp32 read rel_l2 1.2e-3 with it on. Validation sets
# the same for its own runs (validate/mlx_side.py). No effect on the CPU or Metal.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
import pytest

from esmc_mlx import testing

TORCH_REASON = "needs torch and transformers: pip install -e '.[torch]' in the clone"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu``: needs MLX on a CUDA GPU; ``@pytest.mark.cutlass``: and CUTLASS's
    extension built for it (esmc-mlx build-cutlass). Elsewhere they are skipped with the reason."""
    import mlx.core as mx

    from esmc_mlx.runtime.cuda import cutlass_qmm

    on_cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
    built = on_cuda and cutlass_qmm.available()
    for item in items:
        if "gpu" in item.keywords and not on_cuda:
            item.add_marker(pytest.mark.skip(reason="needs MLX on a CUDA GPU"))
        if "cutlass" in item.keywords and not built:
            item.add_marker(
                pytest.mark.skip(
                    reason="needs MLX on a Hopper GPU and CUTLASS's extension built (esmc-mlx build-cutlass)"
                )
            )


def requires_torch():
    """Skip the calling module (or test) unless torch and transformers import."""
    pytest.importorskip("torch", reason=TORCH_REASON)
    pytest.importorskip("transformers", reason=TORCH_REASON)


@pytest.fixture(autouse=True)
def default_device_kept():
    """A test that moves MLX's default device (bench._mlx_side does, as the process of its own
    it is written for) moves it back: the tests after it compare this process's numbers with a
    child process's, on the GPU machine too (test_distributed and test_hub's offline test read
    1e-6 apart, CPU against GPU, after test_bench had left the CPU in place)."""
    import mlx.core as mx

    device = mx.default_device()
    yield
    mx.set_default_device(device)


@pytest.fixture(autouse=True)
def settings_as_the_environment_says():
    """esmc-mlx reads its settings once a process: a test that changes ESMC_MLX_* variables
    reloads them, and they are read again once its monkeypatch has put the environment back."""
    from esmc_mlx import settings

    yield
    settings.reload()


@pytest.fixture
def on_cpu():
    """MLX's default device set to the CPU for one test (``default_device_kept`` puts it back):
    for tests of CPU behaviour (its tables, its unfused layout, no CUDA kernel), which the GPU
    machine runs too."""
    import mlx.core as mx

    mx.set_default_device(mx.cpu)


@pytest.fixture(scope="session")
def tiny_config():
    return testing.tiny_config()


@pytest.fixture(scope="session")
def reference_model(tiny_config):
    """transformers' EsmcForMaskedLM with random weights: the numerics reference."""
    requires_torch()
    return testing.random_transformers_model(tiny_config, seed=0)


@pytest.fixture(scope="session")
def checkpoints(reference_model, tmp_path_factory):
    """The same weights saved in the three input layouts."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "published": testing.write_checkpoint(reference_model, root / "published", "published"),
        "esm": testing.write_checkpoint(reference_model, root / "esm", "esm"),
        "legacy": testing.write_checkpoint(reference_model, root / "legacy" / "esmc_tiny_2024_12_v0.pth", "legacy"),
    }


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory):
    """An fp32 MLX directory converted from the published layout."""
    from esmc_mlx.convert import convert

    return convert(str(checkpoints["published"]), tmp_path_factory.mktemp("mlx") / "fp32", progress=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The packaged esmc-tiny converted into a folder of the test module's own, as a user's model
    (a module that needs another ``model`` defines its own)."""
    from esmc_mlx.convert import convert

    return convert("tiny", tmp_path_factory.mktemp("tiny") / "model", progress=False)


@pytest.fixture(scope="module")
def sae(tmp_path_factory, model):
    """A random SAE on layer 1 of ``model``, in a folder of the test module's own."""
    import json

    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    return testing.write_random_sae(tmp_path_factory.mktemp("sae") / "sae", hidden, 64, 4, [1])
