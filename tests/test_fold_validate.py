"""Validation of fold artifacts: a lossless one passes every check, a 4-bit one passes fidelity and
reports quality, damaged weights fail quality, a broken MLX runtime fails fidelity; the report
files, `esmc-mlx validate` and `esmc-convert`'s gate on push. Tiny random-weight ESMFold2s, two
short proteins (one a complex), 2 sampling steps and 1 recycling loop."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[torch]' in the clone")
from click.testing import CliRunner
from conftest_hub import hub, no_remote_network  # noqa: F401  (fixtures)

from esmc_mlx.cli import convert_main, main
from esmc_mlx.convert import convert
from esmc_mlx.errors import ValidationError
from esmc_mlx.runtime.fold import trunk
from esmc_mlx.tasks.fold import protein_features
from esmc_mlx.testing import tiny_fold_config, write_fold_checkpoint
from esmc_mlx.validate import panel as panel_module
from esmc_mlx.validate import thresholds as th
from esmc_mlx.validate.fold import validate_fold_artifact
from esmc_mlx.validate.metrics import ca_geometry, fold_fidelity, lddt, rmsd_after_superposition
from esmc_mlx.validate.panel import build_fold_panel
from esmc_mlx.validate.report import LABELS

FIDELITY = set(th.FOLD_FIDELITY_COLUMNS)
QUALITY = set(th.FOLD_QUALITY_COLUMNS)
TAMPERED = "structure_head.token_transformer.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    path = tmp_path_factory.mktemp("panel") / "panel.fasta"
    path.write_text(">one\nMKTAYIAKQRQISFVKSHFS\n>pair\nMKTAYIAKQR|GSHMSLFDKLGG\n")
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random-weight ESMFold2 whose own defaults fold fast: 2 sampling steps, 1 recycling loop."""
    config = tiny_fold_config(num_loops=1)
    config["structure_head"]["inference_num_steps"] = 2
    return write_fold_checkpoint(tmp_path_factory.mktemp("fold") / "src", config, seed=3)


@pytest.fixture(scope="module")
def fp32(source, tmp_path_factory):
    return convert(str(source), tmp_path_factory.mktemp("fp32") / "fold-fp32", progress=False)


@pytest.fixture(scope="module")
def q4(source, tmp_path_factory):
    return convert(str(source), tmp_path_factory.mktemp("q4") / "fold-4bit", q="4", progress=False)


@pytest.fixture
def small_panel(panel, monkeypatch):
    """The validations the pipeline runs fold ``panel`` instead of the bundled proteins."""
    monkeypatch.setattr(panel_module, "FOLD_PANEL_PATH", panel)


def broken_runtime(monkeypatch):
    """An MLX fold with a bug: the trunk's recurrence decays 1% too fast."""
    discretize = trunk.Parcae.discretize

    def wrong(self):
        decay, matrix = discretize(self)
        return decay * 0.99, matrix

    monkeypatch.setattr(trunk.Parcae, "discretize", wrong)


def checks(report_json: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report_json["checks"]}


# --- what the checks compute ----------------------------------------------------------------------
def test_structure_comparisons_measure_what_they_say():
    rng = np.random.default_rng(0)
    ca = np.cumsum(rng.normal(size=(30, 3)) * 2.2, axis=0)
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    rotation = q * np.sign(np.linalg.det(q))  # a proper rotation
    moved = ca @ rotation.T + np.array([5.0, -3.0, 12.0])
    rmsd, per_point = rmsd_after_superposition(moved, ca)
    assert rmsd < 1e-9 and per_point.max() < 1e-9 and lddt(moved, ca) == 1.0
    mirrored = ca * np.array([-1.0, 1.0, 1.0])  # a reflection is no rotation: superposition cannot undo it
    assert rmsd_after_superposition(mirrored, ca)[0] > 1.0
    shifted = ca.copy()
    shifted[0] += np.array([3.0, 0.0, 0.0])  # one atom 3 A off: its pairs keep distances within 4, not 2
    d_ref = np.linalg.norm(ca[:, None] - ca[None], axis=-1)
    d_new = np.linalg.norm(shifted[:, None] - shifted[None], axis=-1)
    scored = (d_ref < 15.0) & ~np.eye(30, dtype=bool)
    expected = np.mean([(np.abs(d_new - d_ref)[scored] < t).mean() for t in (0.5, 1, 2, 4)])
    assert lddt(shifted, ca) == pytest.approx(expected) and lddt(shifted, ca) < 1
    chain = np.cumsum(np.tile([[3.8, 0.0, 0.0]], (10, 1)), axis=0)
    assert ca_geometry(chain, np.zeros(10), 3.8, 0.3) == (9, 9)
    assert ca_geometry(chain * 2, np.zeros(10), 3.8, 0.3) == (0, 9)
    assert ca_geometry(chain, np.repeat([0, 1], 5), 3.8, 0.3) == (8, 8)  # no pair across the chain break


def test_confidences_of_a_sample_binned_differently_are_left_out_of_fidelity():
    features = protein_features(["MKTAYIAKQR"])
    rng = np.random.default_rng(1)
    coords = rng.normal(size=(2, features["ref_pos"].shape[1], 3)) * 5
    rep = features["distogram_atom_idx"][0]
    d01 = np.linalg.norm(coords[0, rep[1]] - coords[0, rep[0]])
    boundaries = np.array([d01 + 5e-7])  # the pair (0, 1) of sample 0 sits just below a boundary
    moved = coords.copy()
    moved[0, rep[1]] += (coords[0, rep[1]] - coords[0, rep[0]]) / d01 * 1e-6  # 1e-6 A further: across it
    L = len(rep)
    ref = {"coords": coords, "distogram": np.ones((L, L, 4)), "plddt": np.full((2, L), 0.5),
           "pae": np.full((2, L, L), 3.0), "ptm": np.full(2, 0.4), "iptm": np.zeros(2)}  # fmt: skip
    mlx = {**ref, "coords": moved, "pae": ref["pae"] + np.array([0.5, 1e-3])[:, None, None]}
    out = fold_fidelity([("p", features)], [mlx], [ref], boundaries)
    assert out["bin_flips"] == 1 and out["per_input"]["p"]["samples_compared"] == 1
    assert out["pae_max_err"] == pytest.approx(1e-3)  # sample 0's 0.5 is the flip's, not compared
    assert out["ca_max_dev"] <= 1e-6 + 1e-12
    same = fold_fidelity([("p", features)], [mlx], [ref], boundaries + 1.0)  # no pair near a boundary
    assert same["bin_flips"] == 0 and same["pae_max_err"] == pytest.approx(0.5)


def test_bundled_fold_panel_has_what_the_issue_asks():
    panel = build_fold_panel()
    assert len(panel.proteins) >= 4
    complexes = [p for p in panel.proteins if len(p.chains) > 1]
    assert len(complexes) == 1 and len(complexes[0].chains) == 2
    assert all(40 <= p.residues <= 200 for p in panel.proteins)
    assert "UBIQ_HUMAN" in [p.name for p in panel.proteins]


def test_fold_bounds_cover_every_precision_and_loosen_with_fewer_bits():
    assert set(th.FOLD_QUALITY) == set(th.QUALITY)
    half = dict(ca_rmsd=0.10, lddt_ca=0.995, plddt_mae=0.001, pae_mae=0.10, ptm_error=0.002)
    assert th.FOLD_QUALITY["bfloat16"] == half == th.FOLD_QUALITY["float16"]
    ladder = ["float32", "bfloat16", "8bit", "6bit", "5bit", "4bit", "3bit", "2bit"]
    for better, worse in zip(ladder, ladder[1:]):
        for name in th.FOLD_QUALITY_COLUMNS:
            a, b = th.FOLD_QUALITY[better][name], th.FOLD_QUALITY[worse][name]
            assert (b <= a) if name in th.HIGHER_IS_BETTER else (b >= a), (better, worse, name)
    bounds = th.resolve_fold("4bit", "bfloat16", {"ca_rmsd": 0.5})
    assert bounds.values["ca_rmsd"] == 0.5 and bounds.values["weights"] == th.QUALITY["4bit"]["weights"]
    assert bounds.values["fidelity_ca"] == th.FOLD_FIDELITY["bfloat16"]["fidelity_ca"]


# --- validations ------------------------------------------------------------------------------------
def test_lossless_artifact_passes_every_check_and_the_report_names_them(fp32, source, panel, tmp_path):
    result = CliRunner().invoke(
        main, ["validate", str(fp32), "--reference", str(source), "--sequences", str(panel), "--report", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "Validation PASSED" in result.output
    report = json.loads((tmp_path / "report.json").read_text())
    found = checks(report)
    assert set(found) == {"config", "weights", *FIDELITY, *QUALITY}
    assert all(c["passed"] and c["enforced"] for c in found.values())  # quality too: the artifact is lossless
    assert found["weights"]["value"] == 0 and found["ca_rmsd"]["value"] < 1e-3 and found["lddt_ca"]["value"] > 0.999
    assert report["kind"] == "fold" and report["precision"] == "float32"
    assert report["reference_mode"]["shared"]  # one torch fold served fidelity and quality
    assert report["fold"] == {"samples": 1, "steps": 2, "loops": 1, "seed": 0}
    assert report["panel"]["complexes"] == 1 and set(report["quality"]["per_input"]) == {"one", "pair"}
    markdown = (tmp_path / "report.md").read_text()
    assert all(LABELS[name] in markdown for name in found)
    assert "random-weight" in markdown and "lossless" in markdown
    assert (tmp_path / "per_position.png").stat().st_size > 10_000


def test_4bit_artifact_passes_fidelity_and_reports_quality(q4, source, panel):
    report = validate_fold_artifact(q4, str(source), sequences=panel, write=False)
    assert report.passed, report.summary()
    fidelity = [c for c in report.checks if c.kind == "fidelity"]
    assert {c.name for c in fidelity} == FIDELITY and all(c.enforced and c.passed for c in fidelity)
    assert report.check("fidelity_ca").value < 1e-3 and report.check("fidelity_distogram").value < 1e-4
    quality = [c for c in report.checks if c.kind == "quality"]
    assert {c.name for c in quality} == QUALITY and not any(c.enforced for c in quality)
    assert report.check("ca_rmsd").value > 1e-3  # 4 bits do move a random network's structure
    assert report.data["quality"]["reference_trained"] is False and report.data["precision"] == "4bit"
    assert 0 < report.check("weights").value <= th.QUALITY["4bit"]["weights"]
    assert "torch_artifact" in report.data["resources"]["timings"]  # its own pass: the weights differ


def test_damaged_weights_fail_quality(fp32, source, panel, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(fp32, damaged)
    weights = dict(mx.load(str(damaged / "model.safetensors")))
    weights[TAMPERED] = weights[TAMPERED] * 1.1
    mx.save_safetensors(str(damaged / "model.safetensors"), weights, metadata={"format": "mlx"})
    args = ["validate", str(damaged), "--reference", str(source), "--sequences", str(panel)]
    result = CliRunner().invoke(main, [*args, "--steps", "3", "--loops", "0"])
    assert result.exit_code == 1 and "Validation FAILED" in result.output
    report = json.loads((damaged / "validation" / "report.json").read_text())
    assert report["fold"] == {"samples": 1, "steps": 3, "loops": 0, "seed": 0}
    found = checks(report)
    failed = {name for name, c in found.items() if not c["passed"]}
    assert QUALITY & failed and "weights" in failed and TAMPERED in found["weights"]["detail"]
    assert not FIDELITY & failed  # MLX still folds what torch folds on these (damaged) weights
    refused = CliRunner().invoke(main, ["push", str(damaged), "my-org/ESMFold2-damaged", "--dry-run"])
    assert refused.exit_code == 1 and "validation failed" in refused.output


def test_broken_runtime_fails_fidelity_and_esmc_convert_keeps_it_back(
    hub,  # noqa: F811
    source,
    small_panel,
    tmp_path,
    monkeypatch,
):
    broken_runtime(monkeypatch)
    out = tmp_path / "fold-4bit"
    result = CliRunner().invoke(convert_main, [str(source), "-o", str(out), "--q", "4"])
    assert result.exit_code == 1 and "validation failed (fidelity_" in result.output
    assert "will not be uploaded" in result.output
    found = checks(json.loads((out / "validation" / "report.json").read_text()))
    assert {name for name, c in found.items() if c["enforced"] and not c["passed"]} <= FIDELITY
    # 1% in the trunk moves the distogram 5e-3 and atoms 0.017 A: within float32's room for
    # coordinates at the published sizes (0.05 A), not for the distogram (2e-3)
    assert not found["fidelity_distogram"]["passed"] and found["fidelity_ca"]["value"] > 1e-3
    refused = CliRunner().invoke(main, ["push", str(out), "my-org/ESMFold2-4bit", "--dry-run"])
    assert refused.exit_code == 1 and "validation failed" in refused.output


def test_esmc_convert_validates_a_fold_by_default_and_push_takes_it(hub, source, small_panel, tmp_path):  # noqa: F811
    out = tmp_path / "fold-4bit"
    result = CliRunner().invoke(convert_main, [str(source), "-o", str(out), "--q", "4"])
    assert result.exit_code == 0, result.output
    assert (
        "Validation PASSED" in result.output and json.loads((out / "validation" / "report.json").read_text())["passed"]
    )
    preview = CliRunner().invoke(main, ["push", str(out), "my-org/ESMFold2-4bit", "--dry-run"])
    assert preview.exit_code == 0, preview.output
    card = preview.output.split("--- README.md (model card) ---", 1)[1]
    assert "Validation: passed" in card and LABELS["fidelity_ca"] in card and "random-weight" in card
    skipped = CliRunner().invoke(convert_main, [str(source), "-o", str(tmp_path / "o2"), "--no-validate"])
    assert skipped.exit_code == 0 and not (tmp_path / "o2" / "validation").exists()


def test_options_a_fold_has_no_use_for_are_refused_before_any_work(fp32, source, tmp_path):
    for flags, named in ((["--mode", "layered"], "--mode"), (["--quick"], "--quick")):
        result = CliRunner().invoke(main, ["validate", str(fp32), "--reference", str(source), *flags])
        assert result.exit_code == 1 and named in result.output and "fold artifact" in result.output
    with pytest.raises(ValidationError, match="unknown threshold 'kl_mean'"):
        validate_fold_artifact(fp32, str(source), thresholds={"kl_mean": 1.0})
    with pytest.raises(ValidationError, match="steps=0"):
        validate_fold_artifact(fp32, str(source), steps=0)
    (tmp_path / "esmc").mkdir()
    with pytest.raises(ValidationError, match="not a fold artifact"):
        validate_fold_artifact(tmp_path / "esmc", str(source))
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "esmc"), "--reference", str(source), "--steps", "3"])
    assert result.exit_code == 1 and "--steps apply to fold artifacts" in result.output
    assert not (fp32 / "validation").exists()
