"""`python -m benchmarks.compare NEW OLD` says which figures of a benchmark moved by more than the
runs' own noise, on synthetic records of the shapes the benchmarks write; and every benchmark's
JSON carries its provenance (the source commit, the device)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import compare, save_json
from esmc_mlx import bench


def forward_row(model, batch, length, impl, median, best, **extra):
    return {"model": model, "batch": batch, "length": length, "impl": impl, "median_ms": median, "min_ms": best,
            "reps": 7, "tflops": 1.0, **extra}  # fmt: skip


def bench_record(rows, device="NVIDIA H200 (sm_90)", commit="a" * 40):
    return {"provenance": {"commit": commit, "dirty": False, "device": device}, "forward": rows, "quantized": []}


def names(found) -> set[str]:
    return {entry[0] if isinstance(entry, tuple) else entry for entry in found}


def test_a_figure_that_moved_past_the_noise_is_flagged_and_one_within_it_is_not():
    old = bench_record(
        [
            forward_row("6B", 16, 256, "mlx+fuse+compile", 93.0, 92.5),  # steady: spread 0.5%
            forward_row("6B", 1, 256, "mlx+fuse+compile", 15.0, 12.0),  # host-bound: spread 20%
            forward_row("6B", 64, 512, "torch", 931.6, 930.0),
        ]
    )
    new = bench_record(
        [
            forward_row("6B", 16, 256, "mlx+fuse+compile", 101.0, 100.5),  # +8.6%: past the 5% floor
            forward_row("6B", 1, 256, "mlx+fuse+compile", 18.0, 13.0),  # +20%: inside 3 x 20%
            forward_row("6B", 64, 512, "torch", 900.0, 899.0),  # -3.4%: inside the floor
        ]
    )
    result = compare.compare(new, old)
    assert names(result.worse) == {"forward[model=6B batch=16 length=256 impl=mlx+fuse+compile] median_ms"}
    assert not result.better and not result.missing and not result.new
    assert len(result.steady) == 2
    (_, new_fig, old_fig, change) = result.worse[0]
    assert change == pytest.approx(101.0 / 93.0 - 1) and old_fig.spread == pytest.approx(0.5 / 93.0)


def test_the_noise_rule_is_k_times_the_larger_spread_with_a_floor():
    fig = compare.Figure
    assert compare.moved(fig(1.04, None, "s"), fig(1.0, None, "s")) is None  # under the floor
    assert compare.moved(fig(1.06, None, "s"), fig(1.0, None, "s")) == pytest.approx(0.06)
    # the larger of the two runs' spreads counts: 10% -> a change must pass 30%
    assert compare.moved(fig(1.25, 0.01, "s"), fig(1.0, 0.10, "s")) is None
    assert compare.moved(fig(1.35, 0.01, "s"), fig(1.0, 0.10, "s")) == pytest.approx(0.35)
    assert compare.NOISE_K == 3 and compare.NOISE_FLOOR == 0.05  # what docs/benchmarks.md states


def test_faster_is_better_for_times_and_higher_for_rates():
    old = {"mlx": {"median_s": 0.0628, "tokens_per_s": 65175.0}, "torch": {"median_s": 0.204}}
    new = {"mlx": {"median_s": 0.0915, "tokens_per_s": 44778.0}, "torch": {"median_s": 0.150}}
    result = compare.compare(new, old)
    assert names(result.worse) == {"mlx median_s", "mlx tokens_per_s"}
    assert names(result.better) == {"torch median_s"}


def test_missing_and_new_shapes_are_reported():
    old = bench_record(
        [forward_row("300M", 1, 256, "torch", 18.2, 15.0), forward_row("300M", 64, 512, "torch", 85, 84)]
    )
    new = bench_record(
        [forward_row("300M", 1, 256, "torch", 18.0, 15.0), forward_row("300M", 16, 256, "torch", 19, 14)]
    )
    result = compare.compare(new, old)
    assert result.missing == ["forward[model=300M batch=64 length=512 impl=torch] median_ms"]
    assert result.new == ["forward[model=300M batch=16 length=256 impl=torch] median_ms"]
    assert names(result.steady) == {"forward[model=300M batch=1 length=256 impl=torch] median_ms"}


def test_figures_are_found_by_name_in_any_benchmarks_json():
    record = {
        "job": {"model": "300M", "steps": 20},  # settings, not figures
        "provenance": {"commit": "x"},
        "mlx": {"median_s": 0.1, "times_s": [0.1, 0.09, 0.12], "memory_limit_gb": 98.7, "peak_memory_gb": 9.5},
        "torch_peft": {"median_s": 0.2},  # an older record's name for the torch side
        "rows": [
            {"shape": "6B", "quant": None, "length": 4096, "mode": "chunked", "median_s": 0.11, "reps": 3},
            {"shape": "6B", "quant": "mxfp4", "length": 4096, "mode": "chunked", "median_s": 0.12},
        ],
        "runs": [{"side": "embed", "seconds": 16.6}, {"side": "embed", "seconds": 17.0}],
        "one_seq_per_s": 1472.3,
        "ratio": 1.45,  # derived, unit-less: not compared
    }
    found = compare.figures(record)
    assert set(found) == {
        "mlx median_s",
        "mlx peak_memory_gb",
        "torch median_s",
        "rows[shape=6B length=4096 mode=chunked] median_s",
        "rows[shape=6B quant=mxfp4 length=4096 mode=chunked] median_s",
        "runs[side=embed] seconds",
        "runs[side=embed #2] seconds",
        "one_seq_per_s",
    }
    assert found["mlx median_s"].spread == pytest.approx(0.1)  # from its repeats: (0.1 - 0.09) / 0.1
    assert found["one_seq_per_s"].higher_is_better and found["one_seq_per_s"].spread is None


def test_the_report_names_both_runs_and_notes_different_devices_or_jobs():
    old = bench_record([forward_row("6B", 1, 256, "torch", 38.2, 37.0)], device="NVIDIA H100 (sm_90)")
    new = bench_record([forward_row("6B", 1, 256, "torch", 38.0, 37.0)], commit="b" * 40)
    lines = compare.report(compare.compare(new, old), new, old)
    assert lines[0] == "new: bbbbbbbbbb, NVIDIA H200 (sm_90)" and lines[1].startswith("old: aaaaaaaaaa")
    assert any("different devices" in line for line in lines)
    jobs = compare.report(compare.compare({"job": {"model": "tiny"}}, {"job": {"model": "300M"}}), {}, {})
    assert not any("different jobs" in line for line in jobs)  # the records passed to report hold no job
    a, b = {"job": {"model": "tiny", "shape": "4x64"}}, {"job": {"model": "300M", "shape": "4x64"}}
    assert any("model tiny / 300M" in line for line in compare.report(compare.compare(a, b), a, b))


def test_the_command_exits_1_when_a_figure_got_worse(tmp_path):
    old = tmp_path / "old.json"
    new = tmp_path / "new.json"
    old.write_text(json.dumps({"mlx": {"median_s": 0.0628}}))
    new.write_text(json.dumps({"mlx": {"median_s": 0.0915}}))
    assert compare.main([str(new), str(old)]) == 1
    assert compare.main([str(old), str(new)]) == 0  # faster: reported, not a failure
    assert compare.main([str(old), str(old)]) == 0


def test_save_json_records_the_source_commit_and_the_device(tmp_path):
    path = tmp_path / "deep" / "out.json"
    assert save_json(path, {"rows": []}, device="cpu") == {"rows": []}
    record = json.loads(path.read_text())
    p = record["provenance"]
    assert p["backend"] == "cpu" and p["device"] and p["mlx"] and p["date"]
    assert p["commit"] == bench.source_commit()[0]
    save_json(None, {"rows": []})  # no --json: nothing written


def git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_the_commit_comes_from_git_or_from_the_stamp_of_a_copy_git_lacks(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "esmc_mlx").mkdir(parents=True)
    (checkout / "esmc_mlx" / "x.py").write_text("a = 1\n")
    git(checkout, "init", "-q")
    git(checkout, "add", ".")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert bench.source_commit(checkout) == (head.strip(), False)
    (checkout / "untracked.txt").write_text("not part of the source")
    assert bench.source_commit(checkout) == (head.strip(), False)  # untracked files do not count
    (checkout / "esmc_mlx" / "x.py").write_text("a = 2\n")
    assert bench.source_commit(checkout) == (head.strip(), True)
    assert bench.source_stamp(checkout) == head.strip() + "+dirty"

    copy = tmp_path / "copy"  # what travels to a GPU host: the files, no .git
    (copy / "esmc_mlx").mkdir(parents=True)
    assert bench.source_commit(copy) == (None, None)
    (copy / bench.SOURCE_STAMP).write_text(head.strip() + "+dirty\n")
    assert bench.source_commit(copy) == (head.strip(), True)
    (checkout / bench.SOURCE_STAMP).write_text(head.strip() + "\n")  # a commit git has: git decides
    assert bench.source_commit(checkout) == (head.strip(), True)
    newer = "f" * 40  # a copy of a newer tree over a stale clone (a GPU host's): the stamp decides
    (checkout / bench.SOURCE_STAMP).write_text(newer + "\n")
    assert bench.source_commit(checkout) == (newer, False)
    (checkout / bench.SOURCE_STAMP).unlink()
    inside = checkout / "venv" / "site"  # a folder inside another repository is not its checkout
    inside.mkdir(parents=True)
    assert bench.source_commit(inside) == (None, None)
