"""`esmc-mlx bench` times torch and MLX each in its own process, on the same weights."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import requires_torch

from benchmarks import crossover_forward, dequant_cost, host_overhead, kernels_ab
from benchmarks.crossover_forward import crossover
from esmc_mlx import bench
from esmc_mlx.cli import main
from esmc_mlx.runtime import cutlass_qmm, kernels, quantized


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
    assert results["machine"]["cutlass_qmm"] is False and "CUTLASS" not in out.output  # not on a CPU


def test_bench_says_when_quantized_layers_use_cutlass(tmp_path, monkeypatch):
    """Its ratios move with the extension, so the bench records and prints whether it is on: on
    a GPU job where it is built, never on a CPU job (not even on a Hopper machine's CPU, whose
    GPU beside it has it)."""
    monkeypatch.setattr(cutlass_qmm, "enabled", lambda: True)
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

    monkeypatch.setattr(cutlass_qmm, "runs_here", lambda: True)
    assert header().endswith(
        "quantized layers without CUTLASS's mixed-input GEMM: not built for this MLX and esmc-mlx (esmc-mlx build-cutlass builds it)"
    )
    monkeypatch.setenv(cutlass_qmm.ENV, "0")
    assert header().endswith(f"without CUTLASS's mixed-input GEMM: turned off ({cutlass_qmm.ENV}=0)")
    assert "CUTLASS" not in header(quant=()) and "CUTLASS" not in header(device="cpu")
    monkeypatch.setattr(cutlass_qmm, "runs_here", lambda: False)  # no Hopper GPU: nothing to build
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
    # on a CPU-only MLX: one line before any timing, not the torch side timed and then the MLX
    # child's traceback ("Cannot set gpu device without gpu backend")
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


def test_crossover_takes_ties_and_needs_every_larger_count():
    def rows(*pairs):
        return [{"tokens": t, "quantized_ms": 1.0, "dequantize_ms": d} for t, d in pairs]

    assert crossover(rows((32, 0.9), (64, 1.02), (128, 0.5))) == 32  # within 3%: a tie, dequantize
    assert crossover(rows((32, 0.5), (64, 1.2), (128, 0.5))) == 128  # 64 breaks the run
    assert crossover(rows((32, 0.5), (64, 0.5), (128, 1.5))) is None


def test_crossover_forward_times_both_paths_and_writes_json(tmp_path):
    """A CPU smoke run of the benchmark CROSSOVER_TOKENS comes from: both sides timed per count,
    the crossover derived from those rows, the JSON on disk."""
    out = tmp_path / "x.json"
    argv = ["--model", "tiny", "--device", "cpu", "--tokens", "16,32", "--modes", "affine4", "--budget", "0.05"]
    result = crossover_forward.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text())["crossover_tokens"] == result["crossover_tokens"]
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [16, 32] and all(r["quantized_ms"] > 0 < r["dequantize_ms"] for r in rows)
    assert result["crossover_tokens"]["affine4"] == crossover_forward.crossover(rows)


def test_crossover_forward_times_the_bf16_model_beside_a_path(tmp_path):
    """--sides bf16,dequantize: the unquantized model timed beside one path; no crossover then
    (it needs both paths)."""
    argv = ["--model", "tiny", "--device", "cpu", "--tokens", "16", "--modes", "affine4", "--budget", "0.05"]
    result = crossover_forward.main([*argv, "--sides", "bf16,dequantize"])
    (row,) = result["rows"]
    assert row["bf16_ms"] > 0 < row["dequantize_ms"] and "quantized_ms" not in row
    assert result["crossover_tokens"] == {}
    with pytest.raises(SystemExit):  # a misspelt side is refused, not timed under the default policy
        crossover_forward.main([*argv, "--sides", "bf16,dequantise"])


def test_kernels_ab_sees_whether_the_other_kernels_give_the_same_logits(tmp_path):
    """A CPU smoke run: this checkout's kernels.py against an identical copy gives the same
    logits, against one whose dequantize doubles the weights it does not; runtime/quantized.py
    calls this checkout's kernels again afterwards."""
    source = Path(kernels.__file__).read_text()
    same, doubled = tmp_path / "same.py", tmp_path / "doubled.py"
    same.write_text(source)
    assert source.count("        return mx.dequantize(\n") == 1
    doubled.write_text(source.replace("        return mx.dequantize(\n", "        return 2 * mx.dequantize(\n"))
    argv = ["--model", "tiny", "--device", "cpu", "--shapes", "1x16", "--modes", "affine4", "--budget", "0.05"]
    for path, expect in ((same, True), (doubled, False)):
        out = tmp_path / f"{path.stem}.json"
        result = kernels_ab.main([*argv, "--against", str(path), "--json", str(out)])
        (row,) = json.loads(out.read_text())["rows"]
        assert row == result["rows"][0] and row["same_logits"] is expect
        assert row["this_ms"] > 0 < row["against_ms"] and row["bf16_ms"] > 0
        assert quantized.kernels is kernels


NCU_CSV = """==PROF== Connected to process 992 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","992","python3.12","127.0.0.1","mlx::custom_kernel_esmc_qmmwg_affine_fast_4_64_bfloat16_t(const __nv_bfloat16 *)","1","14","(256, 1, 1)","(60, 2, 2)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","41,664"
"1","992","python3.12","127.0.0.1","void mlx::col_reduce_small<float, float, mlx::Sum, 4>(const T1 *)","1","14","(1024, 1, 1)","(1920, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","9,856"
"2","992","python3.12","127.0.0.1","nvjet_sm90_tst_112x128_64x7_2x1_v_bz_TNN","1","14","(384, 1, 1)","(80, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","28.5"
"3","992","python3.12","127.0.0.1","mlx::custom_kernel_esmc_dequantize_mxfp4_4_32_bfloat16_t_4_32_1(const unsigned int *)","1","14","(256, 1, 1)","(1056, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","72.0"
"4","992","python3.12","127.0.0.1","cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_32","1","14","(384, 1, 1)","(80, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","7,392"
"5","992","python3.12","127.0.0.1","mlx::custom_kernel_esmc_qkv_heads_bfloat16_t_40(const __nv_bfloat16 *)","1","14","(320, 1, 1)","(256, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","5,408"
"6","992","python3.12","127.0.0.1","void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>>>(T1::Params)","1","14","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","15.5"
"7","992","python3.12","127.0.0.1","esmc_qmm::sum_splits(const float4 *, const uint2 *, uint2 *, int, int, unsigned short)","1","14","(256, 1, 1)","(640, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","4,768"
"8","992","python3.12","127.0.0.1","void mlx::gather<__nv_bfloat16, long long, 1, 2, int>(const T1 *, T1 *)","1","14","(256, 1, 1)","(640, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","155.0"
==PROF== Disconnected from process 992
"""


def test_host_overhead_groups_nsight_compute_kernel_times(tmp_path):
    """Nsight Compute's CSV (its log lines around it, ns and us, thousands separators) grouped
    by kernel kind, summed and ranked; a CPU smoke run of the wall/host measurement."""
    csv = tmp_path / "k.csv"
    csv.write_text(NCU_CSV)
    table = host_overhead.main(["--kernels", str(csv), "--json", str(tmp_path / "k.json")])[str(csv)]
    assert table["kernels"] == 9
    without = (41664 + 9856 + 28500 + 72000 + 7392 + 5408 + 15500 + 4768) * 1e-6
    assert table["without_gather_ms"] == pytest.approx(without)
    assert table["total_ms"] == pytest.approx(without + 155000e-6)
    ms = {k: round(v["ms"] * 1e6) for k, v in table["groups"].items()}
    assert ms == {
        "fused qmm": 41664,
        "other": 9856,
        "gemm": 28500,
        "dequantize": 72000,
        "attention": 7392,
        "row kernels": 5408,
        "cutlass qmm": 15500 + 4768,  # the extension's GEMM and its split-K sum
        "embedding gather": 155000,
    }
    assert table["top"][0]["name"].startswith("void mlx::gather")
    out = host_overhead.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--modes",
            "bf16,affine4",
            "--shapes",
            "1x16",
            "--budget",
            "0.05",
            "--reps",
            "2",
        ]
    )
    assert [r["mode"] for r in out["rows"]] == ["bf16", "affine4"]
    assert all(r["wall_ms"] > 0 < r["host_ms"] and r["build_ms"] <= r["host_ms"] for r in out["rows"])


def test_dequant_cost_reads_gpu_time_by_side_and_times_the_host(tmp_path):
    """The profile window's kernels (per weight and mode: reps x mx.dequantize, ours, fill, as
    profile() issues them) read back by side in order, medians and TB/s; a CPU smoke run of
    the host measurement, whose rows must add up (built <= launched <= done)."""
    header = NCU_CSV.splitlines()[1]
    names = {
        "mlx": "void mlx::affine_dequantize<__nv_bfloat16, 64, 4>(const",
        "ours": "mlx::custom_kernel_esmc_dequantize1_affine_4_64",
    }
    names["fill"] = "void mlx::copy_s<__nv_bfloat16, __nv_bfloat16, unsigned int>"
    labels = dequant_cost.labels("tiny", ["affine4"])
    lines, reps, want = [header], 2, {}
    for i, label in enumerate(labels):
        for r in range(reps):
            for j, side in enumerate(dequant_cost.GPU_SIDES):
                us = 10 * i + 3 * j + r  # medians: 10i + 3j + 0.5
                lines.append(
                    f'"0","1","p","h","{names[side]}","1","14","(256, 1, 1)","(8, 1, 1)","0","9.0","s","gpu__time_duration.sum","us","{us}"'
                )
        want[label] = {side: 10 * i + 3 * j + 0.5 for j, side in enumerate(dequant_cost.GPU_SIDES)}
    csv = tmp_path / "dq.csv"
    csv.write_text("==PROF== Connected\n" + "\n".join(lines) + "\n")
    argv = ["--model", "tiny", "--modes", "affine4", "--reps", str(reps), "--device", "cpu"]
    rows = dequant_cost.main([*argv, "--kernels", str(csv)])["gpu"]
    assert [r["weight"] for r in rows] == labels and len(labels) == 4
    for row in rows:
        assert {side: row[f"{side}_us"] for side in dequant_cost.GPU_SIDES} == want[row["weight"]]
        n, k = map(int, row["weight"].split()[0].split("x"))
        assert row["ours_tb_s"] == pytest.approx(n * k * 2 / row["ours_us"] / 1e6)
    out = tmp_path / "host.json"
    dequant_cost.main(
        ["--model", "tiny", "--modes", "affine4,mxfp4", "--reps", "2", "--device", "cpu", "--json", str(out)]
    )
    host = json.loads(out.read_text())["host"]
    assert [(r["mode"], r["side"]) for r in host] == [
        (m, s) for m in ("affine4", "mxfp4") for s in ("mlx eager", "mlx compiled", "ours eager", "ours compiled")
    ]
    assert all(r["calls"] == 4 * 2 and 0 < r["built_ms"] <= r["launched_ms"] <= r["done_ms"] for r in host)
    with pytest.raises(SystemExit):
        dequant_cost.main([*argv, "--modes", "affine3"])


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


def test_forward_fns_sets_a_side_s_environment_for_its_call_only(monkeypatch):
    """A side's switches (``env``) are in os.environ while its model runs, and gone after it,
    also when the forward raises."""
    monkeypatch.delenv("ESMC_MLX_TEST_SWITCH", raising=False)
    seen = []

    class Model:
        def __init__(self, fail=False):
            self.fail = fail

        def __call__(self, ids):
            seen.append(os.environ.get("ESMC_MLX_TEST_SWITCH"))
            if self.fail:
                raise RuntimeError("forward failed")
            return types.SimpleNamespace(logits=mx.zeros(ids.shape))

    env = {"on": {"ESMC_MLX_TEST_SWITCH": "1"}, "broken": {"ESMC_MLX_TEST_SWITCH": "2"}}
    fns = bench.forward_fns(None, {"off": Model(), "on": Model(), "broken": Model(fail=True)}, 1, 4, env=env)
    fns["on"]()
    fns["off"]()
    with pytest.raises(RuntimeError, match="forward failed"):
        fns["broken"]()
    assert seen == ["1", None, "2"]
    assert "ESMC_MLX_TEST_SWITCH" not in os.environ
