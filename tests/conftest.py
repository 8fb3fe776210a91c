"""Shared fixtures: tiny random-weight ESMC checkpoints built at test time, in every layout."""

from __future__ import annotations

import conftest_hub  # noqa: F401  (first: points HF_ENDPOINT, HF_HOME at the local test Hub before huggingface_hub loads)
import pytest

torch = pytest.importorskip("torch")

import esmc_mlx  # noqa: E402,F401  (loads the fast BLAS before mlx)
from esmc_mlx import testing  # noqa: E402


@pytest.fixture(scope="session")
def tiny_config():
    return testing.tiny_config()


@pytest.fixture(scope="session")
def reference_model(tiny_config):
    """transformers' EsmcForMaskedLM with random weights: the numerics reference."""
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
