"""`esmc-mlx bench` times torch and MLX each in its own process, on the same weights; the
runtime's plan A/B (benchmarks/paths_ab.py) times plan variants side by side."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import requires_torch

from benchmarks import paths_ab
from esmc_mlx import bench, settings
from esmc_mlx.cli import main
from esmc_mlx.runtime import dispatch
from esmc_mlx.runtime.cuda import cutlass_qmm, device


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


@pytest.mark.slow  # three fresh interpreters; inductor builds the compiled block (4 s from its disk cache, ~1 min cold)
def test_bench_times_torch_eager_and_with_its_blocks_compiled(tmp_path):
    requires_torch()
    out = CliRunner().invoke(
        main,
        [
            "bench",
            "--model",
            "tiny",
            "--shapes",
            "1x8",
            "--device",
            "cpu",
            "--torch",
            "eager,compiled",
            "-o",
            str(tmp_path),
        ],
    )
    assert out.exit_code == 0, out.output
    results = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["impl"]: r for r in results["forward"]}
    assert set(rows) == {"torch", "torch-compiled", "mlx"} and results["torch_modes"] == ["eager", "compiled"]
    assert rows["torch-compiled"]["compile_s"] > 0 and "compile_s" not in rows["torch"]
    assert results["agreement"]["tiny torch-compiled"] < 1e-5  # the compiled blocks compute the same function
    mlx = rows["mlx"]
    assert mlx["speedup_vs_torch"] == pytest.approx(rows["torch"]["median_ms"] / mlx["median_ms"])
    assert mlx["speedup_vs_torch_compiled"] == pytest.approx(rows["torch-compiled"]["median_ms"] / mlx["median_ms"])
    summary = [line for line in out.output.splitlines() if "eager / MLX" in line]
    assert len(summary) == 1 and "compiled / MLX" in summary[0] and "compiled in" in summary[0], out.output
    assert results["provenance"]["commit"] == bench.source_commit()[0] and results["provenance"]["device"]


def test_bench_compiles_the_torch_side_by_default_on_a_gpu_only(tmp_path, monkeypatch):
    """Each torch mode is a side of its own; the first one saves the weights the others and MLX
    load. MLX's rows get torch time / MLX time for each mode, and the summary prints both."""
    jobs = []

    def side(kind, job, log):
        jobs.append((kind, job.get("torch_mode"), job.get("save")))
        if kind == "torch":
            impl = bench.TORCH_MODES[job["torch_mode"]]
            ms = {"torch": 10.0, "torch-compiled": 8.0}[impl]
            row = {"model": "tiny", "batch": 1, "length": 8, "impl": impl, "median_ms": ms, "tflops": 1.0}
            return {"rows": [row | ({"compile_s": 2.5} if impl == "torch-compiled" else {})], "machine": {}}
        row = {"model": "tiny", "batch": 1, "length": 8, "impl": "mlx", "median_ms": 4.0, "tflops": 2.5}
        return {"rows": [row], "agreement": {}, "quantized": []}

    monkeypatch.setattr(bench, "_side", side)
    monkeypatch.setattr(bench.mx, "is_available", lambda device: True)
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: True)  # torch as if installed
    lines = []
    bench.run(("tiny",), [(1, 8)], "cpu", out_dir=tmp_path, log=lines.append)
    assert jobs == [("torch", "eager", True), ("mlx", None, None)]
    jobs.clear()
    results = bench.run(("tiny",), [(1, 8)], "gpu", out_dir=tmp_path, log=lines.append)
    assert jobs == [("torch", "eager", True), ("torch", "compiled", False), ("mlx", None, None)]
    mlx = next(r for r in results["forward"] if r["impl"] == "mlx")
    assert (mlx["speedup_vs_torch"], mlx["speedup_vs_torch_compiled"]) == (2.5, 2.0)
    assert any(
        "torch 10.00 ms" in line and "compiled in 2.5 s" in line and "eager / MLX 2.50x, compiled / MLX 2.00x" in line
        for line in lines
    ), lines
    jobs.clear()
    bench.run(("tiny",), [(1, 8)], "cpu", out_dir=tmp_path, log=lines.append, torch_modes=("compiled",))
    assert jobs == [("torch", "compiled", True), ("mlx", None, None)]  # the only torch side saves the weights


def test_bench_refuses_a_torch_mode_it_does_not_have(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "_side", lambda *a, **k: pytest.fail("timed"))
    out = CliRunner().invoke(main, ["bench", "--model", "tiny", "--torch", "eager,fast", "-o", str(tmp_path)])
    assert out.exit_code == 2 and "--torch" in out.output and "eager, compiled" in out.output, out.output
    assert bench.parse_torch_modes("compiled, eager,compiled") == ("compiled", "eager")


def test_bench_without_torch_times_mlx_alone(tmp_path):
    out = CliRunner().invoke(
        main, ["bench", "--model", "tiny", "--shapes", "1x8", "--device", "cpu", "--no-torch", "-o", str(tmp_path)]
    )
    assert out.exit_code == 0, out.output
    results = json.loads((tmp_path / "bench.json").read_text())
    assert [r["impl"] for r in results["forward"]] == ["mlx"] and results["agreement"] == {}
    assert results["machine"]["cutlass_qmm"] is False and "CUTLASS" not in out.output  # not on a CPU


def test_bench_says_when_quantized_layers_use_cutlass(tmp_path, monkeypatch):
    """Its ratios move with the extension, so the bench records and prints whether it is on: on
    a GPU job where it is built, never on a CPU job (the GPU beside it may have it)."""
    hopper = dispatch.Target.of(dispatch.Device("cuda", "sm_90a", 132), cutlass=True)
    monkeypatch.setattr(dispatch, "current", lambda: hopper)
    out = CliRunner().invoke(
        main, ["bench", "--model", "tiny", "--shapes", "1x8", "--device", "cpu", "--no-torch", "-o", str(tmp_path)]
    )
    assert out.exit_code == 0, out.output
    assert json.loads((tmp_path / "bench.json").read_text())["machine"]["cutlass_qmm"] is False
    assert "CUTLASS" not in out.output
    assert bench.machine(with_torch=False, device="gpu")["cutlass_qmm"] is True
    lines = []
    monkeypatch.setattr(bench, "_side", lambda kind, job, log: {"rows": [], "agreement": {}, "quantized": []})
    monkeypatch.setattr(bench.mx, "is_available", lambda device: True)
    bench.run(models=("tiny",), shapes=[(1, 8)], device="gpu", with_torch=False, out_dir=tmp_path, log=lines.append)
    assert "CUTLASS mixed-input GEMM built (quantized layers use it)" in lines[0]


def test_bench_says_why_a_hopper_gpu_runs_quantized_layers_without_cutlass(tmp_path, monkeypatch):
    """On a Hopper GPU without the extension (not built for this MLX, or turned off) a bench of
    quantized twins says so and names the fix: their ratios are the slower path's. Said for
    quantized twins only, and nowhere the kernel cannot run."""
    monkeypatch.setattr(bench, "_side", lambda kind, job, log: {"rows": [], "agreement": {}, "quantized": []})
    monkeypatch.setattr(bench.mx, "is_available", lambda device: True)
    monkeypatch.setattr(cutlass_qmm, "_extension", lambda: None)  # not built

    def header(quant=("affine4",), device="gpu"):
        lines = []
        bench.run(("tiny",), [(1, 8)], device, quant=quant, with_torch=False, out_dir=tmp_path, log=lines.append)
        return lines[0]

    monkeypatch.setattr(device, "arch", lambda: "sm_90a")
    assert header().endswith(
        "quantized layers without CUTLASS's mixed-input GEMM: not built for this MLX and esmc-mlx (esmc-mlx build-cutlass builds it)"
    )
    with settings.override(kernels=False):
        assert header().endswith("without CUTLASS's mixed-input GEMM: turned off (ESMC_MLX_KERNELS=0)")
    assert "CUTLASS" not in header(quant=()) and "CUTLASS" not in header(device="cpu")
    monkeypatch.setattr(device, "arch", lambda: "sm_80")  # no Hopper GPU: nothing to build
    assert "CUTLASS" not in header()


def test_bench_says_when_the_float_model_moved_across_the_run(tmp_path, monkeypatch, capsys):
    """Each quantized row carries the float model's lowest and highest median at its shape over
    the whole run; past FLOAT_SPREAD the shape is named as one whose ratios move with the
    machine, and within it nothing is said. Timings are stand-ins (float 10 ms in the forward
    section; 13 ms (1x8) and 10.5 ms (2x8) beside the twin, which takes 14 ms)."""
    calls = []

    def timed(_t, models, _config, shapes, *_a, **_k):
        calls.append(list(models))
        twin = len(calls) > 1
        rows = []
        for batch, length in shapes:
            for impl in models:
                ms = 14.0 if impl == "affine4" else (13.0 if batch == 1 else 10.5) if twin else 10.0
                rows.append({"batch": batch, "length": length, "impl": impl, "median_ms": ms})
        return rows

    monkeypatch.setattr(bench, "compare_forward", timed)
    job = {"device": "cpu", "dtype": "float32", "model": "tiny", "dir": str(tmp_path), "variants": []}
    out = bench._mlx_side({**job, "shapes": [(1, 8), (2, 8)], "quant": ["affine4"], "budget_s": 0.01})
    assert calls == [["mlx"], ["mlx", "affine4"]]
    rows = {(r["batch"], r["length"]): r for r in out["quantized"]}
    assert rows[(1, 8)]["float_ms_range"] == [10.0, 13.0] and rows[(1, 8)]["vs_float"] == 14.0 / 13.0
    assert rows[(2, 8)]["float_ms_range"] == [10.0, 10.5]
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert len(notes) == 1 and "1x8" in notes[0] and "10.00 to 13.00 ms" in notes[0], notes
    assert bench.float_ranges([]) == {}


def test_bench_into_an_impossible_folder_fails_before_timing(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(bench, "_side", lambda *a, **k: pytest.fail("timed first"))
    out = CliRunner().invoke(main, ["bench", "--model", "tiny", "--no-torch", "-o", str(tmp_path / "notes.txt" / "b")])
    assert out.exit_code == 1 and "Traceback" not in out.output, out.output
    assert out.output.count("Error:") == 1 and "notes.txt is a file" in out.output, out.output


def test_bench_on_a_gpu_mlx_has_not_fails_before_timing(tmp_path, monkeypatch):
    """On a CPU-only MLX the GPU job fails at once (not after the torch side, with the child's traceback)."""
    monkeypatch.setattr(bench.mx, "is_available", lambda device: device != bench.mx.gpu)
    monkeypatch.setattr(bench, "_side", lambda *a, **k: pytest.fail("timed first"))
    out = CliRunner().invoke(main, ["bench", "--model", "tiny", "--device", "gpu", "-o", str(tmp_path / "b")])
    assert out.exit_code == 1 and out.output.count("Error:") == 1, out.output
    assert "--device gpu: this MLX has no GPU backend" in out.output and not (tmp_path / "b").exists()


@pytest.mark.parametrize("shapes", ["0x16", "1x0", "", "1x2,0x4"])
def test_bench_refuses_shapes_it_cannot_time(tmp_path, monkeypatch, shapes):
    """0x16 / 1x0 crashed the timing child (ZeroDivisionError traceback); "" timed the defaults."""
    monkeypatch.setattr(bench, "_side", lambda *a, **k: pytest.fail("timed"))
    out = CliRunner().invoke(main, ["bench", "--model", "tiny", "--no-torch", "--shapes", shapes, "-o", str(tmp_path)])
    assert out.exit_code == 2 and "--shapes" in out.output and "BATCHxLENGTH" in out.output, out.output


def test_time_interleaved_times_each_fn_right_after_its_own_call_and_rotates_the_order():
    """Every timed call follows a call of the same fn (a model timed after another one reads
    slower), and every fn runs first equally often."""
    order, timed = [], []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    real_clock = bench.time.perf_counter

    def clock():  # how many calls had run when the clock was read
        timed.append(len(order))
        return real_clock()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench.time, "perf_counter", clock)
        result = bench.time_interleaved(fns, warmup=1, reps=6)
    assert order[:3] == ["a", "b", "c"]  # the warm-up, in order
    turns = order[3:]
    assert len(turns) == 6 * 3 * 2
    rounds = [turns[6 * r : 6 * r + 6 : 2] for r in range(6)]
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(turns[i] == turns[i + 1] for i in range(0, len(turns), 2))  # a call, then its timed twin
    # The clock starts (every other reading; the warm-up's six come first) after each turn's first call.
    assert timed[6::2] == [3 + 2 * turn + 1 for turn in range(6 * 3)]
    for name in "abc":
        assert [r.index(name) for r in rounds].count(0) == 2
    assert all(result[name]["reps"] == 6 for name in "abc")


def test_paths_ab_times_plan_variants_beside_bf16_and_compares_their_logits(tmp_path, on_cpu):
    """Each side is planned as it says (a forced path, no custom kernels, a replaced table
    field), timed beside the float model in one process; every side computes the same model."""
    out = tmp_path / "ab.json"
    sides = "shipped,path=quantized,mlx-ops,crossover={'all':{'affine':2}}"
    result = paths_ab.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--modes",
            "affine4",
            "--shapes",
            "1x16",
            "--sides",
            sides,
            "--budget",
            "0.01",
            "--json",
            str(out),
        ]
    )
    (row,) = result["rows"]
    record = json.loads(out.read_text())
    assert record["rows"] == [row] and record["provenance"]["backend"] == "cpu"
    for side in sides.split(","):
        assert row[f"{side}_ms"] > 0 and row[f"{side}_over_bf16"] > 0
        assert row[f"{side}_logits_rel_l2"] < 1e-5  # the same model whichever path
    shipped = dispatch.current()
    w = dispatch.Weight("affine", 4, 64, 256, 256, "float32")
    assert dispatch.linear(w, 16, "float32", shipped).path == "dequantize"  # the CPU table: from 8 tokens
    assert dispatch.linear(w, 16, "float32", paths_ab.side_target("path=quantized", shipped)).path == "quantized"
    assert (
        dispatch.linear(w, 4, "float32", paths_ab.side_target("crossover={'all':{'affine':2}}", shipped)).path
        == "dequantize"
    )
    assert paths_ab.side_target("mlx-ops", shipped).kernels is False
    # mode float: the float model itself planned on each side (its fused steps' tables)
    args = ["--model", "tiny", "--device", "cpu", "--modes", "float", "--shapes", "1x16", "--budget", "0.01"]
    (row,) = paths_ab.main([*args, "--sides", "shipped,add_norm_from=0"])["rows"]
    assert row["mode"] == "float" and row["add_norm_from=0_logits_rel_l2"] == 0.0


@pytest.mark.parametrize("side", ["path=bogus", "nonsense", "no_such_field=1", "arch=sm_1x"])
def test_paths_ab_refuses_a_side_it_cannot_plan(side):
    with pytest.raises(ValueError, match="side|architecture"):
        paths_ab.side_target(side, dispatch.current())
