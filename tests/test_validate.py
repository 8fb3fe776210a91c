"""Validation: correct artifacts pass, damaged ones fail with the check that caught them named,
the layer-by-layer references equal the whole-model ones, and the report is complete."""

from __future__ import annotations

import json
import math
import shutil

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import requires_torch

from esmc_mlx import settings
from esmc_mlx.cli import convert_main, main
from esmc_mlx.convert import convert
from esmc_mlx.resolve import PACKAGED
from esmc_mlx.validate import ValidationError, mlx_side, reference, thresholds, validate
from esmc_mlx.validate.metrics import rel_l2
from esmc_mlx.validate.panel import build_panel
from esmc_mlx.validate.weights import ArtifactWeights, SourceWeights, names_for

FAST = {"max_length": 40, "marginal_positions": 6}  # the bundled panel, cropped: ~1,000 tokens
TINY = PACKAGED / "esmc-tiny"


@pytest.fixture(autouse=True)
def reference_cache(tmp_path, monkeypatch):
    """Every test its own cache of the original's outputs (none in the user's ~/.cache)."""
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path / "cache"))
    settings.reload()  # read once per process: this test changes it
    return tmp_path / "cache"


def run(artifact, source, tmp_path, **kw):
    requires_torch()  # the reference side
    return validate(artifact, str(source), report_dir=tmp_path / "report", **{**FAST, "plot": False, **kw})


def failed(report) -> set[str]:
    return {c.name for c in report.failed}


@pytest.fixture(scope="module")
def q4(checkpoints, tmp_path_factory):
    return convert(str(checkpoints["published"]), tmp_path_factory.mktemp("q4") / "q4", q="4", progress=False)


def edit_weights(directory, change):
    """Apply ``change(dict of tensors)`` to an artifact's single shard, in place."""
    path = directory / "model.safetensors"
    weights = dict(mx.load(str(path)))
    change(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def damaged_copy(src, tmp_path, kind):
    out = tmp_path / kind
    shutil.copytree(src, out)
    if kind == "layers_swapped":

        def change(w):
            for name in [n for n in w if n.startswith("esmc.layers.0.")]:
                other = name.replace("esmc.layers.0.", "esmc.layers.1.")
                w[name], w[other] = w[other], w[name]
    elif kind == "perturbed_1pct":

        def change(w):
            t = w["esmc.layers.1.mlp.up_proj.weight"]
            noise = mx.random.normal(t.shape, key=mx.random.key(0))
            w["esmc.layers.1.mlp.up_proj.weight"] = t + 0.01 * noise * mx.sqrt(mx.mean(t * t))
    elif kind == "scale_zeroed":

        def change(w):
            w["esmc.layers.0.mlp.down_proj.scales"] = mx.zeros_like(w["esmc.layers.0.mlp.down_proj.scales"])
    elif kind == "wrong_heads":
        config = json.loads((out / "config.json").read_text())
        heads = config["num_attention_heads"] * 2
        config.update(num_attention_heads=heads, num_key_value_heads=heads, head_dim=config["hidden_size"] // heads)
        (out / "config.json").write_text(json.dumps(config))
        return out
    edit_weights(out, change)
    return out


# --- the panel ---------------------------------------------------------------------------------
def test_bundled_panel_has_what_the_issue_asks():
    panel = build_panel()
    records = [i for i in panel.inputs if i.kind == "record"]
    lengths = [len(i.tokens) for i in records]
    assert min(lengths) <= 40 and max(lengths) > 1000
    assert any(set(i.tokens) & set("XBZUO") for i in records)  # ambiguity codes
    chains = [i for i in panel.inputs if i.kind == "two-chain"]
    assert len(chains) == 1 and "|" in chains[0].tokens
    assert any("<mask>" in i.tokens for i in panel.inputs if i.kind == "masked")
    marginal = [i for i in panel.inputs if i.kind == "marginal"]
    assert len(marginal) == 24 and all(i.tokens.count("<mask>") == 1 for i in marginal)
    batches = panel.batches()
    assert sum(len(b.rows) for b in batches) == len(panel.inputs)
    assert any((b.attention_mask == 0).any() for b in batches)  # padded batches
    chained = [b for b in batches if b.sequence_id is not None]
    assert len(chained) == 1 and chained[0].sequence_id.max() == 1
    assert all(b.input_ids.size <= 4096 or len(b.rows) == 1 for b in batches)
    # designed for cost: little padding, one long record, marginal rows short windows
    padded = sum(b.input_ids.size for b in batches)
    assert padded <= 1.1 * panel.tokens, (padded, panel.tokens)
    assert sum(n > 256 for n in lengths) == 1 and len(records) >= 14
    assert all(len(i.tokens) <= 64 for i in marginal)
    for i in marginal:  # the recorded position is the masked one, and the wild type is the record's
        record = next(r for r in records if r.name == i.marginal[0])
        assert i.tokens[i.marginal[1]] == "<mask>" and i.marginal[2] in record.tokens
    assert panel.digest != build_panel(max_length=256).digest


def test_user_fasta_replaces_the_panel(tmp_path):
    fasta = tmp_path / "mine.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nGSHMSLFDKLGGLKVTEAQQRWXX\n")
    panel = build_panel(fasta, marginal_positions=4)
    assert [i.name for i in panel.inputs if i.kind == "record"] == ["a", "b"]
    assert panel.describe()["source"] == fasta.name  # published with the report: no local path


# --- the references ------------------------------------------------------------------------------
@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_layered_torch_reference_equals_the_full_model(checkpoints, reference_model):
    """Layer by layer (one EsmcLayer at a time) = EsmcForMaskedLM.forward, on a padded panel with
    a two-chain input; and the full path equals the fixture's own transformers model."""
    import torch

    panel = build_panel(**FAST)
    batches = panel.batches(max_tokens=512)
    source = SourceWeights(str(checkpoints["legacy"]))  # through the legacy name mapping
    names = names_for(source.config, "")
    full = reference.run_full(source.get_many, source.config, batches, len(panel.inputs), names)
    layered = reference.run_layered(source.get_many, source.config, batches, len(panel.inputs), names)
    for a, b in zip(full.logits + full.hidden, layered.logits + layered.hidden):
        assert rel_l2(b, a) <= 1e-6
    batch = next(b for b in batches if b.sequence_id is None)
    with torch.no_grad():
        direct = reference_model(
            input_ids=torch.tensor(batch.input_ids).long(), attention_mask=torch.tensor(batch.attention_mask).long()
        ).logits.numpy()
    for r, row in enumerate(batch.rows):
        assert rel_l2(full.logits[row], direct[r, : len(full.logits[row])]) <= 1e-6


def test_weights_norm_is_exact_where_fp32_squares_overflow():
    """The weights check's norm: float64's value for ordinary tensors, finite where the squares
    pass fp32's range (1e20 squared), NaN kept NaN, zeros zero."""
    requires_torch()
    import numpy as np
    import torch

    import esmc_mlx.validate.core as core

    rng = np.random.default_rng(0)
    for x in (rng.normal(size=(64, 48)), np.array([3e20, -1e20, 5.0]), np.zeros(7), np.array([1e-30, 2e-30])):
        got = float(core._l2(torch.tensor(x, dtype=torch.float32)))
        assert got == pytest.approx(np.linalg.norm(x.astype(np.float32).astype(np.float64)), rel=1e-6)
    assert math.isnan(float(core._l2(torch.tensor([1.0, float("nan")]))))


def test_weights_travel_to_the_device_exactly(q4, checkpoints, tmp_path):
    """Off the CPU, weights bf16 holds exactly go as bf16 and are widened there: same fp32 values."""
    import torch

    from esmc_mlx.validate.weights import to_devices, to_torch

    mxfp4 = convert(str(checkpoints["published"]), tmp_path / "mxfp4", q="mxfp4", progress=False)
    for directory in (q4, mxfp4):
        artifact = ArtifactWeights(directory)
        arrays = artifact.get_mx(names_for(artifact.config, "esmc.layers.0."))
        narrowed = to_devices(arrays, "cpu", narrow=True)
        for name, a in arrays.items():
            assert narrowed[name].dtype == torch.float32 and torch.equal(narrowed[name], to_torch(a)), name
    exact = mx.array([1.5, -0.25, 3.0e-3], dtype=mx.bfloat16).astype(mx.float32)
    inexact = mx.array([1.0 + 2.0**-12, 0.1])
    for a in (exact, inexact):
        assert torch.equal(to_devices({"a": a}, "cpu", narrow=True)["a"], to_torch(a))


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX on a CUDA GPU and torch with CUDA")
def test_weights_reach_the_gpu_exactly(q4, checkpoints, tmp_path):
    """MLX's managed memory copied within the GPU (bf16 and fp32, one evaluation per layer): the
    same values as through the host."""
    import torch

    from esmc_mlx.validate.weights import to_devices, to_torch

    mxfp4 = convert(str(checkpoints["published"]), tmp_path / "mxfp4", q="mxfp4", progress=False)
    for directory in (q4, mxfp4):
        artifact = ArtifactWeights(directory)
        arrays = artifact.get_mx(names_for(artifact.config, "esmc.layers.0."))
        for narrow in (True, False):
            on_gpu = to_devices(arrays, torch.device("cuda", 0), narrow=narrow)
            for name, a in arrays.items():
                assert on_gpu[name].dtype == torch.float32 and on_gpu[name].is_cuda
                assert torch.equal(on_gpu[name].cpu(), to_torch(a)), name


@pytest.mark.parametrize("which", ["fp32", "q4"])
def test_layered_mlx_equals_the_runtime(which, converted, q4):
    artifact = ArtifactWeights(converted if which == "fp32" else q4)
    panel = build_panel(**FAST)
    batches = panel.batches(max_tokens=512)
    full = mlx_side.run_full(artifact, batches, len(panel.inputs), mx.float32)
    layered = mlx_side.run_layered(artifact, batches, len(panel.inputs), mx.float32)
    for a, b in zip(full.logits, layered.logits):
        assert rel_l2(b, a) <= 1e-6


# --- correct artifacts pass ----------------------------------------------------------------------
@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_correct_artifact_passes_with_a_complete_report(converted, checkpoints, tmp_path):
    report = run(converted, checkpoints["published"], tmp_path, plot=True)
    assert report.passed, report.summary()
    assert report.check("fidelity_logits").value <= 1e-5 and report.check("weights").value == 0
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    for key in (
        "passed",
        "checks",
        "fidelity",
        "quality",
        "versions",
        "platform",
        "reference_mode",
        "thresholds",
        "panel",
        "resources",
    ):
        assert key in data
    assert data["passed"] is True
    assert {c["name"] for c in data["checks"]} >= {
        "config",
        "weights",
        "fidelity_logits",
        "fidelity_hidden",
        "kl_mean",
        "kl_max",
        "top1",
        "logits_rel_err",
        "hidden_rel_err",
        "embedding_cosine",
        "spearman",
    }
    assert all({"name", "value", "threshold", "passed"} <= set(c) for c in data["checks"])
    assert all(data["versions"][k] for k in ("esmc_mlx", "mlx", "torch", "transformers"))
    assert data["reference_mode"]["torch"] == "full" and data["reference_mode"]["torch_dtype"] == "float32"
    import torch

    device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert data["reference_mode"]["torch_device"].startswith(device)  # auto: the fastest device present
    # lossless: the artifact's weights are the original's, so one torch pass serves both questions
    assert "torch_artifact" in data["reference_mode"]["shared"] and "torch_artifact" not in data["resources"]["timings"]
    assert set(data["artifact"]["files"]) == {"config.json", "model.safetensors"}  # what was validated
    assert all(len(h) == 64 for h in data["artifact"]["files"].values())
    # random weights: quality is computed, reported, and informational
    assert data["quality"]["reference_trained"] is False and data["quality"]["enforced"] is False
    md = (tmp_path / "report" / "report.md").read_text()
    assert "PASSED" in md and "](per_position.png)" in md and "informational" in md
    assert f"fp32 on {device}" in md
    assert (tmp_path / "report" / "per_position.png").stat().st_size > 10_000


def test_layered_mode_and_legacy_reference(converted, checkpoints, tmp_path):
    report = run(converted, checkpoints["legacy"], tmp_path, mode="layered")
    assert report.passed, report.summary()
    assert report.data["reference_mode"]["torch"] == "layered" and report.data["reference_mode"]["mlx"] == "layered"
    assert report.check("kl_mean").value < 1e-9


def test_quantized_artifact_passes_fidelity(q4, checkpoints, tmp_path):
    report = run(q4, checkpoints["published"], tmp_path)
    assert report.check("fidelity_logits").passed and report.check("fidelity_hidden").passed
    assert report.check("fidelity_logits").value <= 1e-5  # fp32 compute on the CPU
    assert report.data["precision"] == "4bit" and report.check("weights").passed
    assert report.passed, report.summary()


# --- damaged artifacts fail, naming the check -----------------------------------------------------
@pytest.mark.parametrize(
    "kind, caught_by",
    [
        ("layers_swapped", "weights"),
        ("perturbed_1pct", "weights"),
        ("scale_zeroed", "weights"),
        ("wrong_heads", "config"),
    ],
)
@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_damaged_artifact_fails_naming_the_check(kind, caught_by, converted, q4, checkpoints, tmp_path):
    artifact = damaged_copy(q4 if kind == "scale_zeroed" else converted, tmp_path, kind)
    report = run(artifact, checkpoints["published"], tmp_path)
    assert not report.passed and caught_by in failed(report), report.summary()
    if caught_by == "config":  # fails fast: no forward pass runs on a contradicting config
        assert report.data["stopped_before_panel"] == "config" and report.data["fidelity"] is None
    else:
        # the runtime still computes what torch computes on those (damaged) weights: the two
        # questions are answered separately
        assert report.check("fidelity_logits").passed
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["passed"] is False and any(c["name"] == caught_by and not c["passed"] for c in data["checks"])
    assert "FAILED" in (tmp_path / "report" / "report.md").read_text()


def test_missing_tensor_fails_without_a_traceback(converted, checkpoints, tmp_path):
    artifact = tmp_path / "missing"
    shutil.copytree(converted, artifact)
    edit_weights(artifact, lambda w: w.pop("esmc.layers.1.self_attn.k_norm.weight"))
    report = run(artifact, checkpoints["published"], tmp_path)
    assert {"weights", "artifact_loads"} <= failed(report)
    assert "esmc.layers.1.self_attn.k_norm.weight missing" in report.check("weights").detail
    assert json.loads((tmp_path / "report" / "report.json").read_text())["passed"] is False


def test_config_mismatch_fails_before_any_panel_work(converted, checkpoints, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a forward pass ran on a config that contradicts the reference")

    for name in ("run_full", "run_layered", "layered_steps"):
        monkeypatch.setattr(mlx_side, name, refuse)
        monkeypatch.setattr(reference, name, refuse)
    artifact = damaged_copy(converted, tmp_path, "wrong_heads")
    report = run(artifact, checkpoints["published"], tmp_path)
    assert failed(report) == {"config"} and report.data["stopped_before_panel"] == "config"
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["passed"] is False and "num_attention_heads: artifact 4, reference 2" in data["checks"][0]["detail"]
    assert "Stopped before any forward pass (config)" in (tmp_path / "report" / "report.md").read_text()


def test_nan_weights_fail_fast_with_a_clear_report(converted, checkpoints, tmp_path, monkeypatch):
    artifact = tmp_path / "nan"
    shutil.copytree(converted, artifact)

    def poison(w):
        t = w["esmc.layers.1.mlp.up_proj.weight"]
        w["esmc.layers.1.mlp.up_proj.weight"] = mx.where(mx.arange(t.size).reshape(t.shape) == 7, mx.nan, t)

    edit_weights(artifact, poison)
    monkeypatch.setattr(mlx_side, "run_full", lambda *a, **k: pytest.fail("the panel ran on NaN weights"))
    report = run(artifact, checkpoints["published"], tmp_path, plot=True)
    assert not report.passed and failed(report) == {"weights"}
    assert "esmc.layers.1.mlp.up_proj.weight: NaN or Inf in the artifact" in report.check("weights").detail
    data = json.loads((tmp_path / "report" / "report.json").read_text())  # valid JSON: no NaN in it
    assert data["passed"] is False and data["stopped_before_panel"] == "non-finite weights"
    assert "FAILED" in (tmp_path / "report" / "report.md").read_text()


def test_overflowing_outputs_fail_and_the_report_is_still_json(converted, checkpoints, tmp_path):
    artifact = tmp_path / "overflow"
    shutil.copytree(converted, artifact)
    name = "esmc.layers.0.post_attention_layernorm.weight"
    edit_weights(artifact, lambda w: w.__setitem__(name, w[name] * 1e30))  # finite weights, Inf/NaN outputs
    report = run(artifact, checkpoints["published"], tmp_path, plot=True)
    assert {"weights", "finite_outputs"} <= failed(report), report.summary()
    assert "NaN or Inf in the outputs" in report.check("finite_outputs").detail
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["passed"] is False and "finite_outputs" in {c["name"] for c in data["checks"] if not c["passed"]}


def test_reference_cache_hit_is_identical_and_misses_on_change(q4, checkpoints, tmp_path, reference_cache):
    first = run(q4, checkpoints["published"], tmp_path)
    assert first.data["reference_cache"]["hit"] is False and "torch_original" in first.data["resources"]["timings"]
    assert len(list((reference_cache / "reference").glob("*.npz"))) == 1
    second = run(q4, checkpoints["published"], tmp_path)
    assert second.data["reference_cache"]["hit"] is True
    assert "torch_original" not in second.data["resources"]["timings"]  # the original's pass skipped
    assert second.data["checks"] == first.data["checks"]
    assert second.data["quality"] == first.data["quality"] and second.data["fidelity"] == first.data["fidelity"]
    # another panel misses
    assert run(q4, checkpoints["published"], tmp_path, max_length=30).data["reference_cache"]["hit"] is False
    # a changed source file misses (same path, same size, new bytes)
    changed = tmp_path / "changed"
    shutil.copytree(checkpoints["published"], changed)
    assert run(q4, changed, tmp_path).data["reference_cache"]["hit"] is True  # a copy: same bytes, same entry
    weights = dict(mx.load(str(changed / "model.safetensors")))
    weights["esmc.norm.weight"] = weights["esmc.norm.weight"] * 1.5
    mx.save_safetensors(str(changed / "model.safetensors"), weights, metadata={"format": "pt"})
    assert run(q4, changed, tmp_path).data["reference_cache"]["hit"] is False
    assert run(q4, checkpoints["published"], tmp_path, cache=False).data["reference_cache"] == {"used": False}


def test_validation_after_a_conversion_hashes_no_weight_file(checkpoints, tmp_path, reference_cache, monkeypatch):
    """The converter's hashes of its source are remembered (esmc_mlx.hashes): validating the
    artifact against that source afterwards, in another call, hashes no weight file (only the
    source's config.json, which the converter does not record); a weight file changed since is
    hashed again."""
    import esmc_mlx.hashes as hashes

    source = tmp_path / "source"
    shutil.copytree(checkpoints["published"], source)
    out = convert(str(source), tmp_path / "q4", q="4", progress=False)
    memo = json.loads((reference_cache / "hashes.json").read_text())
    assert any(str((source / "model.safetensors").resolve()) in stamp for stamp in memo)
    hashed = []
    real = hashes.sha256
    monkeypatch.setattr(hashes, "sha256", lambda path: hashed.append(path) or real(path))
    assert run(out, source, tmp_path).passed and [p.name for p in hashed] == ["config.json"]
    (source / "model.safetensors").touch()  # a new mtime: a new stamp
    run(out, source, tmp_path)
    assert [p.name for p in hashed] == ["config.json", "model.safetensors"]


def test_layered_report_equals_full_report(q4, checkpoints, tmp_path):
    full = run(q4, checkpoints["published"], tmp_path, mode="full", cache=False)
    layered = run(q4, checkpoints["published"], tmp_path, mode="layered", cache=False)
    assert layered.data["reference_mode"]["torch"] == "layered" and "sweep" in layered.data["resources"]["timings"]
    for c in full.checks:
        other = layered.check(c.name)
        assert other.passed == c.passed
        assert c.value == pytest.approx(other.value, rel=1e-3, abs=1e-6), c.name


def test_quality_gate_on_catches_damage_through_the_outputs(converted, checkpoints, tmp_path):
    artifact = damaged_copy(converted, tmp_path, "layers_swapped")
    report = run(artifact, checkpoints["published"], tmp_path, quality_gate="on")
    assert {"kl_mean", "top1", "logits_rel_err"} <= failed(report)


def test_threshold_override(converted, checkpoints, tmp_path):
    report = run(converted, checkpoints["published"], tmp_path, thresholds={"fidelity_logits": 1e-12})
    assert failed(report) == {"fidelity_logits"}
    with pytest.raises(ValidationError, match="unknown threshold 'kl'"):
        run(converted, checkpoints["published"], tmp_path, thresholds={"kl": 1})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_length": 0}, "max_length=0: give a positive number"),  # was: ran, cropping nothing
        ({"marginal_positions": 0}, "marginal_positions=0"),  # was: ran, then failed spearman (NaN)
        ({"compute_dtype": "int8"}, "compute_dtype 'int8'"),  # was: KeyError 'int8'
        ({"thresholds": {"kl_mean": "x"}}, "threshold kl_mean='x': give a number"),  # was: ValueError
        ({"thresholds": {"kl_mean": math.nan}}, "threshold kl_mean=nan"),  # was: a bound nothing passes
        ({"thresholds": {"bogus": 1}}, "unknown threshold 'bogus'"),  # was: after reading the reference
    ],
)
def test_api_arguments_are_checked_before_any_work(converted, tmp_path, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        validate(converted, str(tmp_path / "no-reference"), report_dir=tmp_path / "r", **kwargs)
    assert not (tmp_path / "r").exists()


def test_a_report_folder_holding_the_users_files_of_those_names_is_refused(converted, tmp_path):
    # `validate --report DIR` replaces DIR/report.json (or report.md) only when esmc-mlx wrote it
    from esmc_mlx.errors import ConvertError

    folder = tmp_path / "mine"
    folder.mkdir()
    for name, content in (("report.json", '{"x": 1}'), ("report.md", "# my notes")):
        (folder / name).write_text(content)
        with pytest.raises(ValidationError, match=f"{name} is not an esmc-mlx validation report"):
            validate(converted, str(tmp_path / "no-reference"), report_dir=folder)
        assert (folder / name).read_text() == content
        (folder / name).unlink()
    # a previous run's report is replaced: the run goes on (here to the missing reference)
    (folder / "report.json").write_text(json.dumps({"passed": True, "checks": [], "thresholds": {}, "panel": {}}))
    with pytest.raises(ConvertError, match="no-reference: no such file"):
        validate(converted, str(tmp_path / "no-reference"), report_dir=folder)


def test_threshold_table_has_every_precision():
    for row in (
        "float32",
        "bfloat16",
        "float16",
        "8bit",
        "mxfp8",
        "6bit",
        "5bit",
        "4bit",
        "mxfp4",
        "nvfp4",
        "3bit",
        "2bit",
    ):
        assert set(thresholds.QUALITY[row]) == set(thresholds.QUALITY_COLUMNS)
    assert thresholds.precision_class({"dtype": "bfloat16"}, "bfloat16") == "float32"
    assert thresholds.precision_class({"dtype": "bfloat16"}, "float32") == "bfloat16"
    assert (
        thresholds.precision_class(
            {
                "quantization": {
                    "bits": 4,
                    "group_size": 64,
                    "mode": "affine",
                    "esmc.layers.0.mlp.down_proj": {"bits": 6},
                }
            },
            "x",
        )
        == "4bit"
    )
    assert thresholds.precision_class({"quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}}, "x") == "mxfp4"
    # MLX computing in bf16 (GPU) loosens the output bounds to the bf16 row, never the weights bound
    on_gpu = thresholds.resolve("float32", "bfloat16").values
    assert on_gpu["kl_mean"] == thresholds.QUALITY["bfloat16"]["kl_mean"] and on_gpu["weights"] == 1e-6
    assert on_gpu["fidelity_logits"] == 2e-2 and thresholds.resolve("4bit", "float32").values["fidelity_logits"] == 1e-5


# --- command line ----------------------------------------------------------------------------------
@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_cli_validate_exit_codes(converted, checkpoints, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(
        main,
        [
            "validate",
            str(converted),
            "--reference",
            str(checkpoints["esm"]),
            "--max-length",
            "40",
            "--report",
            str(tmp_path / "ok"),
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert "Validation PASSED" in ok.output and (tmp_path / "ok" / "report.json").exists()
    bad = damaged_copy(converted, tmp_path, "wrong_heads")
    result = runner.invoke(main, ["validate", str(bad), "--reference", str(checkpoints["esm"]), "--max-length", "30"])
    assert result.exit_code == 1 and "FAILED (config)" in result.output
    assert "num_attention_heads: artifact 4, reference 2" in result.output
    assert (bad / "validation" / "report.json").exists()  # default location
    usage = runner.invoke(
        main, ["validate", str(converted), "--reference", str(checkpoints["esm"]), "--threshold", "kl_mean"]
    )
    assert usage.exit_code == 2 and "NAME=VALUE" in usage.output


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_esmc_convert_validates_by_default(checkpoints, tmp_path, monkeypatch):
    import esmc_mlx.validate.core as core

    monkeypatch.setattr(core, "build_panel", lambda *a, **k: build_panel(max_length=30, marginal_positions=4))
    out = tmp_path / "out"
    result = CliRunner().invoke(convert_main, [str(checkpoints["published"]), "-o", str(out), "--q", "8"])
    assert result.exit_code == 0, result.output
    assert "Validation PASSED" in result.output
    assert json.loads((out / "validation" / "report.json").read_text())["passed"]
    skipped = CliRunner().invoke(
        convert_main, [str(checkpoints["published"]), "-o", str(tmp_path / "o2"), "--no-validate"]
    )
    assert skipped.exit_code == 0 and not (tmp_path / "o2" / "validation").exists()


def test_esmc_convert_fails_when_validation_fails(checkpoints, tmp_path, monkeypatch):
    import esmc_mlx.validate.core as core

    monkeypatch.setattr(core, "build_panel", lambda *a, **k: build_panel(max_length=30, marginal_positions=4))
    monkeypatch.setitem(thresholds.FIDELITY, "float32", 1e-12)
    out = tmp_path / "out"
    result = CliRunner().invoke(convert_main, [str(checkpoints["published"]), "-o", str(out)])
    assert result.exit_code == 1 and "validation failed (fidelity_logits" in result.output
    assert "stays at" in result.output and (out / "validation" / "report.md").exists()


# --- the trained tiny model --------------------------------------------------------------------------
needs_tiny = pytest.mark.skipif(not (TINY / "config.json").exists(), reason="esmc_mlx/data/esmc-tiny not built yet")


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
@needs_tiny
def test_trained_tiny_quality_is_enforced_and_catches_damage(tmp_path):
    artifact = convert("tiny", tmp_path / "tiny-8bit", q="8", progress=False)
    report = run(artifact, "tiny", tmp_path)
    assert report.data["quality"]["reference_trained"] and report.data["quality"]["enforced"]
    assert report.passed, report.summary()
    swapped = damaged_copy(artifact, tmp_path, "layers_swapped")
    report = run(swapped, "tiny", tmp_path)
    assert {"weights", "kl_mean", "top1"} <= failed(report), report.summary()


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
@needs_tiny
def test_trained_tiny_4bit_passes_and_a_perturbed_fp32_fails_quality(tmp_path):
    q4 = convert("tiny", tmp_path / "tiny-4bit", q="4", progress=False)
    report = run(q4, "tiny", tmp_path)
    assert report.passed and report.data["precision"] == "4bit", report.summary()
    assert 0 < report.check("kl_mean").value < thresholds.QUALITY["4bit"]["kl_mean"]
    fp32 = convert("tiny", tmp_path / "tiny-fp32", progress=False)
    perturbed = damaged_copy(fp32, tmp_path, "perturbed_1pct")
    report = run(perturbed, "tiny", tmp_path)
    # one matrix off by 1% barely moves a trained model's outputs (KL ~2e-8): the weights check
    # names it; the lossless row's hidden-state bound sees it too
    assert {"weights", "hidden_rel_err"} <= failed(report), report.summary()
    assert "esmc.layers.1.mlp.up_proj.weight" in report.check("weights").detail


# --- several precisions of one source --------------------------------------------------------------
def test_convert_many_reads_once_and_writes_what_convert_writes(checkpoints, tmp_path, monkeypatch):
    from esmc_mlx.convert import sources
    from esmc_mlx.convert.many import convert_many

    reads: list[str] = []
    opened = sources.open_checkpoint

    def counting(src):
        ckpt = opened(src)
        read = ckpt.read
        ckpt.read = lambda name: reads.append(name) or read(name)
        return ckpt

    monkeypatch.setattr("esmc_mlx.convert.open_checkpoint", counting)
    outs = convert_many(str(checkpoints["published"]), tmp_path / "many", ["4", "mxfp4", None], progress=False)
    assert list(outs) == ["4bit", "mxfp4", "float"] and all(p.parent == tmp_path / "many" for p in outs.values())
    # every source tensor read once for the three outputs
    from esmc_mlx.resolve import resolve

    assert len(reads) == len(set(reads)) == len(opened(resolve(str(checkpoints["published"]))).shapes)
    for label, q in (("4bit", "4"), ("mxfp4", "mxfp4"), ("float", None)):
        alone = convert(str(checkpoints["published"]), tmp_path / f"alone-{label}", q=q, progress=False)
        a, b = mx.load(str(outs[label] / "model.safetensors")), mx.load(str(alone / "model.safetensors"))
        assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() for k in a), label
        ca, cb = (json.loads((d / "config.json").read_text()) for d in (outs[label], alone))
        assert ca.get("quantization") == cb.get("quantization")
    with pytest.raises(Exception, match="exists"):
        convert_many(str(checkpoints["published"]), tmp_path / "many", ["4"], progress=False)
    # the second precision's validation takes the original's outputs from the cache
    first = run(outs["mxfp4"], checkpoints["published"], tmp_path)
    second = run(outs["4bit"], checkpoints["published"], tmp_path)
    assert not first.data["reference_cache"]["hit"] and second.data["reference_cache"]["hit"]
    # the command line: --q repeated, one sub-directory per spec, each validated, the original once
    import esmc_mlx.validate.core as core

    monkeypatch.setattr(core, "build_panel", lambda *a, **k: build_panel(max_length=30, marginal_positions=4))
    result = CliRunner().invoke(
        convert_main, [str(checkpoints["published"]), "-o", str(tmp_path / "cli"), "--q", "8", "--q", "mxfp8"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "cli").iterdir() if not p.name.startswith(".")) == ["8bit", "mxfp8"]
    hits = [
        json.loads((tmp_path / "cli" / d / "validation" / "report.json").read_text())["reference_cache"]["hit"]
        for d in ("8bit", "mxfp8")
    ]
    assert hits == [False, True] and result.output.count("Validation PASSED") == 2


def test_reference_device_option(converted, checkpoints, tmp_path):
    import torch

    runner = CliRunner()
    absent = "cuda" if not torch.cuda.is_available() else None
    if absent:
        result = runner.invoke(
            main,
            [
                "validate",
                str(converted),
                "--reference",
                str(checkpoints["published"]),
                "--reference-device",
                absent,
                "--report",
                str(tmp_path / "r"),
            ],
        )
        assert result.exit_code == 1 and "--reference-device cuda" in result.output and "no CUDA" in result.output
    result = runner.invoke(
        main,
        [
            "validate",
            str(converted),
            "--reference",
            str(checkpoints["published"]),
            "--reference-device",
            "cpu",
            "--max-length",
            "30",
            "--report",
            str(tmp_path / "c"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "c" / "report.json").read_text())["reference_mode"]["torch_device"] == "cpu (fp32)"
    bad = runner.invoke(main, ["validate", str(converted), "--reference", "x", "--reference-device", "tpu"])
    assert bad.exit_code == 2


def test_explicit_validate_without_torch_fails_before_converting(checkpoints, tmp_path, monkeypatch):
    import esmc_mlx.pipeline as pipeline

    monkeypatch.setattr(pipeline, "validation_available", lambda: False)
    out = tmp_path / "never"
    result = CliRunner().invoke(convert_main, [str(checkpoints["published"]), "-o", str(out), "--validate"])
    assert result.exit_code == 1 and "--validate needs torch" in result.output and not out.exists()


def test_prefetch_torch_imports_the_reference_once_in_the_background():
    """What the converter starts before converting: one daemon thread importing torch and
    transformers' ESMC (a fresh process: this one has torch loaded already)."""
    requires_torch()
    import subprocess
    import sys

    code = (
        "import sys, threading, esmc_mlx.pipeline, esmc_mlx.validate as v\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "v.prefetch_torch(); v.prefetch_torch()\n"
        "started = [t for t in threading.enumerate() if t.name == 'esmc-mlx-torch-import']\n"
        "assert len(started) == 1 and started[0].daemon, started\n"
        "started[0].join()\n"
        "assert 'transformers.models.esmc.modeling_esmc' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_torch_import_starts_before_a_conversion_that_will_be_validated(checkpoints, tmp_path, monkeypatch):
    """The pipeline's order is under test (validation itself is faked): with validation ahead the
    import runs beside the conversion, not after it; with --no-validate torch is never imported."""
    from types import SimpleNamespace

    import esmc_mlx.pipeline as pipeline

    events = []
    write = pipeline.write_artifact
    monkeypatch.setattr(pipeline, "prefetch_torch", lambda: events.append("import torch"))
    monkeypatch.setattr(pipeline, "write_artifact", lambda *a, **k: (events.append("convert"), write(*a, **k))[1])
    monkeypatch.setattr(pipeline, "validation_available", lambda: True)
    monkeypatch.setattr(
        pipeline,
        "validate",
        lambda *a, **k: events.append("validate") or SimpleNamespace(passed=True, failed=[], summary=lambda: ""),
    )
    source = str(checkpoints["published"])
    pipeline.convert_validate_push(source, tmp_path / "checked", dtype="float16", log=lambda m: None)
    assert events == ["import torch", "convert", "validate"]
    events.clear()
    pipeline.convert_validate_push(source, tmp_path / "unchecked", dtype="float16", validate_output=False, log=print)
    assert events == ["convert"]
