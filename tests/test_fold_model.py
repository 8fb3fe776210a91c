"""The MLX fold computes what transformers' ESMFold2 computes: the same weights (converted from a
random-weight checkpoint) and the same random draws give the same trunk, coordinates and
confidences, for one chain and for a complex."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[torch]' in the clone")

from esmc_mlx import load_fold
from esmc_mlx.convert import convert
from esmc_mlx.runtime.fold.draws import Replay
from esmc_mlx.tasks.fold import fold, protein_features
from esmc_mlx.testing import random_transformers_fold_model, tiny_fold_config, write_fold_checkpoint
from esmc_mlx.validate.fold_reference import reference_fold

SAMPLES, STEPS, LOOPS = 2, 6, 2


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module", params=[False, True], ids=["fast", "msa"])
def folded(request, tmp_path_factory):
    """(the transformers model, the MLX fold of the same weights): the single-sequence model
    (ESMFold2-Fast's shape) and the MSA-capable one, which runs its MSA encoder on the query."""
    config = tiny_fold_config(msa_encoder=dict(enabled=request.param, num_hidden_layers=2, hidden_size=16,
                                               outer_hidden_size=4, num_attention_heads=2, head_dim=8,
                                               intermediate_size=32))  # fmt: skip
    root = tmp_path_factory.mktemp("fold")
    checkpoint = write_fold_checkpoint(root / "checkpoint", config, seed=3)
    artifact = convert(str(checkpoint), root / "mlx", progress=False)
    return random_transformers_fold_model(config, seed=3), load_fold(artifact)


@pytest.mark.parametrize("chains", [["MKTAYIAKQRQISFVKSHFSRQ"], ["MKTAYIAKQR", "GSHMSLFDKLGG", "MKTAYIAKQR"]])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fold_matches_transformers_under_the_same_draws(folded, chains, compile):
    reference, model = folded
    features = protein_features(chains)
    expected, drawn = reference_fold(reference, features, SAMPLES, STEPS, LOOPS, seed=1)
    replay = Replay(drawn)
    out = fold(model, chains, samples=SAMPLES, steps=STEPS, loops=LOOPS, draws=replay, compile=compile)
    assert replay.used == len(drawn), "the MLX fold drew fewer numbers than the reference"
    assert rel(out.distogram_logits, expected["distogram_logits"][0]) <= 1e-4
    real = features["atom_attention_mask"][0].astype(bool)
    assert np.abs(out.coords[:, real] - expected["sample_atom_coords"][:, real]).max() <= 1e-3  # angstrom
    for name in ("plddt", "plddt_per_atom", "pae", "pde", "ptm", "iptm"):
        assert np.abs(getattr(out, name) - expected[name]).max() <= 1e-4, name


def test_a_seed_folds_the_same_structure_and_files_carry_it(folded):
    _, model = folded
    a = fold(model, "MKTAYIAKQRQISF", samples=2, steps=4, loops=1, seed=5)
    stages = {}  # profiled stage by stage: the same fold
    b = fold(model, "MKTAYIAKQRQISF", samples=2, steps=4, loops=1, seed=5, stages=stages)
    c = fold(model, "MKTAYIAKQRQISF", samples=2, steps=4, loops=1, seed=6)
    np.testing.assert_array_equal(a.coords, b.coords)
    np.testing.assert_array_equal(a.pae, b.pae)
    assert list(stages) == ["features", "trunk", "conditioning", "sampler", "confidence"]
    assert sum(s["seconds"] for s in stages.values()) <= b.seconds and stages["trunk"]["peak_bytes"] > 0
    assert np.abs(a.coords - c.coords).max() > 1e-3
    pdb = a.to_pdb()
    atoms = [line for line in pdb.splitlines() if line.startswith("ATOM")]
    assert len(atoms) == int(a.features["atom_attention_mask"].sum())
    first = a.coords[a.best][0]
    assert [float(atoms[0][30:38]), float(atoms[0][38:46]), float(atoms[0][46:54])] == pytest.approx(first, abs=1e-3)
    assert float(atoms[0][60:66]) == pytest.approx(100 * a.plddt_per_atom[a.best][0], abs=0.01)
    assert "_atom_site" in a.to_mmcif()
