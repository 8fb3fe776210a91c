#!/usr/bin/env python3
"""Train esmc-tiny-sae: a small top-k sparse autoencoder on esmc-tiny's hidden states.

It is what `esmc-mlx features tiny --sae tiny ...` and `load_sae("tiny")` read offline: a demo
and test SAE for the packaged esmc-tiny, in the published ESMC SAE layout (``sae_artifact``),
written to esmc_mlx/data/esmc-tiny-sae/ with its card. Runs on a CPU in minutes (MLX, no torch):

    python scripts/train_tiny_sae.py [--out esmc_mlx/data/esmc-tiny-sae] [--seed 0]

The sequences: the records of --fasta (default: the validation panel, esmc_mlx/data/panel.fasta,
the only real proteins the package ships) and --crops random crops of them (30 to 300 residues)
in which --substitutions of the residues are replaced by residues drawn from the panel's own
composition, so that the SAE sees each residue in contexts the 14 proteins alone do not give.
With the esmc-tiny dataset at hand (scripts/tiny_data.py), ``--fasta
scripts/data/esmc-tiny-dataset.fasta --crops 0`` trains on real proteins only.

The SAE follows the semantics esmc-mlx runs (``runtime/sae.py``, the esm package's): each
token's hidden state at --layer (``<cls>`` and ``<eos>`` too) z-scored, minus ``b_dec``, times
``W_enc``, ReLU, the --k largest kept; trained to reconstruct the z-scored state through
``W_dec`` and ``b_dec`` (mean squared error, Adam, decoder rows kept at unit norm; features
that fire on no token are given new directions every --resample-every steps over the first two
thirds of training). ``idf`` is
log(tokens / (1 + tokens a feature fires on)) and ``max`` its largest activation, both over the
training tokens. Matrices are stored in float16 (config ``dtype``), the vectors in float32.
Everything is seeded; prints and writes (``training.json``) the held-out reconstruction figures,
and the card (README.md; ``--card`` writes it again from training.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from esmc_mlx import load  # noqa: E402
from esmc_mlx.outputs import apply_umask  # noqa: E402
from esmc_mlx.runtime.sae import zscore  # noqa: E402
from esmc_mlx.sae_artifact import SAEConfig, layer_file  # noqa: E402
from esmc_mlx.tasks.fasta import read_fasta  # noqa: E402
from esmc_mlx.tasks.scoring import encode  # noqa: E402

AMINO = "ACDEFGHIKLMNPQRSTVWY"


def training_sequences(fasta: Path, crops: int, substitutions: float, seed: int) -> list[str]:
    """The records of ``fasta`` and ``crops`` substituted crops of them (see the module docstring)."""
    proteins = [r.sequence for r in read_fasta(fasta)]
    rng = np.random.default_rng(seed)
    counts = np.array([sum(p.count(a) for p in proteins) for a in AMINO], dtype=np.float64)
    composition = counts / counts.sum()
    out = list(proteins)
    for _ in range(crops):
        p = proteins[rng.integers(len(proteins))]
        length = int(rng.integers(30, min(300, len(p)) + 1)) if len(p) > 30 else len(p)
        start = int(rng.integers(0, len(p) - length + 1))
        crop = np.array(list(p[start : start + length]))
        where = rng.random(length) < substitutions
        crop[where] = rng.choice(list(AMINO), int(where.sum()), p=composition)
        out.append("".join(crop))
    return out


def hidden_states(model, sequences: list[str], layer: int, batch: int = 16) -> np.ndarray:
    """Every token's hidden state at ``layer`` (padding left out), z-scored, float32 (N, d)."""
    rows = []
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch):
        chunk = [sequences[i] for i in order[start : start + batch]]
        encoded = encode(chunk)
        width = max(len(e) for e in encoded)
        ids = np.ones((len(chunk), width), dtype=np.int32)  # <pad> = 1
        mask = np.zeros((len(chunk), width), dtype=np.int32)
        for r, e in enumerate(encoded):
            ids[r, : len(e)], mask[r, : len(e)] = e, 1
        out = model(mx.array(ids), attention_mask=mx.array(mask), output_hidden_states=True)
        states = zscore(out.hidden_states[layer])
        mx.eval(states)
        states = np.array(states)
        rows += [states[r, : len(e)] for r, e in enumerate(encoded)]
    return np.concatenate(rows).astype(np.float32)


class TopKSAE(nn.Module):
    def __init__(self, d: int, c: int, k: int, seed: int):
        super().__init__()
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((c, d)).astype(np.float32)
        w /= np.linalg.norm(w, axis=1, keepdims=True)
        self.W_dec = mx.array(w)
        self.W_enc = mx.array(w.T.copy())
        self.b_dec = mx.zeros((d,))
        self.k = k

    def encode(self, x: mx.array) -> mx.array:
        pre = mx.maximum((x - self.b_dec) @ self.W_enc, 0)
        kth = mx.sort(pre, axis=-1)[:, -self.k][:, None]
        return mx.where(pre >= kth, pre, 0)

    def __call__(self, x: mx.array) -> mx.array:
        return self.encode(x) @ self.W_dec + self.b_dec


def fvu(sae: TopKSAE, x: np.ndarray) -> float:
    """Fraction of variance unexplained on ``x``."""
    xs = mx.array(x)
    err = ((sae(xs) - xs) ** 2).sum()
    var = ((xs - xs.mean(axis=0)) ** 2).sum()
    return float(err / var)


def resample_dead(sae: TopKSAE, opt, x: np.ndarray, rng: np.random.Generator) -> int:
    """Give the features that fired on none of 16,384 sampled tokens a new direction: the
    reconstruction error of a token drawn in proportion to its squared error (decoder row), and
    the same direction at the live features' mean norm (encoder column); their Adam moments
    start again. Returns how many were dead."""
    sample = x[rng.integers(0, len(x), 16384)]
    z = np.array(sae.encode(mx.array(sample)))
    dead = np.flatnonzero((z > 0).sum(axis=0) == 0)
    if not len(dead):
        return 0
    error = sample - np.array(sae(mx.array(sample)))
    weight = (error**2).sum(axis=1)
    picked = error[rng.choice(len(sample), len(dead), p=weight / weight.sum())]
    picked /= np.linalg.norm(picked, axis=1, keepdims=True)
    w_enc, w_dec = np.array(sae.W_enc), np.array(sae.W_dec)
    alive = np.setdiff1d(np.arange(w_enc.shape[1]), dead)
    norm = np.linalg.norm(w_enc[:, alive], axis=0).mean() if len(alive) else 1.0
    w_dec[dead], w_enc[:, dead] = picked, picked.T * norm
    sae.W_enc, sae.W_dec = mx.array(w_enc), mx.array(w_dec)
    for name, rows in (("W_enc", (slice(None), dead)), ("W_dec", (dead, slice(None)))):
        for moment in ("m", "v"):
            values = np.array(opt.state[name][moment])
            values[rows] = 0
            opt.state[name][moment] = mx.array(values)
    return len(dead)


def train(x: np.ndarray, args) -> tuple[TopKSAE, list[dict]]:
    sae = TopKSAE(x.shape[1], args.codebook, args.k, args.seed)
    sae.b_dec = mx.array(np.median(x, axis=0))
    opt = optim.Adam(learning_rate=args.lr)
    rng = np.random.default_rng(args.seed + 1)

    def loss_fn(model, batch):
        return ((model(batch) - batch) ** 2).sum(axis=-1).mean()

    step_fn = nn.value_and_grad(sae, loss_fn)
    log = []
    for step in range(1, args.steps + 1):
        batch = mx.array(x[rng.integers(0, len(x), args.batch)])
        loss, grads = step_fn(sae, batch)
        opt.update(sae, grads)
        sae.W_dec = sae.W_dec / mx.linalg.norm(sae.W_dec, axis=1, keepdims=True)  # unit-norm decoder rows
        mx.eval(sae.parameters(), opt.state)
        entry = {}
        if args.resample_every and step % args.resample_every == 0 and step <= args.steps * 2 // 3:
            entry["resampled"] = resample_dead(sae, opt, x, rng)
        if step % args.log_every == 0 or step == args.steps or entry:
            log.append({"step": step, "loss": float(loss), **entry})
            print(
                f"step {step}: loss {float(loss):.4f}" + (f", {entry['resampled']} dead resampled" if entry else ""),
                flush=True,
            )
    return sae, log


def statistics(sae: TopKSAE, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(idf, max) of every feature over ``x``."""
    fired = np.zeros(sae.W_enc.shape[1], dtype=np.int64)
    largest = np.zeros(sae.W_enc.shape[1], dtype=np.float32)
    for start in range(0, len(x), 8192):
        z = np.array(sae.encode(mx.array(x[start : start + 8192])))
        fired += (z > 0).sum(axis=0)
        largest = np.maximum(largest, z.max(axis=0))
    idf = np.log(len(x) / (1 + fired)).astype(np.float32)
    return idf, np.where(largest > 0, largest, 1.0).astype(np.float32)


def write_card(out: Path) -> Path:
    """README.md of the SAE folder, from its config.json and training.json."""
    config = json.loads((out / "config.json").read_text())
    record = json.loads((out / "training.json").read_text())
    settings, figures = record["settings"], record["figures"]
    layer, codebook = config["available_layers"][0], config["codebook_dim"]
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    resampled = sum(entry.get("resampled", 0) for entry in record["log"])
    paragraphs = [
        f"A top-k sparse autoencoder on layer {layer} of esmc-tiny (the small demo ESMC packaged with esmc-mlx): "
        f"{codebook} features over its {config['d_model']}-wide hidden state, the {config['k']} largest kept a "
        f"token, in the published ESMC SAE layout (`config.json`, `{layer_file(layer)}`: `W_enc`, `W_dec` in "
        f'float16, `b_dec`, `idf`, `max` in float32; {size:,} bytes). It is what `load_sae("tiny")` and '
        "`esmc-mlx features MODEL --sae tiny` read, offline: a demo and test SAE.",
        "**It is not an SAE for biology**, as esmc-tiny is not a model for it: its features describe a "
        "network of 5.2M parameters trained on 1.3M residues, and it was trained on few proteins (below).",
    ]
    items = [
        f"Data: the hidden states at layer {layer} (every token, `<cls>` and `<eos>` included, z-scored as the "
        f"encoder reads them) of {record['sequences']} sequences, {record['tokens']:,} tokens: the 14 proteins "
        "of esmc-mlx's validation panel (`esmc_mlx/data/panel.fasta`: real public protein sequences; `PANEL.md` "
        f"gives each one's origin and licence) and {settings['crops']} random crops of them (30 to 300 "
        f"residues) with {settings['substitutions']:.0%} of their residues replaced by residues drawn from the "
        f"panel's composition (seed {settings['seed']}). {record['held_out_tokens']:,} tokens were held out.",
        f"Training: mean squared error of the reconstruction through `W_dec` and `b_dec`, Adam at "
        f"{settings['lr']}, {settings['steps']} steps of {settings['batch']} tokens, decoder rows kept at unit "
        f"norm, features that fired on no token given new directions every {settings['resample_every']} steps "
        f"over the first two thirds ({resampled} in all), on a CPU in {record['seconds']:.0f} s "
        f"(MLX {record['mlx']}).",
        f"Fraction of variance unexplained: {figures['fvu_train']} on the training tokens, "
        f"**{figures['fvu_held_out']}** on the held-out ones; {figures['features_active_on_held_out']} of "
        f"{codebook} features fire on the held-out tokens, {figures['features_never_active']} never on the "
        "training ones.",
        "`idf` = log(tokens / (1 + tokens a feature fires on)) and `max` = its largest activation, over the "
        "training tokens (what `normalize=True` divides and multiplies by).",
    ]
    closing = [
        "The panel is also what `esmc-mlx quantize-sae` validates on: a quantized copy of this SAE is "
        "checked on the proteins it was trained on. That check compares two SAEs (the quantized and this "
        "one), so it measures the same thing there.",
        "Licence: Apache-2.0, like esmc-mlx. The sequences it was trained on are the panel's, under the terms "
        "`PANEL.md` lists (UniProtKB: CC BY 4.0, attribution The UniProt Consortium; Pfam: CC0; NCBI RefSeq, "
        "PIR-PSD and WormBase: no restrictions).",
        "How it was made: `python scripts/train_tiny_sae.py` in the esmc-mlx repository (`training.json` "
        "beside this card holds the settings, the loss curve and the figures).",
    ]
    front = "---\nlicense: apache-2.0\nlibrary_name: mlx\ntags:\n- esmc\n- sparse-autoencoder\n- esmc-mlx\n---"
    wrap = functools.partial(textwrap.fill, width=96, break_on_hyphens=False, break_long_words=False)
    text = "\n\n".join(
        [
            front,
            "# esmc-tiny-sae",
            *map(wrap, paragraphs),
            "\n".join(wrap(item, initial_indent="- ", subsequent_indent="  ") for item in items),
            *map(wrap, closing),
        ]
    )
    (out / "README.md").write_text(text + "\n")
    apply_umask(out)  # (safetensors writes its files 0600)
    return out / "README.md"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "esmc_mlx" / "data" / "esmc-tiny-sae"))
    ap.add_argument("--fasta", default=str(REPO / "esmc_mlx" / "data" / "panel.fasta"))
    ap.add_argument("--crops", type=int, default=600)
    ap.add_argument("--substitutions", type=float, default=0.15)
    ap.add_argument("--layer", type=int, default=4)
    ap.add_argument("--codebook", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--resample-every", type=int, default=200, help="Resample dead features this often (0: never).")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--card", action="store_true", help="Only write README.md again, from training.json.")
    args = ap.parse_args(argv)
    if args.card:
        print(f"wrote {write_card(Path(args.out))}")
        return
    mx.set_default_device(mx.cpu)
    mx.random.seed(args.seed)
    started = time.perf_counter()
    model, _ = load("tiny")
    sequences = training_sequences(Path(args.fasta), args.crops, args.substitutions, args.seed)
    x = hidden_states(model, sequences, args.layer)
    rng = np.random.default_rng(args.seed + 2)
    held = rng.random(len(x)) < 0.1
    train_x, test_x = x[~held], x[held]
    print(f"{len(sequences)} sequences, {len(x):,} tokens ({held.sum():,} held out), layer {args.layer}", flush=True)
    sae, log = train(train_x, args)
    idf, largest = statistics(sae, train_x)
    z = np.array(sae.encode(mx.array(test_x)))
    figures = {
        "fvu_train": round(fvu(sae, train_x), 4),
        "fvu_held_out": round(fvu(sae, test_x), 4),
        "features_never_active": int((idf >= math.log(len(train_x)) - 1e-6).sum()),
        "features_active_on_held_out": int((z > 0).any(axis=0).sum()),
    }
    print(json.dumps(figures), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = SAEConfig(x.shape[1], args.codebook, args.k, (args.layer,), False, "float16")
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    tensors = {
        "W_enc": np.array(sae.W_enc).astype(np.float16),
        "W_dec": np.array(sae.W_dec).astype(np.float16),
        "b_dec": np.array(sae.b_dec).astype(np.float32),
        "idf": idf,
        "max": largest,
    }
    from safetensors.numpy import save_file

    save_file(tensors, str(out / layer_file(args.layer)))
    record = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"fasta": Path(args.fasta).name},
        "sequences": len(sequences),
        "tokens": int(len(x)),
        "held_out_tokens": int(held.sum()),
        "figures": figures,
        "log": log,
        "seconds": round(time.perf_counter() - started, 1),
        "mlx": mx.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_card(out)
    print(f"wrote {out} in {record['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
