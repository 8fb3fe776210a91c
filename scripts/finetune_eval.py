#!/usr/bin/env python3
"""Fine-tuned esmc-tiny against a frozen-embedding linear probe and the majority class, on Pfam
family membership of real protein sequences that Debian packages ship.

    apt-get install emboss-test hmmer-examples any2fasta-examples
    python scripts/finetune_eval.py [--out finetune-eval] [--epochs 20] [--lora-rank 8] ...

The task: the Pfam seed-alignment members (ungapped) of every Stockholm file esmc-tiny's data
script reads (scripts/tiny_data.py: SOURCES), labeled by family (the file's ``#=GF AC``, else the
file). The splits are esmc-tiny's own (tiny_data.split, seed 0): a sequence esmc-tiny held out
(its test split) is held out here, its validation split validates (early stopping, the probe's
regularisation), the rest trains. So nothing held out was seen in pretraining or here.

Prints the held-out accuracy and macro-F1 of the three, writes OUT/train.csv, valid.csv,
test.csv, the adapter (OUT/adapter) and OUT/results.json. docs/finetune.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_data  # noqa: E402

from esmc_mlx import load, load_adapter  # noqa: E402
from esmc_mlx.finetune import finetune  # noqa: E402
from esmc_mlx.finetune.data import Labels  # noqa: E402
from esmc_mlx.finetune.model import AdaptedModel, pack, residue_mask, token_batches  # noqa: E402

SPLITS = {"train": "train", "val": "valid", "test": "test"}


def pfam_task() -> dict[str, list[tuple[str, str]]]:
    """(sequence, family) per split; a sequence in two families is left out, families that
    training never sees are dropped from the other splits."""
    records, _ = tiny_data.gather()
    unique = tiny_data.dedupe(records)
    splits, _ = tiny_data.split(unique, seed=0)
    split_of = {r.seq: splits[r.name] for r in unique}
    families: dict[str, set[str]] = {}
    for package, root, rel, fmt, _ in tiny_data.SOURCES:
        if fmt != "stockholm":
            continue
        for _, _, desc, seq in tiny_data.parse_stockholm(tiny_data._read(root / rel)):
            if len(seq) < tiny_data.MIN_LEN or not set(seq) <= tiny_data.AMINO:
                continue
            family = desc.split()[0] if not desc.startswith("seed member") else f"{package}:{rel}"
            families.setdefault(seq, set()).add(family)
    task = {name: [] for name in SPLITS.values()}
    for seq, names in sorted(families.items()):
        if len(names) == 1:
            task[SPLITS[split_of[seq]]].append((seq, names.pop()))
    seen = {f for _, f in task["train"]}
    return {k: [(s, f) for s, f in rows if f in seen] for k, rows in task.items()}


def write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("sequence,label\n" + "".join(f"{s},{f}\n" for s, f in rows))
    return path


def scores(truth: list[str], predicted: list[str]) -> dict:
    truth, predicted = np.array(truth), np.array(predicted)
    f1 = []
    for c in np.unique(truth):
        tp = np.sum((predicted == c) & (truth == c))
        precision = tp / max(1, np.sum(predicted == c))
        recall = tp / max(1, np.sum(truth == c))
        f1.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    return {"accuracy": float(np.mean(truth == predicted)), "macro_f1": float(np.mean(f1))}


def linear_probe(train_x, train_y, valid_x, valid_y, classes: int, seed: int) -> tuple[nn.Module, float]:
    """Multinomial logistic regression on standardised frozen embeddings: full-batch AdamW,
    the weight decay picked on the validation split (by accuracy, then loss)."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    norm = lambda x: mx.array((x - mean) / std)  # noqa: E731
    tx, vx, ty, vy = norm(train_x), norm(valid_x), mx.array(train_y), mx.array(valid_y)
    best = None
    for decay in (0.0, 1e-3, 1e-2, 1e-1, 1.0):
        mx.random.seed(seed)
        probe = nn.Linear(train_x.shape[1], classes)
        opt = optim.AdamW(learning_rate=1e-2, weight_decay=decay)
        step = nn.value_and_grad(probe, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"))
        for _ in range(500):
            _, grads = step(probe, tx, ty)
            opt.update(probe, grads)
            mx.eval(probe.parameters(), opt.state)
        out = probe(vx)
        key = (float(mx.mean(out.argmax(-1) == vy)), -float(nn.losses.cross_entropy(out, vy, reduction="mean")))
        if best is None or key > best[0]:
            best = (key, probe, decay)
    probe = best[1]
    return (lambda x: np.array(probe(norm(x)).argmax(-1))), best[2]


def mean_embeddings(model, sequences: list[str], batch_tokens: int) -> np.ndarray:
    """Mean final hidden state over the residues (``model.embed``'s mean) through the
    fine-tuning forward, whose batches are the fine-tuned model's."""
    frozen = AdaptedModel(model, Labels("classification", classes=["-", "+"]))
    encoded, batches = token_batches(sequences, batch_tokens)
    out = np.zeros((len(sequences), model.config.hidden_size), np.float32)
    for rows in batches:
        ids, attention, _ = pack(encoded, rows, None, frozen.labels)
        h = frozen.encode(ids, attention).astype(mx.float32)
        inside = residue_mask(attention)[..., None]
        out[rows] = np.array((h * inside).sum(1) / inside.sum(1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("finetune-eval"))
    p.add_argument("--model", default="tiny")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-layers", default="all")
    p.add_argument("--lora-scale", type=float, default=2.0)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--head", default="linear")
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    task = pfam_task()
    paths = {k: write_csv(args.out / f"{k}.csv", rows) for k, rows in task.items()}
    classes = sorted({f for _, f in task["train"]})
    print(
        f"Pfam families: {len(classes)}; sequences train {len(task['train'])}, valid {len(task['valid'])}, "
        f"held-out {len(task['test'])} (esmc-tiny's test split)"
    )
    truth = [f for _, f in task["test"]]
    results = {
        "data": {k: len(v) for k, v in task.items()},
        "classes": len(classes),
        "settings": dict(vars(args), out=str(args.out)),
    }

    majority = Counter(f for _, f in task["train"]).most_common(1)[0][0]
    results["majority"] = scores(truth, [majority] * len(truth))

    started = time.perf_counter()
    model, _ = load(args.model, fuse=False)
    index = {c: i for i, c in enumerate(classes)}
    embed = {k: mean_embeddings(model, [s for s, _ in rows], args.batch_tokens) for k, rows in task.items()}
    labels = {k: np.array([index[f] for _, f in rows]) for k, rows in task.items()}
    predict, decay = linear_probe(
        embed["train"], labels["train"], embed["valid"], labels["valid"], len(classes), args.seed
    )
    results["probe"] = scores(truth, [classes[i] for i in predict(embed["test"])])
    results["probe"]["weight_decay"] = decay
    results["probe"]["seconds"] = round(time.perf_counter() - started, 1)
    print(f"frozen-embedding probe (weight decay {decay}): held-out accuracy {results['probe']['accuracy']:.3f}")

    started = time.perf_counter()
    summary = finetune(
        args.model,
        paths["train"],
        args.out / "adapter",
        valid=paths["valid"],
        epochs=args.epochs,
        lora_rank=args.lora_rank,
        lora_layers=args.lora_layers if args.lora_layers == "all" else int(args.lora_layers),
        lora_scale=args.lora_scale,
        learning_rate=args.learning_rate,
        head=args.head,
        patience=args.patience,
        batch_tokens=args.batch_tokens,
        seed=args.seed,
        force=True,
        progress=True,
    )
    adapted = load_adapter(args.out / "adapter")
    results["finetuned"] = scores(truth, adapted.predict([s for s, _ in task["test"]]).values)
    results["finetuned"].update(
        best_epoch=summary.best_epoch, epochs_run=len(summary.history), seconds=round(time.perf_counter() - started, 1)
    )

    print(f"\nHeld-out ({len(truth)} sequences, {len(set(truth))} families):")
    print(f"  {'':28s} accuracy  macro-F1")
    for name, key in (
        ("majority class", "majority"),
        ("frozen embeddings + linear", "probe"),
        ("fine-tuned (LoRA)", "finetuned"),
    ):
        print(f"  {name:28s} {results[key]['accuracy']:8.3f}  {results[key]['macro_f1']:8.3f}")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
