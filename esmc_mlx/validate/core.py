"""``validate()``: run the panel through the artifact (MLX) and two torch references, check, report.

In this order, so that whatever can fail cheaply fails before any panel work:
  1. config: the artifact's architecture is the reference's (else: a failing report, nothing run);
  2. weights: every tensor of the artifact (dequantized) against the original, one layer of each
     at a time, by torch on the reference device; NaN or Inf in either fails here. In ``full``
     mode the tensors read for the check are the ones the torch references then run on: each
     layer is read once (on the H200 the check and the loading of both references took 25 s
     when each read its own copy);
  3. the forward passes over the panel: MLX on the artifact, torch on the artifact's weights
     (fidelity) and torch on the original (quality), torch on the fastest device present.
     ``full``: one pass after another, each over the whole model. ``layered``: one sweep over
     the layers, every pass advancing one layer per step, so each layer of the artifact is read
     once for both of its passes. The original's outputs come from the on-disk cache when the
     same source, panel and torch were seen before (``cache.py``); an artifact whose weights are
     the original's, bit for bit (a lossless conversion), reuses them for fidelity too.
torch and transformers are imported in a background thread while the panel and the inputs are
prepared, and the artifact's files are hashed for the report in another while the passes run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import platform
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import _blas
from .._version import __version__
from ..artifact import ARTIFACT_KINDS, FLOAT_DTYPES, REPORT_DIR, sha256, weight_files
from ..config import ESMCConfig
from ..errors import EsmcMlxError, ValidationError, install_hint
from ..fold_artifact import is_fold_directory
from ..fold_config import FoldConfig
from ..hashes import file_hashes
from ..outputs import check_folder_target, ensure_parent, local_paths, locked
from . import cache as ref_cache
from . import mlx_side
from . import reference as torch_ref
from . import thresholds as th
from .metrics import fidelity as fidelity_metrics
from .metrics import quality as quality_metrics
from .panel import build_panel
from .reference import Outputs, fp32_bytes
from .report import check_report_folder, report_entries, text_summary, write_report
from .weights import ArtifactWeights, SourceWeights, names_for

MODES = ("auto", "full", "layered")
QUALITY_GATES = ("auto", "on", "off")
# auto mode: whole fp32 models only when one takes <= 25% of RAM (full mode holds two at once: the
# artifact's and the original's, kept from the weights check) and, with the reference on CUDA,
# <= 30% of the GPU's memory (two of them and MLX's pass fit; the 6B's 23.7 GiB on an H200 does)
FULL_MODEL_RAM_SHARE = 0.25
FULL_MODEL_GPU_SHARE = 0.3
CONFIG_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "rope_theta",
    "layer_norm_eps",
)


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
        return {
            "name": self.name,
            "kind": self.kind,
            "value": _num(self.value),
            "threshold": self.threshold,
            "comparison": self.comparison,
            "passed": self.passed,
            "enforced": self.enforced,
            "detail": self.detail,
        }


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
        return text_summary(self)


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def choose_mode(mode: str, config: ESMCConfig, device_memory: int | None = None) -> tuple[str, str]:
    """``full`` or ``layered``, and why. ``device_memory``: bytes of the CUDA device the torch
    reference runs on (None: MPS or CPU, which share the host's RAM)."""
    size, ram = fp32_bytes(config), total_ram()
    why = f"fp32 model {size / 2**30:.2f} GiB, RAM {ram / 2**30:.1f} GiB"
    if device_memory:
        why += f", GPU {device_memory / 2**30:.0f} GiB"
    if mode == "auto":
        fits = size <= FULL_MODEL_RAM_SHARE * ram and (
            not device_memory or size <= FULL_MODEL_GPU_SHARE * device_memory
        )
        mode = "full" if fits else "layered"
        share = f"{FULL_MODEL_RAM_SHARE:.0%} of RAM" + (
            f", {FULL_MODEL_GPU_SHARE:.0%} of the GPU" if device_memory else ""
        )
        return mode, f"auto: {why} ({'<=' if fits else '>'} {share})"
    return mode, f"forced: {why}"


def compare_configs(artifact: ArtifactWeights, source: SourceWeights) -> Check:
    if artifact.config is None:
        return Check("config", "integrity", None, None, False, detail=artifact.config_error)
    diffs = [
        f"{f}: artifact {getattr(artifact.config, f)}, reference {getattr(source.config, f)}"
        for f in CONFIG_FIELDS
        if getattr(artifact.config, f) != getattr(source.config, f)
    ]
    return Check(
        "config",
        "integrity",
        float(len(diffs)),
        0.0,
        not diffs,
        detail="; ".join(diffs) or "architecture matches the reference",
    )


def compare_weights(
    artifact: ArtifactWeights,
    source: SourceWeights,
    bound: float,
    device="cpu",
    keep: tuple[str, ...] = (),
    on_step=None,
) -> tuple[Check, dict, dict[str, dict]]:
    """Relative L2 error of each tensor, artifact (dequantized) against the original, one layer of
    each at a time, computed by torch on ``device`` from the very tensors the torch references
    load: ``keep`` names the sides ("artifact", "source") whose tensors are kept for them (the
    third value returned), so that each layer is read once for the check and its pass. A tensor
    holding NaN or Inf on either side is a problem of its own (``data["non_finite"]``)."""
    config = source.config
    names = names_for(config, "")
    groups = [names_for(config, f"esmc.layers.{i}.") for i in range(config.num_hidden_layers)]
    in_layers = {n for g in groups for n in g}
    groups.append([n for n in names if n not in in_layers])
    errors = TensorErrors()
    kept: dict[str, dict] = {side: {} for side in keep}
    for group in groups:
        present = [n for n in group if artifact.has(n)]
        errors.problems += [f"{n} missing from the artifact" for n in group if not artifact.has(n)]
        theirs = source.get_many(present, device)
        mine = artifact.get_many(present, device)
        errors.add(mine, theirs)
        for side, tensors in (("artifact", mine), ("source", theirs)):
            if side in kept:
                kept[side].update(tensors)
        del theirs, mine
        if on_step:
            on_step()
    check, data = errors.check(artifact, set(names), bound)
    return check, data, kept


class TensorErrors:
    """The weights check, accumulated one group of tensors at a time (``add``) and judged once
    (``check``): the relative L2 error of each artifact tensor against the original's, the
    tensors missing, misshapen or holding NaN/Inf on either side."""

    def __init__(self):
        self.per_tensor: dict[str, float] = {}
        self.problems: list[str] = []
        self.non_finite: list[str] = []

    def add(self, mine: dict, theirs: dict) -> None:
        """Compare ``mine[n]`` with ``theirs[n]`` (torch tensors on one device) for every name of
        ``mine``, with one synchronisation for all of them."""
        import torch

        stats = {}
        for n in mine:
            if tuple(mine[n].shape) != tuple(theirs[n].shape):
                self.problems.append(
                    f"{n}: shape {tuple(mine[n].shape)} in the artifact, {tuple(theirs[n].shape)} in the reference"
                )
                continue
            a, b = mine[n], theirs[n]
            stats[n] = torch.stack(
                [_l2(a - b), _l2(b), torch.isfinite(a).all().float(), torch.isfinite(b).all().float()]
            )
        rows = torch.stack(list(stats.values())).cpu().tolist() if stats else []  # one sync per group
        for n, (diff, norm, finite_a, finite_b) in zip(stats, rows):
            if not (finite_a and finite_b):
                where = " and ".join(w for w, ok in (("the artifact", finite_a), ("the reference", finite_b)) if not ok)
                self.non_finite.append(f"{n}: NaN or Inf in {where}")
                continue
            self.per_tensor[n] = diff / norm if norm > 0 else diff

    def check(self, artifact: ArtifactWeights, expected: set[str], bound: float) -> tuple[Check, dict]:
        """The ``weights`` check and its data; ``expected``: the names of the reference's
        parameters (an artifact tensor that is none of them, nor the scales/biases of one it
        quantized, is a problem)."""
        per_tensor = self.per_tensor
        problems = self.non_finite + self.problems

        def belongs(n: str) -> bool:  # a parameter, or the scales/biases of a quantized parameter
            module, _, leaf = n.rpartition(".")
            return n in expected or (
                leaf in ("scales", "biases")
                and f"{module}.weight" in expected
                and artifact.quant_params(module) is not None
            )

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
        return Check("weights", "integrity", value, bound, passed, detail=detail), {
            "max_rel_err": value,
            "worst": worst,
            "problems": problems,
            "non_finite": self.non_finite,
            "per_tensor": per_tensor,
        }


def _l2(x):
    """||x|| in fp32 on x's device without overflow (MPS has no float64): scaled by max |x|, so
    that a weight of 1e20 squares to no Inf. NaN stays NaN."""
    import torch

    top = x.abs().amax()
    return top * torch.linalg.vector_norm(x / top.clamp_min(torch.finfo(x.dtype).tiny))


def _import_torch() -> None:
    """Import torch and transformers' ESMC (in the background; waited for before torch runs)."""
    try:
        import torch  # noqa: F401
        from transformers.masking_utils import create_bidirectional_mask  # noqa: F401
        from transformers.models.esmc import modeling_esmc  # noqa: F401
    except Exception:  # noqa: BLE001  (the main thread's own import reports it)
        pass


@functools.cache
def prefetch_torch() -> threading.Thread:
    """Start importing torch and transformers' ESMC in a daemon thread, once per process, and
    return that thread (join it before torch runs). ``validate`` starts it first thing; the
    converter already before a conversion it will validate, so that the import (5 s on the H200
    host, 3-8 s on a small CPU) runs beside the conversion instead of before the validation."""
    thread = threading.Thread(target=_import_torch, name="esmc-mlx-torch-import", daemon=True)
    thread.start()
    return thread


def non_finite(outputs: Outputs, panel) -> str | None:
    """The first input whose logits or hidden states hold NaN or Inf, named; None if all finite."""
    for i, (logits, hidden) in enumerate(zip(outputs.logits, outputs.hidden)):
        if not (np.isfinite(logits).all() and np.isfinite(hidden).all()):
            return panel.inputs[i].name
    return None


class Timings(dict):
    """Seconds each step of a validation took (the report's ``timings``), and its progress bar's
    current step: what the model and fold validators share."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar

    def phase(self, name: str) -> None:
        self.bar.set_postfix_str(name)

    def timed(self, key: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its seconds kept under ``key``."""
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self[key] = round(time.perf_counter() - t, 2)
        return out


def check_run_options(quality_gate: str, reference_device: str, compute_dtype: str | None, max_length) -> None:
    """ValidationError for an option every validation takes (models and fold artifacts alike)."""
    if quality_gate not in QUALITY_GATES:
        raise ValidationError(f"quality gate {quality_gate!r}: choose one of {', '.join(QUALITY_GATES)}")
    if reference_device not in torch_ref.DEVICES:
        raise ValidationError(f"reference device {reference_device!r}: choose one of {', '.join(torch_ref.DEVICES)}")
    if compute_dtype is not None and compute_dtype not in FLOAT_DTYPES:
        raise ValidationError(f"compute_dtype {compute_dtype!r}: choose one of {', '.join(FLOAT_DTYPES)}")
    if max_length is not None and (type(max_length) is not int or max_length < 1):  # 0 cropped nothing
        raise ValidationError(f"max_length={max_length!r}: give a positive number of residues, or None")


def checked_report_folder(mlx_dir, report_dir, write: bool, reference: str, sequences) -> Path:
    """Where the report goes (``report_dir``, else ``<mlx_dir>/validation``), checked now when it
    will be written: a report folder that cannot be made fails before the whole validation."""
    report_folder = Path(report_dir) if report_dir else Path(mlx_dir) / REPORT_DIR
    if write:
        ensure_parent(report_folder / "report.json", create=False)
        check_report_folder(report_folder)
        if report_dir is not None:  # a folder of its own: the target check every output gets
            check_folder_target(
                report_folder,
                "report",
                [Path(mlx_dir), *local_paths(reference, sequences)],
                legacy=report_entries,
                hosts=(*ARTIFACT_KINDS, "staging"),
                option="--report",
            )
    return report_folder


def artifact_record(artifact, path, precision: str, files: dict) -> dict:
    """What a report says of the artifact validated: where it lives, its dtype, quantization,
    precision class, config and files' sha256."""
    return {
        "path": str(Path(path).resolve()),
        "dtype": artifact.dtype,
        "quantization": artifact.record,
        "precision": precision,
        "config": artifact.config.to_dict() if artifact.config else None,
        "files": files,
    }


def run_facts(started: float, timings: dict) -> dict:
    """What a report records of the run: versions, platform, time and memory, when."""
    return {
        "versions": versions(),
        "platform": platform_info(),
        "resources": {
            "seconds": round(time.perf_counter() - started, 2),
            "timings": timings,
            "peak_rss_bytes": peak_rss(),
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def wind_down(bar, stack: contextlib.ExitStack, background: ThreadPoolExecutor, importing) -> None:
    """A validation's end, on an error too: the bar ends its line (so an Error line starts on its
    own), torch's thread count is restored, no import or hash is left running into shutdown."""
    bar.close()
    stack.close()
    background.shutdown(wait=True)
    if importing is not None:
        importing.join()


# Writing its report into MLX_DIR, validation holds MLX_DIR's lock for the whole run, as the writers
# of MLX_DIR do: a conversion replacing MLX_DIR meanwhile would get a report of the old weights.
# (In the pipeline, MLX_DIR is a private staging directory under the output's lock.)
@locked(
    "mlx_dir",
    when=lambda args: args["write"] and args["report_dir"] is None and args["artifact_path"] is None,
    create_parent=False,
    optional=True,
)
def validate(
    mlx_dir: str | Path,
    reference: str,
    sequences: str | Path | None = None,
    report_dir: str | Path | None = None,
    thresholds: dict[str, float] | None = None,
    max_length: int | None = None,
    mode: str = "auto",
    quality_gate: str = "auto",
    revision: str | None = None,
    compute_dtype: str | None = None,
    marginal_positions: int = 24,
    max_tokens: int = 4096,
    progress: bool = False,
    write: bool = True,
    plot: bool = True,
    reference_device: str = "auto",
    cache: bool = True,
    artifact_path: str | Path | None = None,
) -> Report:
    """Validate the MLX artifact ``mlx_dir`` against the checkpoint ``reference`` (alias, Hub repo
    id, directory or legacy .pth) and write ``report.json``, ``report.md`` and a plot to
    ``report_dir`` (default ``<mlx_dir>/validation``; ``write=False`` writes nothing, ``plot=False``
    skips the PNG). ``artifact_path``: where the artifact will live, when ``mlx_dir`` is a staging
    directory that is moved there after passing (what the report names).

    ``thresholds`` overrides bounds by check name (see ``thresholds.py``); ``mode`` picks the
    full or layer-by-layer references (``auto``: by model size against RAM and GPU memory);
    ``quality_gate`` decides whether quality checks can fail the run (``auto``: only against a
    trained reference); ``reference_device`` is where torch runs (``auto``: CUDA, else MPS, else
    the CPU); ``cache=False`` neither reads nor writes the cache of the original's outputs.
    Returns the Report (``report.passed``): a config that contradicts the reference, or NaN/Inf
    in either model's weights, gives a failing report before any panel work. Raises
    ValidationError / ConvertError / FastaError when validation cannot run at all (missing
    files, bad options, torch not installed, no such device), OutputError when another
    esmc-mlx run is writing ``mlx_dir`` (with the default report folder).
    """
    started, started_cpu = time.perf_counter(), time.process_time()
    if mode not in MODES:
        raise ValidationError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    check_run_options(quality_gate, reference_device, compute_dtype, max_length)
    if type(marginal_positions) is not int or marginal_positions < 1:  # 0: a Spearman of nothing, failed
        raise ValidationError(f"marginal_positions={marginal_positions!r}: give a positive integer")
    th.check_overrides(thresholds)
    if not validation_available():
        raise ValidationError(
            f"validation needs torch and transformers (>= 5.23, with EsmcForMaskedLM): {install_hint('torch')}"
        )
    from tqdm.auto import tqdm

    if is_fold_directory(Path(mlx_dir)):
        raise ValidationError(
            f"{mlx_dir} is an ESMFold2 fold artifact: validate it with esmc_mlx.validate.fold.validate_fold_artifact "
            "(esmc-mlx validate picks it)"
        )
    artifact = ArtifactWeights(mlx_dir)
    report_folder = checked_report_folder(mlx_dir, report_dir, write, reference, sequences)
    source = SourceWeights(reference, revision)
    if isinstance(source.config, FoldConfig):
        raise ValidationError(
            f"reference {reference} is an ESMFold2 checkpoint, {mlx_dir} an ESMC model: validate an ESMC against "
            "the ESMC it was converted from, a fold artifact against its ESMFold2"
        )
    panel = build_panel(sequences, max_length=max_length, marginal_positions=marginal_positions)
    batches = panel.batches(max_tokens)
    dtype = mlx_side.compute_dtype(artifact, compute_dtype)
    dtype_name = str(dtype).split(".")[-1]
    precision = th.precision_class(artifact.raw, source.dtype)
    try:
        bounds = th.resolve(precision, dtype_name, thresholds)
    except KeyError as e:
        raise ValidationError(str(e.args[0])) from None
    n = len(panel.inputs)
    n_layers = source.config.num_hidden_layers
    # one bar over the whole validation; its total is refined once the passes are known
    bar = tqdm(total=(n_layers + 1) + 3 * len(batches), desc="validating", unit="step", disable=not progress)
    timings = Timings(bar)
    phase, timed = timings.phase, timings.timed

    checks = [compare_configs(artifact, source)]
    importing = prefetch_torch() if checks[0].passed else None
    background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="esmc-mlx")
    # the source's sha256 (the cache key; 5 s for a 12 GB source unless remembered) while torch
    # imports, and the report's sha256 of the artifact's files while the GPU works
    source_hashing = background.submit(file_hashes, source.files) if cache and checks[0].passed else None
    hashing = background.submit(artifact_files, Path(mlx_dir))
    stack = contextlib.ExitStack()  # torch's thread count, restored on the way out
    threads = None
    try:
        data: dict = {"weights": None}
        fidelity = quality = None
        torch_mode = device = None
        mode_reason, shared, cache_info = "", {}, {"used": False}
        stopped = None  # why the panel did not run
        outs: dict[str, Outputs] = {}
        kept: dict[str, dict] = {}
        orig_out = entry = None
        if not checks[0].passed:
            stopped = "config"
        else:
            phase("importing torch")
            timed("torch_import", importing.join)  # what is left of it once the work needs torch
            import torch  # noqa: F401  (imported by now; raises here if the background import failed)

            device = timed("device", torch_ref.pick_device, reference_device)
            torch_mode, mode_reason = choose_mode(mode, source.config, torch_ref.device_memory(device))
            if cache:
                t = time.perf_counter()
                entry = ref_cache.key(source_hashing.result(), source.config.to_dict(), panel.digest, device.type)
                orig_out = ref_cache.load(entry, n)
                timings["cache"] = round(time.perf_counter() - t, 2)
                cache_info = {
                    "used": True,
                    "hit": orig_out is not None,
                    "entry": entry,
                    "path": str(ref_cache.path_for(entry) or ""),
                }
            own_load = (time.process_time() - started_cpu) / max(time.perf_counter() - started, 1e-3)
            threads = stack.enter_context(torch_ref.cpu_threads(device, own_load))
            # full mode: the weights check reads each tensor once, onto the reference device,
            # and hands it on to the torch pass that needs it; layered mode streams per layer
            keep = ("artifact",) + (("source",) if orig_out is None else ()) if torch_mode == "full" else ()
            phase("weights")
            weights_check, weights_data, kept = timed(
                "weights",
                compare_weights,
                artifact,
                source,
                bounds.values["weights"],
                device,
                keep,
                on_step=bar.update,
            )
            checks.append(weights_check)
            data["weights"] = _rounded(weights_data)
            if weights_data["non_finite"]:
                stopped = "non-finite weights"
        if stopped is None:
            lossless = (
                weights_check.value == 0
                and not weights_data["problems"]
                and artifact.config.to_dict() == source.config.to_dict()
            )
            if lossless:
                shared["torch_artifact"] = "torch_original (the artifact's weights are the original's, bit for bit)"
                kept.pop("artifact", None)
            passes = (
                ["mlx"]
                + ([] if lossless else ["torch_artifact"])
                + ([] if orig_out is not None else ["torch_original"])
            )
            bar.total = bar.n + ((n_layers + 2) if torch_mode == "layered" else len(passes) * len(batches))
            bar.refresh()
            art_names, src_names = names_for(artifact.config, ""), names_for(source.config, "")
            art_get = _kept_first(kept.get("artifact"), artifact.get_many)
            src_get = _kept_first(kept.get("source"), source.get_many)
            try:
                if torch_mode == "layered":
                    phase("layered sweep: " + ", ".join(passes))
                    steps = {
                        "mlx": lambda: mlx_side.layered_steps(artifact, batches, n, dtype),
                        "torch_artifact": lambda: torch_ref.layered_steps(
                            art_get, artifact.config, batches, n, art_names, device
                        ),
                        "torch_original": lambda: torch_ref.layered_steps(
                            src_get, source.config, batches, n, src_names, device
                        ),
                    }
                    outs.update(timed("sweep", _lockstep, {p: steps[p]() for p in passes}, artifact, bar.update))
                else:
                    phase("MLX")
                    try:
                        outs["mlx"] = timed("mlx", mlx_side.run_full, artifact, batches, n, dtype, on_step=bar.update)
                    except (ValueError, KeyError, RuntimeError, EsmcMlxError) as e:
                        raise _ArtifactFailed(f"{type(e).__name__}: {e}") from None
                    if "torch_artifact" in passes:
                        phase(f"torch on the artifact's weights ({device.type})")
                        outs["torch_artifact"] = timed(
                            "torch_artifact",
                            torch_ref.run_full,
                            art_get,
                            artifact.config,
                            batches,
                            n,
                            art_names,
                            bar.update,
                            device,
                        )
            except _ArtifactFailed as e:
                checks.append(Check("artifact_loads", "integrity", None, None, False, detail=str(e)))
            except (ValueError, KeyError, RuntimeError, EsmcMlxError) as e:
                checks.append(
                    Check("artifact_loads", "integrity", None, None, False, detail=f"{type(e).__name__}: {e}")
                )
            kept.pop("artifact", None)
            if "mlx" in outs and (lossless or "torch_artifact" in outs):
                if "torch_original" in passes and "torch_original" not in outs:
                    phase(f"torch on the original ({device.type})")
                    outs["torch_original"] = timed(
                        "torch_original",
                        torch_ref.run_full,
                        src_get,
                        source.config,
                        batches,
                        n,
                        src_names,
                        bar.update,
                        device,
                    )
                orig_out = outs.get("torch_original", orig_out)
                if entry and "torch_original" in outs and non_finite(orig_out, panel) is None:
                    ref_cache.store(entry, orig_out)
                art_out = orig_out if lossless else outs["torch_artifact"]
                mlx_out = outs["mlx"]
                bad = [
                    f"{label}: NaN or Inf in the outputs for {where!r}"
                    for label, out in (
                        ("MLX", mlx_out),
                        ("torch on the artifact's weights", art_out),
                        ("torch on the original", orig_out),
                    )
                    if (where := non_finite(out, panel))
                ]
                if bad:
                    checks.append(Check("finite_outputs", "integrity", None, None, False, detail="; ".join(bad)))
                phase("metrics")
                fidelity = fidelity_metrics(panel, mlx_out, art_out)
                quality = quality_metrics(panel, mlx_out, orig_out)
                del mlx_out, art_out, orig_out
                for key, name in (("logits_rel_l2", "fidelity_logits"), ("hidden_rel_l2", "fidelity_hidden")):
                    checks.append(
                        Check(
                            name,
                            "fidelity",
                            fidelity[key],
                            bounds.values[name],
                            bounds.passes(name, fidelity[key]),
                            detail=f"MLX ({dtype_name}) vs torch fp32 on the artifact's weights",
                        )
                    )
                trained = quality["identity_accuracy"]["original"] >= th.TRAINED_IDENTITY_ACCURACY
                enforce = {"auto": trained, "on": True, "off": False}[quality_gate]
                for name in th.QUALITY_COLUMNS[1:]:
                    checks.append(
                        Check(
                            name,
                            "quality",
                            quality[name],
                            bounds.values[name],
                            bounds.passes(name, quality[name]),
                            enforced=enforce,
                        )
                    )
                quality["enforced"] = enforce
                quality["reference_trained"] = trained
        bar.close()
        passed = all(c.passed for c in checks if c.enforced)
        data.update(
            {
                "passed": passed,
                "checks": [c.as_dict() for c in checks],
                "stopped_before_panel": stopped,
                "artifact": artifact_record(artifact, artifact_path or mlx_dir, precision, hashing.result()),
                "reference": source.describe(),
                "precision": precision,
                "thresholds": bounds.values,
                "quality_gate": quality_gate,
                "reference_mode": {
                    "torch": torch_mode,
                    "mlx": torch_mode,  # MLX runs as torch does: whole, or in the same sweep
                    "torch_dtype": "float32",
                    "torch_device": torch_ref.describe_device(device) if device is not None else None,
                    "torch_threads": threads,
                    "mlx_compute_dtype": dtype_name,
                    "reason": mode_reason,
                    "shared": shared,
                },
                "reference_cache": cache_info,
                "fidelity": _rounded(fidelity),
                "quality": _rounded(quality),
                "panel": panel.describe(),
                **run_facts(started, timings),
            }
        )
        report = Report(passed, checks, data)
        if write:
            report.directory = write_report(report, panel, report_folder, draw=plot, own_folder=report_dir is not None)
        return report
    finally:
        wind_down(bar, stack, background, importing)


def _kept_first(kept: dict | None, get):
    """A weights getter for a torch pass: tensors the weights check kept (handed over once, then
    dropped), the rest from ``get``."""
    kept = {} if kept is None else kept

    def fetch(names: list[str], device) -> dict:
        out = {n: kept.pop(n) for n in names if n in kept}
        missing = [n for n in names if n not in out]
        return {**out, **(get(missing, device) if missing else {})}

    return fetch


class _ArtifactFailed(Exception):
    """A pass on the artifact (MLX or torch on its weights) could not build or run its model."""


def _lockstep(steps: dict, artifact: ArtifactWeights, on_step) -> dict[str, Outputs]:
    """Advance every layered pass one layer at a time, in the same sweep: the artifact's tensors
    read for a layer are kept (``share_reads``) until every pass has run that layer."""
    results: dict[str, Outputs] = {}
    artifact.share_reads()
    try:
        while len(results) < len(steps):
            for name, gen in steps.items():
                if name in results:
                    continue
                try:
                    next(gen)
                except StopIteration as done:
                    results[name] = done.value
                except (ValueError, KeyError, RuntimeError, EsmcMlxError) as e:
                    if name == "torch_original":
                        raise
                    raise _ArtifactFailed(f"{type(e).__name__}: {e}") from None
            artifact.forget()
            on_step()
    finally:
        artifact.forget(stop=True)
    return results


def artifact_files(directory: Path) -> dict[str, str]:
    """sha256 of config.json and every weight file: what this report is about (a push can
    check that the files it uploads are the ones validated)."""
    files = [directory / "config.json", *weight_files(directory)]
    return {f.name: sha256(f) for f in files if f.exists()}


def versions() -> dict:

    out = {"esmc_mlx": __version__, "mlx": mx.__version__, "numpy": np.__version__, "python": platform.python_version()}
    for module in ("torch", "transformers", "scipy", "matplotlib"):
        try:
            out[module] = __import__(module).__version__
        except ImportError:
            out[module] = None
    return out


def platform_info() -> dict:

    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "ram_bytes": total_ram(),
        "mlx_device": str(mx.default_device()),
        "blas": _blas.loaded_path,
    }


def _num(x):
    """A JSON number: NaN and +-Inf become None (JSON has no such numbers)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _rounded(obj):
    """JSON-ready: numpy arrays and floats to lists of 4-significant-digit floats."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [float(f"{v:.4g}") if math.isfinite(v) else None for v in obj.astype(np.float64).ravel()]
    if isinstance(obj, (float, np.floating)):
        return _num(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


__all__ = ["Check", "Report", "validate", "validation_available"]


def validation_available() -> bool:
    """True when torch and a transformers with EsmcForMaskedLM are installed. Looks at the
    installed files without importing them (that takes seconds), so a command can refuse
    ``--validate`` before it converts anything."""
    from importlib.util import find_spec

    try:
        torch_spec, tf_spec = find_spec("torch"), find_spec("transformers")
    except (ImportError, ValueError):
        return False
    if torch_spec is None or tf_spec is None or not tf_spec.submodule_search_locations:
        return False
    return any((Path(p) / "models" / "esmc" / "modeling_esmc.py").exists() for p in tf_spec.submodule_search_locations)
