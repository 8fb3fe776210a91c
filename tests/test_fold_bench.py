"""benchmarks/fold_speed.py on tiny random ESMFold2s on the CPU: each side in its own process,
the rows and the table it writes, and --memory's peak against the targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import requires_torch

from benchmarks import fold_speed
from esmc_mlx.fold_config import FoldConfig
from esmc_mlx.testing import CHECKOUT, SHAPES, child_env


def run_bench(out, *args: str) -> tuple[dict, str]:
    command = [sys.executable, "-m", "benchmarks.fold_speed", "--shape", "tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run([*command, *args], cwd=CHECKOUT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    name = "fold_memory.json" if "--memory" in args else "fold_speed.json"
    return json.loads((out / name).read_text()), done.stdout


@pytest.mark.slow  # three fresh interpreters, one importing torch
def test_fold_speed_times_mlx_and_transformers_each_in_its_own_process(tmp_path):
    requires_torch()
    results, stdout = run_bench(
        tmp_path, "--sides", "mlx,torch-eager", "--lengths", "12", "--full-lengths", "12", "--reps", "2"
    )
    rows = {(r["side"], r["model"], r["length"]): r for r in results["rows"]}
    assert set(rows) == {(s, m, 12) for s in ("mlx", "torch-eager") for m in ("fast", "full")}
    for row in rows.values():
        assert row["finite"] and len(row["times_s"]) == 2 and row["median_s"] > 0 and row["first_s"] > 0
    assert rows["mlx", "fast", 12]["backbone"] == "float32"  # the CPU's dtype, as load_fold
    assert rows["torch-eager", "full", 12]["transformers"]
    # the config's steps and loops, reported as run
    assert results["fold"]["fast"] == {"steps": 5, "loops": 2} and results["job"]["samples"] == 1
    assert results["code"]["digest"] and "torch-eager / mlx" in results["table"][0]
    ratio = rows["torch-eager", "fast", 12]["median_s"] / rows["mlx", "fast", 12]["median_s"]
    assert f"{ratio:.2f}x" in results["table"][1] and "wrote" in stdout


@pytest.mark.slow  # two fresh interpreters
def test_fold_speed_stages_say_where_an_mlx_fold_spends_its_time(tmp_path):
    results, stdout = run_bench(
        tmp_path, "--sides", "mlx", "--lengths", "12", "--full-lengths", "--reps", "1", "--stages"
    )
    (row,) = results["rows"]
    stages = row["stages"]
    assert list(stages) == ["features", "trunk", "conditioning", "sampler", "confidence"]
    assert all(v["seconds"] >= 0 for v in stages.values()) and stages["trunk"]["peak_gb"] > row["weights_gb"]
    # the profiled fold is one fold: its stages add up to about one timed fold's time
    assert sum(v["seconds"] for v in stages.values()) < 3 * row["median_s"]
    assert "one more fold by stage: features" in stdout


@pytest.mark.slow  # three fresh interpreters
def test_fold_memory_reports_the_peak_of_a_quantized_backbone_fold(tmp_path):
    results, stdout = run_bench(tmp_path, "--memory", "--memory-lengths", "12", "24", "--steps", "3", "--loops", "1")
    assert results["job"]["steps"] == 3 and results["job"]["loops"] == 1
    rows = results["rows"]
    assert [(r["side"], r["length"]) for r in rows] == [("mlx-affine4", 12), ("mlx-affine4", 24)]
    for r in rows:
        assert r["finite"] and 0 < r["weights_gb"] < r["peak_gb"] and r["target_gb"] is None
    assert rows[0]["peak_gb"] < rows[1]["peak_gb"]  # the pair states grow with the square of the length
    # what lets the GPU run take few steps and loops: the peak is one loop's and one step's
    more, _ = run_bench(tmp_path, "--memory", "--memory-lengths", "24", "--steps", "8", "--loops", "3")
    assert more["rows"][0]["peak_gb"] == pytest.approx(rows[1]["peak_gb"], rel=0.05)


def test_published_shapes_are_esmfold2s_over_the_6b_backbone():
    fast, full = (FoldConfig.from_dict(fold_speed.fold_config(m, "published")) for m in ("fast", "full"))
    assert (fast.folding_trunk_num_hidden_layers, full.folding_trunk_num_hidden_layers) == (24, 48)
    assert not fast.msa_encoder.enabled and full.msa_encoder.enabled
    assert fast.esmc_config == full.esmc_config == SHAPES["6B"]


@pytest.mark.slow  # a fresh interpreter importing torch
def test_fold_fidelity_floor_replays_the_draws_on_the_second_device(tmp_path):
    requires_torch()
    command = [sys.executable, "-m", "benchmarks.fold_fidelity_floor", "--shape", "tiny", "--devices", "cpu,cpu"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)], cwd=CHECKOUT, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "fold_fidelity_floor.json").read_text())
    floor = results["floor"]
    # one device, the same weights and the replayed draws: the very same fold, protein by protein
    assert len(floor["per_input"]) == 4 and floor["bin_flips"] == 0
    assert all(v == 0.0 for k, v in floor.items() if k not in ("per_input", "bin_flips"))
    assert "tf32_vs_fp32" not in results and results["devices"] == ["cpu", "cpu"]


def test_the_float32_validation_checkpoint_holds_the_fidelity_floors_weights(tmp_path):
    """``fold_validate_speed --dtype float32`` writes the model ``fold_fidelity_floor`` folds (the
    same builder, seed and device), so MLX's fidelity and the floor are figures of one model."""
    requires_torch()
    import torch
    from safetensors.torch import load_file

    from benchmarks.fold_validate_speed import write_checkpoint

    raw = fold_speed.fold_config("fast", "tiny")
    write_checkpoint(tmp_path, raw, "float32", "cpu")
    written = {}
    for shard in tmp_path.glob("*.safetensors"):
        written.update(load_file(shard))
    floor = fold_speed.torch_fold_model(raw, "cpu").float().state_dict()
    assert written and set(written) == set(floor)
    assert all(written[k].dtype == torch.float32 and torch.equal(written[k], floor[k]) for k in written)
