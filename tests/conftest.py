"""Shared fixtures: tiny random-weight ESMC checkpoints built at test time, in every layout.

Tests that need torch/transformers skip without them (with the reason), module by module
(`requires_torch()` at the top) or test by test (every fixture below that builds a torch model);
the rest run anywhere, e.g. on a Mac with the runtime alone.
"""

from __future__ import annotations

import conftest_hub  # noqa: F401  (first: points HF_ENDPOINT, HF_HOME at the local test Hub before huggingface_hub loads)
import pytest

from esmc_mlx import testing

TORCH_REASON = "needs torch and transformers: pip install 'esmc-mlx[torch]'"


def requires_torch():
    """Skip the calling module (or test) unless torch and transformers import."""
    pytest.importorskip("torch", reason=TORCH_REASON)
    pytest.importorskip("transformers", reason=TORCH_REASON)


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
