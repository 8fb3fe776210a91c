"""`esmc-mlx bench` times torch and MLX each in its own process, on the same weights."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import requires_torch

from esmc_mlx.cli import main


@pytest.mark.slow  # two fresh interpreters, one importing torch
def test_bench_runs_each_side_in_its_own_process_on_the_same_weights(tmp_path):
    requires_torch()
    out = CliRunner().invoke(
        main, ["bench", "--model", "tiny", "--shapes", "1x8,2x8", "--device", "cpu", "-o", str(tmp_path)]
    )
    assert out.exit_code == 0, out.output
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["isolation"] == "each side in its own process"
    impls = {(r["impl"], r["batch"], r["length"]) for r in results["forward"]}
    assert impls == {("torch", 1, 8), ("torch", 2, 8), ("mlx", 1, 8), ("mlx", 2, 8)}
    assert results["agreement"]["tiny mlx"] < 1e-5  # MLX ran the torch side's weights
    assert all(r["speedup_vs_torch"] > 0 for r in results["forward"] if r["impl"] == "mlx")
    assert "torch" in results["machine"] and "blas" in results["machine"]


def test_bench_without_torch_times_mlx_alone(tmp_path):
    out = CliRunner().invoke(
        main, ["bench", "--model", "tiny", "--shapes", "1x8", "--device", "cpu", "--no-torch", "-o", str(tmp_path)]
    )
    assert out.exit_code == 0, out.output
    results = json.loads((tmp_path / "bench.json").read_text())
    assert [r["impl"] for r in results["forward"]] == ["mlx"] and results["agreement"] == {}
