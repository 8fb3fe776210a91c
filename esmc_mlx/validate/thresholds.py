"""Every tolerance of validation, in one place. docs/validation.md explains each number.

Two tables:

* ``FIDELITY``: the MLX runtime against torch run on the *same* weights (the artifact's,
  dequantized). Keyed by the dtype MLX computes in, since that, not the storage, sets the
  rounding noise: fp32 compute must agree to 1e-5 whatever the artifact stores (quantized
  included: MLX's quantized matmul and torch's matmul of the dequantized weights are the same
  sums); bf16/fp16 compute (Metal, CUDA) to 2e-2.
* ``QUALITY``: the artifact against the original checkpoint, one row per precision. The
  ``weights`` column bounds the relative L2 error of every tensor (dequantized artifact against
  the original); the others bound the outputs on the panel.

Quality rows were set from measurements on the trained esmc-tiny (``python -m
esmc_mlx.validate.calibrate``; docs/validation.md has the measured values and the rule), with
headroom because the published models are 5-13x deeper. The bf16/fp16 rows also cover MLX
*computing* in that dtype (measured with an fp32 artifact run in bf16/fp16). Override any bound
with ``--threshold NAME=VALUE``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from ..errors import ValidationError

# Checks whose value must stay *at or above* the threshold; every other check is "at most".
HIGHER_IS_BETTER = frozenset({"top1", "embedding_cosine", "spearman", "topk_agreement", "lddt_ca"})

FIDELITY: dict[str, float] = {  # compute dtype -> max relative L2 of logits and of last hidden state
    "float32": 1e-5,
    "bfloat16": 2e-2,
    "float16": 2e-2,
}

QUALITY_COLUMNS = (
    "weights",
    "kl_mean",
    "kl_max",
    "top1",
    "logits_rel_err",
    "hidden_rel_err",
    "embedding_cosine",
    "spearman",
)
# Measured on esmc-tiny (6 layers), full panel: docs/validation.md has the figures. Error-like
# bounds are 10x the measurement, agreement-like ones 1 - 10x the shortfall, rounded up on a
# 1-1.5-2-3-5-7 grid; ``weights`` is 2x (it does not grow with depth); quantized rows are made
# no tighter than the rows of more bits. "float32" is any lossless artifact.
#              weights  kl_mean kl_max  top1    logits  hidden  cosine     spearman
# fmt: off
_ROWS = {
    "float32":  (1e-6,   1e-6,   1e-4,   0.999,  1e-4,   1e-4,   0.99999,   0.9999),
    "float16":  (5e-4,   5e-6,   3e-4,   0.999,  5e-3,   1.5e-2, 0.9999985, 0.99993),
    "bfloat16": (5e-3,   3e-4,   1e-2,   0.985,  3e-2,   0.1,    0.99985,   0.999),
    "8bit":     (1.5e-2, 3e-5,   2e-3,   0.995,  1e-2,   3e-2,   0.99995,   0.9998),
    "6bit":     (5e-2,   3e-4,   3e-2,   0.985,  3e-2,   0.1,    0.9995,    0.9993),
    "mxfp8":    (7e-2,   5e-4,   5e-2,   0.98,   5e-2,   0.15,   0.999,     0.9985),
    "5bit":     (0.1,    1e-3,   0.15,   0.95,   5e-2,   0.3,    0.998,     0.997),
    "4bit":     (0.3,    5e-3,   0.5,    0.93,   0.1,    0.5,    0.985,     0.99),
    "nvfp4":    (0.3,    7e-3,   0.5,    0.9,    0.15,   0.7,    0.985,     0.99),
    "mxfp4":    (0.3,    1e-2,   0.5,    0.9,    0.15,   0.7,    0.98,      0.99),
    "3bit":     (0.5,    2e-2,   1.5,    0.85,   0.3,    1.0,    0.95,      0.93),
    "2bit":     (1.0,    0.1,    7.0,    0.7,    0.5,    1.0,    0.8,       0.7),
}
# fmt: on
QUALITY: dict[str, dict[str, float]] = {p: dict(zip(QUALITY_COLUMNS, row)) for p, row in _ROWS.items()}

# A reference counts as trained when its top-1 prediction recovers at least this fraction of the
# (unmasked) input residues; a random-weight network recovers about 1/33. Quality checks are
# enforced only against a trained reference unless the caller says otherwise (quality_gate).
TRAINED_IDENTITY_ACCURACY = 0.5
CHECK_NAMES = (*QUALITY_COLUMNS, "fidelity_logits", "fidelity_hidden")


def check_overrides(overrides: dict[str, float] | None, names: tuple[str, ...] = CHECK_NAMES) -> None:
    """ValidationError, before any work, for an override that names no check of ``names`` (a
    model's ``CHECK_NAMES``, a fold's ``FOLD_CHECK_NAMES``) or is not a number (NaN included: no
    value passes it); ``resolve`` and ``resolve_fold`` apply them."""
    for name, bound in (overrides or {}).items():
        if name not in names:
            raise ValidationError(f"unknown threshold {name!r}; known: {', '.join(sorted(names))}")
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or math.isnan(bound):
            raise ValidationError(
                f"threshold {name}={bound!r}: give a number, e.g. {name}={QUALITY['4bit'].get(name, 1e-5)}"
            )


@dataclasses.dataclass(frozen=True)
class Thresholds:
    precision: str
    compute_dtype: str
    values: dict[str, float]

    def passes(self, name: str, value: float | None) -> bool:
        if value is None or value != value:  # None or NaN never passes
            return False
        bound = self.values[name]
        return value >= bound if name in HIGHER_IS_BETTER else value <= bound


def precision_class(artifact_config: dict, source_dtype: str) -> str:
    """Row of ``QUALITY`` for an artifact: its quantization (mixed recipes use the row of their
    lower bit width, a bound they always meet), else its float dtype, where a dtype no narrower
    than the source's (bf16 from a bf16 checkpoint, fp32 from anything) is lossless: "float32"."""
    q = artifact_config.get("quantization") or artifact_config.get("quantization_config")
    if q:
        mode, bits = q.get("mode", "affine"), int(q["bits"])
        if mode in ("mxfp4", "nvfp4", "mxfp8"):
            return mode
        return f"{bits}bit"
    dtype = artifact_config.get("dtype", "float32")
    if dtype == "float32" or dtype == source_dtype:
        return "float32"
    return dtype


def looser(name: str, a: float, b: float) -> float:
    return min(a, b) if name in HIGHER_IS_BETTER else max(a, b)


def resolve(precision: str, compute_dtype: str, overrides: dict[str, float] | None = None) -> Thresholds:
    """The thresholds for one validation run; ``overrides`` (check name -> bound) win.

    Output bounds are the looser of the precision's row and the compute dtype's row (an
    artifact that MLX runs in bf16, on a GPU, carries bf16 rounding whatever it stores); the
    ``weights`` bound is the precision's alone. Raises KeyError naming an unknown check or a
    precision without bounds (a record of 1 or 7 bits, which esmc-mlx never writes)."""
    if precision not in QUALITY:  # a bare KeyError('7bit') reached the user as "Error: 7bit"
        raise KeyError(f"no validation bounds for a {precision} artifact; bounds exist for {', '.join(QUALITY)}")
    values = dict(QUALITY[precision])
    if compute_dtype in QUALITY and compute_dtype != "float32":
        for name, bound in QUALITY[compute_dtype].items():
            if name != "weights":
                values[name] = looser(name, values[name], bound)
    fid = FIDELITY.get(compute_dtype, FIDELITY["bfloat16"])
    values.update({"fidelity_logits": fid, "fidelity_hidden": fid})
    for name, bound in (overrides or {}).items():
        if name not in values:
            raise KeyError(f"unknown threshold {name!r}; known: {', '.join(sorted(values))}")
        values[name] = float(bound)
    return Thresholds(precision, compute_dtype, values)


# ESMFold2 fold artifacts (validate/fold.py): MLX's fold against transformers' EsmFold2Model under
# the same random draws. Fidelity, by the dtype MLX computes in: the distogram logits' relative L2
# error, the largest deviation of a C-alpha and of any atom (angstrom), the largest error of pLDDT
# (0-1 scale), PAE (angstrom) and pTM. float32: above what transformers' own fp32 fold moves
# between two devices at the published sizes (CUDA against CPU, same weights and draws; the
# sampler and 10 recycling loops amplify rounding) and what MLX measured there, below what TF32
# moves (docs/validation.md has the figures; the tiny models of the tests agree to 1e-6 and are
# held to 1e-4 there); bfloat16/float16 compute: docs/validation.md has the judgment behind them.
FOLD_FIDELITY_COLUMNS = (
    "fidelity_distogram",
    "fidelity_ca",
    "fidelity_atoms",
    "fidelity_plddt",
    "fidelity_pae",
    "fidelity_ptm",
)
#              distogram  ca    atoms   plddt   pae    ptm
# fmt: off
_FOLD_FIDELITY_ROWS = {
    "float32":  (2e-3,     5e-2,  1e-1,   5e-4,   1e-1,  1e-4),
    "bfloat16": (3e-2,     1.5,   2.0,    3e-2,   1.0,   2e-2),
    "float16":  (3e-2,     1.5,   2.0,    3e-2,   1.0,   2e-2),
}
# fmt: on
FOLD_FIDELITY: dict[str, dict[str, float]] = {
    d: dict(zip(FOLD_FIDELITY_COLUMNS, row)) for d, row in _FOLD_FIDELITY_ROWS.items()
}
# Quality, per precision, over the panel's proteins (each protein must meet each bound): C-alpha
# RMSD after superposition (angstrom), lDDT-C-alpha, pLDDT mean absolute error (0-1 scale), PAE
# mean absolute error (angstrom), pTM absolute error; ``weights`` comes from QUALITY's column.
# float32 (lossless) is the float32 fidelity row in quality's terms: the same function on the
# same weights, so what separates the two is float32 rounding, as in fidelity. float16
# and bfloat16 follow FastPLMs' practice of holding a structure model in bf16 to structure limits
# (aligned coordinates, pLDDT, pTM), not to loosened ones. The quantized rows are set by judgment,
# not measured (no trained ESMFold2 here): docs/validation.md says how; provisional until
# measured on the published weights.
FOLD_QUALITY_COLUMNS = ("ca_rmsd", "lddt_ca", "plddt_mae", "pae_mae", "ptm_error")
#              ca_rmsd  lddt_ca  plddt_mae  pae_mae  ptm_error
# fmt: off
_FOLD_ROWS = {
    "float32":  (1e-2,    0.999,   1e-4,      1e-3,    1e-4),
    "float16":  (0.1,     0.995,   1e-3,      0.1,     2e-3),
    "bfloat16": (0.1,     0.995,   1e-3,      0.1,     2e-3),
    "8bit":     (0.25,    0.99,    5e-3,      0.25,    5e-3),
    "mxfp8":    (0.25,    0.99,    5e-3,      0.25,    5e-3),
    "6bit":     (0.5,     0.98,    1e-2,      0.5,     1e-2),
    "5bit":     (0.7,     0.97,    1.5e-2,    0.7,     1.5e-2),
    "4bit":     (1.0,     0.95,    2e-2,      1.0,     2e-2),
    "nvfp4":    (1.0,     0.95,    2e-2,      1.0,     2e-2),
    "mxfp4":    (1.0,     0.95,    2e-2,      1.0,     2e-2),
    "3bit":     (2.0,     0.9,     5e-2,      2.0,     5e-2),
    "2bit":     (5.0,     0.7,     0.1,       5.0,     0.1),
}
# fmt: on
FOLD_QUALITY: dict[str, dict[str, float]] = {p: dict(zip(FOLD_QUALITY_COLUMNS, row)) for p, row in _FOLD_ROWS.items()}
FOLD_CHECK_NAMES = ("weights", *FOLD_QUALITY_COLUMNS, *FOLD_FIDELITY_COLUMNS)
# An ESMFold2 checkpoint counts as trained when its structures look like proteins: at least this
# share of consecutive C-alpha pairs of a chain lie CA_DISTANCE +- CA_TOLERANCE angstrom apart (a
# trans peptide bond puts them 3.80 apart; a random-weight network scatters them). Quality checks
# of a lossy artifact are enforced only against a trained checkpoint unless the caller says so.
CA_DISTANCE, CA_TOLERANCE = 3.8, 0.3
TRAINED_CA_GEOMETRY = 0.9


def resolve_fold(precision: str, compute_dtype: str, overrides: dict[str, float] | None = None) -> Thresholds:
    """The thresholds of a fold validation, as ``resolve`` makes a model's: the precision's row
    of ``FOLD_QUALITY`` (and QUALITY's ``weights``), loosened to the compute dtype's row when MLX
    computes in bf16 or fp16, the fidelity row of the compute dtype, ``overrides`` winning.
    Raises KeyError naming a precision without bounds or an unknown check."""
    if precision not in FOLD_QUALITY or precision not in QUALITY:
        raise KeyError(f"no validation bounds for a {precision} artifact; bounds exist for {', '.join(FOLD_QUALITY)}")
    values = {"weights": QUALITY[precision]["weights"], **FOLD_QUALITY[precision]}
    if compute_dtype in FOLD_QUALITY and compute_dtype != "float32":
        for name, bound in FOLD_QUALITY[compute_dtype].items():
            values[name] = looser(name, values[name], bound)
    values.update(FOLD_FIDELITY.get(compute_dtype, FOLD_FIDELITY["bfloat16"]))
    for name, bound in (overrides or {}).items():
        if name not in values:
            raise KeyError(f"unknown threshold {name!r}; known: {', '.join(sorted(values))}")
        values[name] = float(bound)
    return Thresholds(precision, compute_dtype, values)


# Sparse autoencoders (validate/sae.py): a bf16 / fp16 / 8-bit SAE against the float32 SAE it was
# made from, on the same hidden states. topk_agreement: mean share of active features both find;
# value_rel_err: relative L2 error of the dense features (dominated by features that swap places
# at the k-th rank). Set from esmc-tiny with random SAEs (python -m benchmarks.sae_bounds;
# docs/validation.md has the values): 3x the worst error and 1 - 3x the largest shortfall of
# agreement, rounded up on the 1-1.5-2-3-5-7 grid. 3x, not the models' 10x: both SAEs read the
# same hidden states, so the error does not grow with the backbone's depth.
SAE_COLUMNS = ("topk_agreement", "value_rel_err")
# fmt: off
_SAE_ROWS = {
    "float32":  (0.9999, 1e-6),
    "float16":  (0.9985, 7e-2),
    "bfloat16": (0.99,   0.2),
    "8bit":     (0.97,   0.3),
}
# fmt: on
SAE_QUALITY: dict[str, dict[str, float]] = {p: dict(zip(SAE_COLUMNS, row)) for p, row in _SAE_ROWS.items()}


def resolve_sae(precision: str, overrides: dict[str, float] | None = None) -> dict[str, float]:
    """The SAE bounds of ``precision``, ``overrides`` (check name -> bound) winning. ValidationError
    for a precision without bounds or an override that names no SAE check."""
    if precision not in SAE_QUALITY:
        raise ValidationError(f"no SAE validation bounds for {precision}; bounds exist for {', '.join(SAE_QUALITY)}")
    values = dict(SAE_QUALITY[precision])
    for name, bound in (overrides or {}).items():
        if name not in values:
            raise ValidationError(f"unknown SAE threshold {name!r}; known: {', '.join(SAE_COLUMNS)}")
        values[name] = float(bound)
    return values
