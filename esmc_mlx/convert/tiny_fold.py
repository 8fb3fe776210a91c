"""``esmc-convert tiny-fold``: a small ESMFold2 checkpoint to try ``esmc-mlx fold`` offline. Its
backbone is the packaged esmc-tiny; its folding model is RANDOM (drawn here, no training), so
the structures it predicts are meaningless: it folds nothing real. Built with numpy and
safetensors (no torch), in transformers' layout, and converted as any ESMFold2 checkpoint."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from ..fold_artifact import BACKBONE, BUFFERS, expected_fold_shapes
from ..fold_config import FoldConfig
from ..resolve import LOCAL_ALIASES

NAME = "tiny-fold"
CHECKPOINT = "esmc-tiny-fold"  # the folder's name: what provenance records of the source
DEFAULT_OUTPUT = Path("esmc-tiny-fold-mlx")
NOTICE = (
    "esmc-tiny-fold is random: its folding weights were drawn, not trained, on the esmc-tiny backbone; "
    "its structures are meaningless (it exists to try esmc-mlx fold offline)"
)
_ATOM = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    num_spatial_rope_pairs_per_axis=1,
    num_uid_rope_pairs=4,
)


def tiny_fold_config(esmc_config: dict) -> dict:
    """A small ESMFold2 (every part of the published architecture, one or two blocks each) over
    the ESMC of ``esmc_config``, in transformers' spelling."""
    return dict(
        model_type="esmfold2",
        architectures=["EsmFold2Model"],
        hidden_size=32,
        pairwise_hidden_size=32,
        pair_transition_intermediate_size=64,
        single_inputs_size=32 + 2 * 33 + 1,
        sliding_window=32,
        chunk_size=64,
        folding_trunk_num_hidden_layers=2,
        parcae_num_coda_layers=1,
        num_loops=2,
        atom_encoder=dict(_ATOM, output_dim=32),
        structure_head=dict(
            num_diffusion_samples=1,
            inference_num_steps=10,
            diffusion_module=dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                pair_intermediate_size=64,
                fourier_dim=16,
                atom_encoder=dict(_ATOM, output_dim=64),
            ),
        ),
        confidence_head=dict(num_hidden_layers=1),
        msa_encoder=dict(enabled=False),
        lm_encoder=dict(num_hidden_layers=1),
        esmc_config=esmc_config,
        dtype="float32",
    )


def random_tensor(name: str, shape: tuple[int, ...], config: FoldConfig, rng: np.random.Generator) -> np.ndarray:
    """One folding tensor: norm weights 1, biases 0, other weights N(0, 1/fan_in); the buffers as
    transformers makes them (distance boundaries evenly spaced, Fourier frequencies and phases N(0, 1))."""
    if name == "confidence_head.boundaries":
        head = config.confidence_head
        return np.linspace(head.min_dist, head.max_dist, head.distogram_bins - 1, dtype=np.float32)
    if name in BUFFERS:
        return rng.standard_normal(shape, dtype=np.float32)
    if "norm" in name and name.endswith("weight"):
        return np.ones(shape, np.float32)
    if name.endswith("bias"):
        return np.zeros(shape, np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5).astype(np.float32)


def write_tiny_fold_checkpoint(directory: Path, seed: int = 0) -> Path:
    """The tiny-fold checkpoint in ``directory`` (config.json, model.safetensors, tokenizer files):
    esmc-tiny's backbone tensors as they ship, the folding model's drawn with ``seed``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    esmc = LOCAL_ALIASES["tiny"]
    raw = tiny_fold_config(json.loads((esmc / "config.json").read_text()))
    config = FoldConfig.from_dict(raw)
    backbone = {k: v for k, v in load_file(esmc / "model.safetensors").items() if k.startswith(BACKBONE)}
    rng = np.random.default_rng(seed)
    tensors = {
        name: backbone[name] if name.startswith(BACKBONE) else random_tensor(name, shape, config, rng)
        for name, shape in expected_fold_shapes(config).items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(esmc / name, directory / name)
    return directory


@contextlib.contextmanager
def tiny_fold_checkpoint(seed: int = 0) -> Iterator[Path]:
    """The tiny-fold checkpoint in a temporary folder, removed on the way out."""
    with tempfile.TemporaryDirectory(prefix="esmc-mlx-") as tmp:
        yield write_tiny_fold_checkpoint(Path(tmp) / CHECKPOINT, seed)
