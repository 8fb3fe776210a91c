"""``validate()``: run the panel through the artifact (MLX) and two torch references, check, report.

Passes, each over one model at a time so that peak memory is one model (``full``) or one layer
(``layered``) plus the panel's outputs:
  1. config: the artifact's architecture is the reference's;
  2. weights: every tensor of the artifact (dequantized) against the original, tensor by tensor;
  3. MLX: the artifact as the runtime runs it;
  4. torch on the artifact's weights (dequantized) and config -> fidelity;
  5. torch on the original checkpoint -> quality.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

from .. import _blas
from ..artifact import sha256, weight_files
from ..config import ESMCConfig
from ..errors import EsmcMlxError
from . import thresholds as th
from .metrics import fidelity as fidelity_metrics
from .metrics import quality as quality_metrics
from .metrics import rel_l2
from .panel import build_panel
from .reference import fp32_bytes
from ..errors import ValidationError
from .weights import ArtifactWeights, SourceWeights, names_for

MODES = ("auto", "full", "layered")
QUALITY_GATES = ("auto", "on", "off")
FULL_MODEL_RAM_SHARE = 0.25  # auto mode: a whole fp32 model only when it takes <= 25% of RAM
CONFIG_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                 "rope_theta", "layer_norm_eps")


@dataclasses.dataclass
class Check:
    name: str
    kind: str  # integrity | fidelity | quality
    value: float | None
    threshold: float | None
    passed: bool
    enforced: bool = True
    detail: str = ""

    @property
    def comparison(self) -> str:
        if self.threshold is None:
            return ""
        return ">=" if self.name in th.HIGHER_IS_BETTER else "<="

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "value": _num(self.value), "threshold": self.threshold,
                "comparison": self.comparison, "passed": self.passed, "enforced": self.enforced,
                "detail": self.detail}


@dataclasses.dataclass
class Report:
    passed: bool
    checks: list[Check]
    data: dict
    directory: Path | None = None

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.enforced and not c.passed]

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def summary(self) -> str:
        from .report import text_summary

        return text_summary(self)


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def choose_mode(mode: str, config: ESMCConfig) -> tuple[str, str]:
    size, ram = fp32_bytes(config), total_ram()
    why = f"fp32 model {size / 2**30:.2f} GiB, RAM {ram / 2**30:.1f} GiB"
    if mode == "auto":
        mode = "full" if size <= FULL_MODEL_RAM_SHARE * ram else "layered"
        return mode, f"auto: {why} ({'<=' if mode == 'full' else '>'} {FULL_MODEL_RAM_SHARE:.0%} of RAM)"
    return mode, f"forced: {why}"


def compare_configs(artifact: ArtifactWeights, source: SourceWeights) -> Check:
    if artifact.config is None:
        return Check("config", "integrity", None, None, False, detail=artifact.config_error)
    diffs = [f"{f}: artifact {getattr(artifact.config, f)}, reference {getattr(source.config, f)}"
             for f in CONFIG_FIELDS if getattr(artifact.config, f) != getattr(source.config, f)]
    return Check("config", "integrity", float(len(diffs)), 0.0, not diffs,
                 detail="; ".join(diffs) or "architecture matches the reference")


def compare_weights(artifact: ArtifactWeights, source: SourceWeights, bound: float,
                    on_step=None) -> tuple[Check, dict]:
    """Relative L2 error of each tensor: artifact (dequantized) against the original, one layer
    of each in memory at a time."""
    config = source.config
    names = names_for(config, "")
    groups = [names_for(config, f"esmc.layers.{i}.") for i in range(config.num_hidden_layers)]
    in_layers = {n for g in groups for n in g}
    groups.append([n for n in names if n not in in_layers])
    per_tensor: dict[str, float] = {}
    problems: list[str] = []
    for group in groups:
        present = [n for n in group if artifact.has(n)]
        problems += [f"{n} missing from the artifact" for n in group if not artifact.has(n)]
        theirs = source.get_many(present)
        mine = artifact.get_many(present)
        for n in present:
            if tuple(mine[n].shape) != tuple(theirs[n].shape):
                problems.append(f"{n}: shape {tuple(mine[n].shape)} in the artifact, "
                                f"{tuple(theirs[n].shape)} in the reference")
                continue
            per_tensor[n] = rel_l2(mine[n].numpy(), theirs[n].numpy())
        del theirs, mine
        if on_step:
            on_step()
    expected = set(names)

    def belongs(n: str) -> bool:  # a parameter, or the scales/biases of a quantized parameter
        module, _, leaf = n.rpartition(".")
        return n in expected or (leaf in ("scales", "biases") and f"{module}.weight" in expected
                                 and artifact.quant_params(module) is not None)

    extra = sorted(n for n in artifact.shapes if not belongs(n))
    problems += [f"{n}: not a parameter of the reference's architecture" for n in extra]
    worst = max(per_tensor, key=per_tensor.get) if per_tensor else None
    value = per_tensor[worst] if worst else None
    over = sorted((n for n, e in per_tensor.items() if e > bound), key=per_tensor.get, reverse=True)
    passed = not problems and value is not None and value <= bound
    detail = "; ".join(problems[:5])
    if over:
        shown = ", ".join(f"{n} ({per_tensor[n]:.3g})" for n in over[:5])
        detail = (detail + "; " if detail else "") + f"{len(over)} tensor(s) over the bound: {shown}"
    elif worst and not problems:
        detail = f"worst tensor {worst}"
    return (Check("weights", "integrity", value, bound, passed, detail=detail),
            {"max_rel_err": value, "worst": worst, "problems": problems, "per_tensor": per_tensor})


def validate(mlx_dir: str | Path, reference: str, sequences: str | Path | None = None,
             report_dir: str | Path | None = None, thresholds: dict[str, float] | None = None,
             max_length: int | None = None, mode: str = "auto", quality_gate: str = "auto",
             revision: str | None = None, compute_dtype: str | None = None, marginal_positions: int = 24,
             max_tokens: int = 4096, progress: bool = False, write: bool = True, plot: bool = True,
             artifact_path: str | Path | None = None) -> Report:
    """Validate the MLX artifact ``mlx_dir`` against the checkpoint ``reference`` (alias, Hub repo
    id, directory or legacy .pth) and write ``report.json``, ``report.md`` and a plot to
    ``report_dir`` (default ``<mlx_dir>/validation``; ``write=False`` writes nothing, ``plot=False``
    skips the PNG). ``artifact_path``: where the artifact will live, when ``mlx_dir`` is a staging
    directory that is moved there after passing (what the report names).

    ``thresholds`` overrides bounds by check name (see ``thresholds.py``); ``mode`` picks the
    full or layer-by-layer references (``auto``: by model size against RAM); ``quality_gate``
    decides whether quality checks can fail the run (``auto``: only against a trained reference).
    Returns the Report (``report.passed``). Raises ValidationError / ConvertError / FastaError
    when validation cannot run at all (missing files, bad options, torch not installed).
    """
    started = time.perf_counter()
    if mode not in MODES:
        raise ValidationError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    if quality_gate not in QUALITY_GATES:
        raise ValidationError(f"quality gate {quality_gate!r}: choose one of {', '.join(QUALITY_GATES)}")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise ValidationError("validation needs torch and transformers: pip install 'esmc-mlx[torch]'") from None
    from . import mlx_side, reference as torch_ref

    artifact = ArtifactWeights(mlx_dir)
    source = SourceWeights(reference, revision)
    panel = build_panel(sequences, max_length=max_length, marginal_positions=marginal_positions)
    batches = panel.batches(max_tokens)
    dtype = mlx_side.compute_dtype(artifact, compute_dtype)
    dtype_name = str(dtype).split(".")[-1]
    precision = th.precision_class(artifact.raw, source.dtype)
    try:
        bounds = th.resolve(precision, dtype_name, thresholds)
    except KeyError as e:
        raise ValidationError(str(e.args[0])) from None
    timings: dict[str, float] = {}
    from tqdm.auto import tqdm

    def timed(key, fn, *args, steps: int | None = None, desc: str = "", **kwargs):
        t = time.perf_counter()
        if steps:
            with tqdm(total=steps, desc=desc, unit="step", disable=not progress, leave=False) as bar:
                out = fn(*args, on_step=bar.update, **kwargs)
        else:
            out = fn(*args, **kwargs)
        timings[key] = round(time.perf_counter() - t, 2)
        return out

    checks = [compare_configs(artifact, source)]
    weights_check, weights_data = timed("weights", compare_weights, artifact, source, bounds.values["weights"],
                                        steps=source.config.num_hidden_layers + 1, desc="weights")
    checks.append(weights_check)
    data: dict = {"weights": _rounded(weights_data)}
    fidelity = quality = None
    torch_mode = mlx_mode = None
    mode_reason = ""
    if artifact.config is not None:
        torch_mode, mode_reason = choose_mode(mode, source.config)
        mlx_mode = torch_mode
        n = len(panel.inputs)
        run_torch = torch_ref.run_full if torch_mode == "full" else torch_ref.run_layered
        mlx_out = art_out = None
        try:  # an artifact whose tensors do not fit its own config.json fails here, on either side
            run_mlx = mlx_side.run_full if mlx_mode == "full" else mlx_side.run_layered
            steps = len(batches) if mlx_mode == "full" else artifact.config.num_hidden_layers
            mlx_out = timed("mlx", run_mlx, artifact, batches, n, dtype, steps=steps, desc=f"MLX ({mlx_mode})")
            steps = len(batches) if torch_mode == "full" else artifact.config.num_hidden_layers
            art_out = timed("torch_artifact", run_torch, artifact.get_many, artifact.config, batches, n,
                            names_for(artifact.config, ""), steps=steps, desc=f"torch, artifact weights ({torch_mode})")
        except (ValueError, KeyError, RuntimeError, EsmcMlxError) as e:
            checks.append(Check("artifact_loads", "integrity", None, None, False, detail=f"{type(e).__name__}: {e}"))
        if art_out is not None:
            steps = len(batches) if torch_mode == "full" else source.config.num_hidden_layers
            orig_out = timed("torch_original", run_torch, source.get_many, source.config, batches, n,
                             names_for(source.config, ""), steps=steps, desc=f"torch, original ({torch_mode})")
            fidelity = fidelity_metrics(panel, mlx_out, art_out)
            quality = quality_metrics(panel, mlx_out, orig_out)
            del mlx_out, art_out, orig_out
            for key, name in (("logits_rel_l2", "fidelity_logits"), ("hidden_rel_l2", "fidelity_hidden")):
                checks.append(Check(name, "fidelity", fidelity[key], bounds.values[name],
                                    bounds.passes(name, fidelity[key]),
                                    detail=f"MLX ({dtype_name}) vs torch fp32 on the artifact's weights"))
            trained = quality["identity_accuracy"]["original"] >= th.TRAINED_IDENTITY_ACCURACY
            enforce = {"auto": trained, "on": True, "off": False}[quality_gate]
            for name in th.QUALITY_COLUMNS[1:]:
                checks.append(Check(name, "quality", quality[name], bounds.values[name],
                                    bounds.passes(name, quality[name]), enforced=enforce))
            quality["enforced"] = enforce
            quality["reference_trained"] = trained
    passed = all(c.passed for c in checks if c.enforced)
    data.update({
        "passed": passed,
        "checks": [c.as_dict() for c in checks],
        "artifact": {"path": str(Path(artifact_path or mlx_dir).resolve()), "dtype": artifact.dtype,
                     "quantization": artifact.record, "precision": precision,
                     "config": artifact.config.to_dict() if artifact.config else None,
                     "files": artifact_files(Path(mlx_dir))},
        "reference": source.describe(),
        "precision": precision,
        "thresholds": bounds.values,
        "quality_gate": quality_gate,
        "reference_mode": {"torch": torch_mode, "mlx": mlx_mode, "torch_dtype": "float32",
                           "mlx_compute_dtype": dtype_name, "reason": mode_reason},
        "fidelity": _rounded(fidelity),
        "quality": _rounded(quality),
        "panel": panel.describe(),
        "versions": versions(),
        "platform": platform_info(),
        "resources": {"seconds": round(time.perf_counter() - started, 2), "timings": timings,
                      "peak_rss_bytes": peak_rss()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    report = Report(passed, checks, data)
    if write:
        from .report import write_report

        report.directory = write_report(report, panel, Path(report_dir) if report_dir else Path(mlx_dir) / "validation",
                                        draw=plot)
    return report


def artifact_files(directory: Path) -> dict[str, str]:
    """sha256 of config.json and every weight file: what this report is about (a push can
    check that the files it uploads are the ones validated)."""
    files = [directory / "config.json", *weight_files(directory)]
    return {f.name: sha256(f) for f in files if f.exists()}


def versions() -> dict:
    import mlx.core as mx

    from .._version import __version__

    out = {"esmc_mlx": __version__, "mlx": mx.__version__, "numpy": np.__version__,
           "python": platform.python_version()}
    for module in ("torch", "transformers", "scipy", "matplotlib"):
        try:
            out[module] = __import__(module).__version__
        except ImportError:
            out[module] = None
    return out


def platform_info() -> dict:
    import mlx.core as mx

    return {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "platform": platform.platform(), "processor": platform.processor() or None,
            "cpu_count": os.cpu_count(), "ram_bytes": total_ram(), "mlx_device": str(mx.default_device()),
            "blas": _blas.loaded_path}


def _num(x):
    if x is None:
        return None
    x = float(x)
    return None if x != x else x


def _rounded(obj):
    """JSON-ready: numpy arrays and floats to lists of 4-significant-digit floats."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [float(f"{v:.4g}") for v in obj.astype(np.float64).ravel()]
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return None if v != v else v
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


__all__ = ["Check", "Report", "validate", "validation_available"]


def validation_available() -> bool:
    """True when torch and transformers (with EsmcForMaskedLM) import."""
    try:
        import torch  # noqa: F401
        from transformers import EsmcForMaskedLM  # noqa: F401
    except ImportError:
        return False
    return True
