"""``validate_fold_artifact()``: fold a panel of proteins with an ESMFold2 fold artifact (MLX) and
with transformers' ``EsmFold2Model``, under the same random draws, check, report.

The two questions of every report (docs/validation.md), for structures:
  * fidelity: the MLX fold against transformers' on the weights the artifact holds (its
    quantized backbone dequantized; the folding model is float), float32 on both sides unless
    asked otherwise: distogram logits, coordinates, pLDDT, PAE, pTM;
  * quality: the artifact's fold against the original checkpoint's, on the same draws: C-alpha
    RMSD after superposition, lDDT-C-alpha, pLDDT and PAE mean absolute error, pTM error.

One fold per protein and side, in this order, so that each is computed once and shared:
  1. config: the artifact's architecture is the reference's (else: a failing report, nothing run);
  2. transformers on the original, on the fastest torch device (``reference.pick_device``), its
     random draws recorded (``fold_reference``);
  3. the weights check, as the original's tensors in that model are replaced by the artifact's
     (dequantized) one group at a time: each tensor is read once for the check and the pass, and
     one model's worth of memory is held, not two;
  4. transformers on the artifact's weights, replaying the original's draws; skipped when every
     tensor is the original's bit for bit (a lossless conversion: the same computation);
  5. MLX on the artifact (``esmc_mlx.load_fold``, what users run), replaying the same draws: its
     structures serve fidelity (against 4) and quality (against 2).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import EsmcMlxError, ValidationError, install_hint
from ..fold_artifact import is_fold_directory
from ..fold_config import FoldConfig
from ..outputs import locked
from ..runtime.fold.draws import Replay
from ..tasks.fold import fold, load_fold, protein_features
from . import mlx_side
from . import reference as torch_ref
from . import thresholds as th
from .core import (
    Check,
    Report,
    TensorErrors,
    Timings,
    _rounded,
    artifact_files,
    artifact_record,
    check_run_options,
    checked_report_folder,
    prefetch_torch,
    run_facts,
    validate,
    validation_available,
    wind_down,
)
from .fold_reference import reference_fold
from .metrics import ca_atoms, ca_geometry, fold_fidelity, fold_quality
from .panel import FoldPanel, build_fold_panel
from .report import write_report
from .weights import FoldArtifactWeights, SourceWeights

# report name -> key of metrics.fold_fidelity / fold_quality
FIDELITY_KEYS = {
    "fidelity_distogram": "distogram_rel_l2",
    "fidelity_ca": "ca_max_dev",
    "fidelity_atoms": "atom_max_dev",
    "fidelity_plddt": "plddt_max_err",
    "fidelity_pae": "pae_max_err",
    "fidelity_ptm": "ptm_err",
}


CONFIDENCES = ("fidelity_plddt", "fidelity_pae", "fidelity_ptm")


def _flipped(fidelity: dict) -> str:
    """What the confidence checks left out: samples whose structures bin a pair differently."""
    if not fidelity["bin_flips"]:
        return ""
    left = [n for n, v in fidelity["per_input"].items() if v["bin_flips"]]
    return (
        f"; {fidelity['bin_flips']} token pair(s) within the coordinates' deviation of a distance-bin boundary "
        f"binned differently ({', '.join(left)}): those samples' confidences not compared"
    )


def _options(samples, steps, loops, seed) -> None:
    for name, value, low, optional in (
        ("samples", samples, 1, False),
        ("steps", steps, 1, True),
        ("loops", loops, 0, True),
        ("seed", seed, 0, False),
    ):
        if (value is None and not optional) or (
            value is not None and (type(value) is not int or value < low)  # bools and floats too
        ):
            raise ValidationError(f"{name}={value!r}: give an integer >= {low}" + (", or None" if optional else ""))


def compare_fold_configs(artifact: FoldArtifactWeights, source: SourceWeights) -> Check:
    """The artifact's architecture against the reference's, every field of the ESMFold2 config
    and of its backbone's, differences named by their dotted path."""
    if artifact.config is None:
        return Check("config", "integrity", None, None, False, detail=artifact.config_error)
    if not isinstance(source.config, FoldConfig):
        return Check(
            "config",
            "integrity",
            None,
            0.0,
            False,
            detail=f"the reference {source.id} is an ESMC model, not an ESMFold2: give the checkpoint it was converted from",
        )
    mine, theirs = _flat(artifact.config.to_dict()), _flat(source.config.to_dict())
    diffs = [
        f"{k}: artifact {mine.get(k)}, reference {theirs.get(k)}"
        for k in sorted(mine.keys() | theirs.keys())
        if mine.get(k) != theirs.get(k)
    ]
    return Check(
        "config",
        "integrity",
        float(len(diffs)),
        0.0,
        not diffs,
        detail="; ".join(diffs[:5]) or "architecture matches the reference",
    )


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
            continue
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --- transformers' side ---------------------------------------------------------------------------
def _torch_model(config: FoldConfig, device):
    """transformers' EsmFold2Model of ``config`` on the meta device (weights come by assignment:
    no random init of a 6B backbone), its state dict's names, in groups of one backbone layer."""
    import torch
    from transformers import EsmFold2Config, EsmFold2Model

    cfg = EsmFold2Config.from_dict(config.to_dict())
    with torch.device("meta"):
        model = EsmFold2Model(cfg)
    return model, torch_ref._by_layer(list(model.state_dict()))


def _assign(model, tensors: dict) -> None:
    unexpected = model.load_state_dict(tensors, strict=False, assign=True).unexpected_keys
    if unexpected:
        raise KeyError(f"not parameters of EsmFold2Model: {', '.join(unexpected[:5])}")


def _finish(model, device):
    """The model ready to run: its one buffer outside the state dict (the backbone's rotary
    frequencies) made on ``device``, every tensor checked to hold data."""
    import torch
    from transformers.models.esmc.modeling_esmc import EsmcRotaryEmbedding

    with torch.device(device):
        model.esmc.rotary_emb = EsmcRotaryEmbedding(model.config.esmc_config)
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise KeyError(f"no weights for {', '.join(empty[:5])}")
    return model.eval()


def _torch_outputs(out: dict) -> dict:
    return {
        "coords": out["sample_atom_coords"],
        "distogram": out["distogram_logits"][0],
        "plddt": out["plddt"],
        "pae": out["pae"],
        "ptm": out["ptm"],
        "iptm": out["iptm"],
    }


def _mlx_outputs(structure) -> dict:
    return {
        "coords": structure.coords,
        "distogram": structure.distogram_logits,
        "plddt": structure.plddt,
        "pae": structure.pae,
        "ptm": structure.ptm,
        "iptm": structure.iptm,
    }


def _non_finite(outputs: list[dict], panel: FoldPanel) -> str | None:
    for protein, out in zip(panel.proteins, outputs):
        if not all(np.isfinite(v).all() for v in out.values()):
            return protein.name
    return None


class _ArtifactFailed(Exception):
    """The artifact's fold (MLX, or transformers on its weights) could not be built or run."""


# --- the validation -------------------------------------------------------------------------------
@locked(
    "mlx_dir",
    when=lambda args: args["write"] and args["report_dir"] is None and args["artifact_path"] is None,
    create_parent=False,
    optional=True,
)
def validate_fold_artifact(
    mlx_dir: str | Path,
    reference: str,
    sequences: str | Path | None = None,
    report_dir: str | Path | None = None,
    thresholds: dict[str, float] | None = None,
    max_length: int | None = None,
    quality_gate: str = "auto",
    revision: str | None = None,
    compute_dtype: str | None = None,
    samples: int = 1,
    steps: int | None = None,
    loops: int | None = None,
    seed: int = 0,
    progress: bool = False,
    write: bool = True,
    plot: bool = True,
    reference_device: str = "auto",
    artifact_path: str | Path | None = None,
) -> Report:
    """Validate the fold artifact ``mlx_dir`` against the ESMFold2 checkpoint ``reference``
    (alias, Hub repo id or directory) on a panel of proteins (``sequences``, a FASTA whose records
    are chains or complexes ``A|B``; default the bundled ``data/fold_panel.fasta``), and write
    ``report.json``, ``report.md`` and a plot to ``report_dir`` (default ``<mlx_dir>/validation``;
    ``write=False`` writes nothing, ``plot=False`` skips the PNG). ``artifact_path``: where the
    artifact will live, when ``mlx_dir`` is a staging directory (what the report names).

    Each protein is folded once per side with ``samples`` diffusion samples, ``steps`` sampling
    steps and ``loops`` recycling loops (default: the config's), the draws of transformers' fold
    of the original (from ``seed``) replayed into the others; ``max_length`` crops every chain.
    ``thresholds`` overrides bounds by check name (``thresholds.FOLD_CHECK_NAMES``);
    ``compute_dtype``: MLX's (default float32, TF32 off: the reference's own precision);
    ``quality_gate``: whether quality checks can fail the run (``auto``: when the artifact is
    lossless, or the original's structures look trained); ``reference_device``: where torch runs
    (``auto``: CUDA, else MPS, else the CPU). Returns the Report (``report.passed``). Raises
    ValidationError / ConvertError / FastaError / FoldError when validation cannot run at all
    (bad options, missing files, torch not installed, no such device, a panel record the fold
    cannot take), OutputError when another esmc-mlx run is writing ``mlx_dir``."""
    started, started_cpu = time.perf_counter(), time.process_time()
    check_run_options(quality_gate, reference_device, compute_dtype, max_length)
    _options(samples, steps, loops, seed)
    th.check_overrides(thresholds, th.FOLD_CHECK_NAMES)
    if not validation_available():
        raise ValidationError(
            f"validation needs torch and transformers (>= 5.24, with EsmFold2Model): {install_hint('torch')}"
        )
    from tqdm.auto import tqdm

    if not is_fold_directory(Path(mlx_dir)):
        raise ValidationError(f"{mlx_dir}: not a fold artifact (its config.json does not describe an ESMFold2)")
    artifact = FoldArtifactWeights(mlx_dir)
    report_folder = checked_report_folder(mlx_dir, report_dir, write, reference, sequences)
    source = SourceWeights(reference, revision)
    panel = build_fold_panel(sequences, max_length)
    features = [(p.name, protein_features(list(p.chains))) for p in panel.proteins]
    dtype = mlx_side.compute_dtype(artifact, compute_dtype)
    dtype_name = str(dtype).split(".")[-1]
    precision = th.precision_class(artifact.raw, source.dtype)
    try:
        bounds = th.resolve_fold(precision, dtype_name, thresholds)
    except KeyError as e:
        raise ValidationError(str(e.args[0])) from None
    config = artifact.config or (source.config if isinstance(source.config, FoldConfig) else None)
    steps_run = steps if steps is not None else (config.structure_head.inference_num_steps if config else None)
    loops_run = loops if loops is not None else (config.num_loops if config else None)
    n = len(panel.proteins)
    bar = tqdm(total=3 * n, desc="validating", unit="step", disable=not progress)
    timings = Timings(bar)
    phase, timed = timings.phase, timings.timed

    checks = [compare_fold_configs(artifact, source)]
    importing = prefetch_torch() if checks[0].passed else None
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="esmc-mlx")
    hashing = background.submit(artifact_files, Path(mlx_dir))  # the report's sha256s, while the folds run
    stack = contextlib.ExitStack()  # torch's thread count, restored on the way out
    threads = device = None
    shared: dict[str, str] = {}
    fidelity = quality = weights_data = None
    stopped = None  # why the folds did not all run
    try:
        if not checks[0].passed:
            stopped = "config"
        else:
            phase("importing torch")
            timed("torch_import", importing.join)
            import torch

            device = timed("device", torch_ref.pick_device, reference_device)
            own_load = (time.process_time() - started_cpu) / max(time.perf_counter() - started, 1e-3)
            threads = stack.enter_context(torch_ref.cpu_threads(device, own_load))
            run = dict(samples=samples, steps=steps_run, loops=loops_run)
            phase(f"torch on the original ({device.type})")
            model, groups = _torch_model(source.config, device)
            bar.total += 2 * len(groups)
            for group in groups:
                _assign(model, source.get_many(group, device))
                bar.update()
            _finish(model, device)
            t = time.perf_counter()
            original, drawn = [], []
            for _, f in features:
                out, draws = reference_fold(model, f, seed=seed, **run)
                original.append(_torch_outputs(out))
                drawn.append(draws)
                bar.update()
            timings["torch_original"] = round(time.perf_counter() - t, 2)

            phase("weights")
            t = time.perf_counter()
            errors = TensorErrors()
            for group in groups:  # the original's tensors give way to the artifact's, compared on the way
                present = [name for name in group if artifact.has(name)]
                errors.problems += [f"{name} missing from the artifact" for name in group if not artifact.has(name)]
                mine = artifact.get_many(present, device)
                current = model.state_dict()
                errors.add(mine, {name: current[name] for name in present})
                del current
                _assign(model, mine)
                del mine
                bar.update()
            weights_check, weights_data = errors.check(
                artifact, {n for g in groups for n in g}, bounds.values["weights"]
            )
            checks.append(weights_check)
            timings["weights"] = round(time.perf_counter() - t, 2)
            lossless = (
                weights_check.value == 0
                and not weights_data["problems"]
                and artifact.config.to_dict() == source.config.to_dict()
            )
            if weights_data["problems"]:  # missing, misshapen, extra or non-finite tensors
                stopped = "weights"
            elif lossless:
                shared["torch_artifact"] = "torch_original (the artifact's weights are the original's, bit for bit)"
                art_out = original
                bar.update(n)
            else:
                phase(f"torch on the artifact's weights ({device.type})")
                t = time.perf_counter()
                art_out = []
                try:
                    for (_, f), draws in zip(features, drawn):
                        art_out.append(_torch_outputs(reference_fold(model, f, draws=draws, **run)[0]))
                        bar.update()
                except (ValueError, KeyError, RuntimeError, AssertionError) as e:
                    checks.append(
                        Check("artifact_loads", "integrity", None, None, False, detail=f"{type(e).__name__}: {e}")
                    )
                    stopped = "torch on the artifact's weights"
                timings["torch_artifact"] = round(time.perf_counter() - t, 2)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()  # MLX's pass gets the GPU's memory

        if stopped is None:
            phase("MLX")
            try:
                mlx_out = timed("mlx", _mlx_folds, artifact.directory, panel, drawn, dtype, run, bar.update)
            except _ArtifactFailed as e:
                checks.append(Check("artifact_loads", "integrity", None, None, False, detail=str(e)))
                stopped = "MLX"
        if stopped is None:
            bad = [
                f"{label}: NaN or Inf in the fold of {where!r}"
                for label, out in (
                    ("MLX", mlx_out),
                    ("torch on the artifact's weights", art_out),
                    ("torch on the original", original),
                )
                if (where := _non_finite(out, panel))
            ]
            if bad:
                checks.append(Check("finite_outputs", "integrity", None, None, False, detail="; ".join(bad)))
                stopped = "non-finite outputs"
        if stopped is None:
            phase("metrics")
            boundaries = np.asarray(artifact.get_mx(["confidence_head.boundaries"])["confidence_head.boundaries"])
            fidelity = fold_fidelity(features, mlx_out, art_out, boundaries)
            quality = fold_quality(features, mlx_out, original)
            for name, key in FIDELITY_KEYS.items():
                checks.append(
                    Check(
                        name,
                        "fidelity",
                        fidelity[key],
                        bounds.values[name],
                        bounds.passes(name, fidelity[key]),
                        detail=f"MLX ({dtype_name}) vs torch fp32 on the artifact's weights, same draws"
                        + (_flipped(fidelity) if name in CONFIDENCES else ""),
                    )
                )
            in_place, pairs = 0, 0
            for (_, f), out in zip(features, original):
                for coords in out["coords"]:
                    a, b = ca_geometry(coords[ca_atoms(f)], f["asym_id"][0], th.CA_DISTANCE, th.CA_TOLERANCE)
                    in_place, pairs = in_place + a, pairs + b
            geometry = in_place / pairs if pairs else float("nan")
            trained = geometry >= th.TRAINED_CA_GEOMETRY
            lossless_row = precision == "float32" and dtype_name == "float32"
            enforce = {"auto": trained or lossless_row, "on": True, "off": False}[quality_gate]
            for name in th.FOLD_QUALITY_COLUMNS:
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
            quality.update(enforced=enforce, reference_trained=trained, lossless=lossless_row, ca_geometry=geometry)
        bar.close()
        passed = all(c.passed for c in checks if c.enforced)
        data = {
            "kind": "fold",
            "passed": passed,
            "checks": [c.as_dict() for c in checks],
            "stopped_before_panel": stopped,
            "artifact": artifact_record(artifact, artifact_path or mlx_dir, precision, hashing.result()),
            "reference": source.describe(),
            "precision": precision,
            "thresholds": bounds.values,
            "quality_gate": quality_gate,
            "fold": {"samples": samples, "steps": steps_run, "loops": loops_run, "seed": seed},
            "reference_mode": {
                "torch": "full",
                "torch_dtype": "float32",
                "torch_device": torch_ref.describe_device(device) if device is not None else None,
                "torch_threads": threads,
                "mlx_compute_dtype": dtype_name,
                "draws": f"recorded from transformers' fold of the original (seed {seed}), replayed into the others",
                "shared": shared,
            },
            "weights": _rounded(weights_data),
            "fidelity": _rounded(fidelity),
            "quality": _rounded(quality),
            "panel": panel.describe(),
            **run_facts(started, timings),
        }
        report = Report(passed, checks, data)
        if write:
            report.directory = write_report(report, panel, report_folder, draw=plot, own_folder=report_dir is not None)
        return report
    finally:
        wind_down(bar, stack, background, importing)


def _mlx_folds(directory: Path, panel: FoldPanel, drawn: list, dtype, run: dict, on_step: Callable) -> list[dict]:
    """The artifact as users run it (``load_fold``, ``fold``), each protein folded with the draws
    recorded for it."""
    try:
        model = load_fold(directory, dtype=dtype)
        out = []
        for protein, draws in zip(panel.proteins, drawn):
            replay = Replay(draws)
            out.append(_mlx_outputs(fold(model, list(protein.chains), draws=replay, **run)))
            if replay.used != len(draws):
                raise AssertionError(f"the MLX fold of {protein.name} drew {replay.used} of {len(draws)} numbers")
            on_step()
    except (ValueError, KeyError, RuntimeError, AssertionError, EsmcMlxError) as e:
        raise _ArtifactFailed(f"{type(e).__name__}: {e}") from None
    finally:
        mx.clear_cache()
    return out


def validate_any(mlx_dir: str | Path, reference: str, **options) -> Report:
    """What ``esmc-mlx validate`` runs: ``validate_fold_artifact`` for a fold artifact, else
    ``core.validate`` (a model), with ``options`` named as ``core.validate`` names them, plus a
    fold's ``steps``, ``loops`` and ``samples``. An option of one kind given for the other (a
    fold's on a model; ``mode`` or ``marginal_positions`` other than their defaults on a fold)
    is a ValidationError."""
    if not is_fold_directory(Path(mlx_dir)):
        given = [f"--{name}" for name in ("steps", "loops", "samples") if options.pop(name, None) is not None]
        if given:
            raise ValidationError(
                f"{', '.join(given)} apply to fold artifacts; {mlx_dir} is an ESMC model, whose panel is not folded"
            )
        return validate(mlx_dir, reference, **options)
    for name, default, flag in (("mode", "auto", "--mode"), ("marginal_positions", 24, "--quick")):
        if options.pop(name, default) != default:
            raise ValidationError(
                f"{flag} applies to ESMC models; {mlx_dir} is a fold artifact, whose panel is folded whole "
                "(--max-length crops its chains)"
            )
    return validate_fold_artifact(mlx_dir, reference, **options)


__all__ = ["validate_any", "validate_fold_artifact"]
