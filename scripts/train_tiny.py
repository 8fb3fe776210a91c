#!/usr/bin/env python3
"""Train esmc-tiny on the prepared dataset and write the checkpoint.

esmc-tiny is a 6-layer, 256-wide ESMC (transformers' ``EsmcForMaskedLM``) trained with masked
language modelling on the real protein sequences that three Debian packages ship as files.
Two steps (docs/esmc-tiny.md has the figures of the shipped run):

    # 1. on a machine with the packages (apt-get install emboss-test hmmer-examples
    #    any2fasta-examples): gather, deduplicate, split; write the prepared FASTA, the provenance
    #    manifest and the validation panel (esmc_mlx/data/panel.fasta + PANEL.md)
    python scripts/tiny_data.py                    # or: python scripts/train_tiny.py prepare

    # 2. train on scripts/data/esmc-tiny-dataset.fasta (no apt packages needed here, only torch,
    #    transformers >= 5.17, safetensors, numpy); writes config.json, model.safetensors,
    #    tokenizer files, README.md and metrics.json into --out
    python scripts/train_tiny.py train --device cuda --out OUT

Everything is seeded (--seed, default 0): the split, the crops, the masks, the initialisation.
CUDA kernels are not all bitwise deterministic, so a rerun on a GPU reproduces the figures to
about the third decimal, not bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tiny_data  # scripts/tiny_data.py: on sys.path as this script's own folder
import torch
import torch.nn.functional as F
import transformers
from tiny_data import AMINO, DATASET, MAX_CROP, STANDARD, load_dataset
from transformers import EsmcConfig, EsmcForMaskedLM, EsmcTokenizer


@dataclass(frozen=True)
class Tokens:
    """The token ids that encoding, batching and masking need, from EsmcTokenizer's vocabulary."""

    cls_id: int
    pad_id: int
    eos_id: int
    mask_id: int
    standard: torch.Tensor  # the 20 standard residues: what a random replacement draws from
    residues: list  # the 25 residue letters: what the unigram baseline spreads over
    lut: np.ndarray  # byte -> token id

    @classmethod
    def from_vocab(cls, vocab: dict) -> Tokens:
        lut = np.full(256, vocab["<unk>"], dtype=np.int64)
        for c in AMINO:
            lut[ord(c)] = vocab[c]
        return cls(
            *(vocab[t] for t in ("<cls>", "<pad>", "<eos>", "<mask>")),
            standard=torch.tensor([vocab[c] for c in STANDARD]),
            residues=sorted({vocab[c] for c in AMINO}),
            lut=lut,
        )

    def encode(self, seq: str) -> np.ndarray:
        return self.lut[np.frombuffer(seq.encode(), dtype=np.uint8)]


# --- batches and masks -------------------------------------------------------------------------
def batch_tensor(chunks, tok: Tokens) -> torch.Tensor:
    """<cls> chunk <eos>, padded to the longest, rounded up to 32 (few distinct shapes: kernels tune once)."""
    L = -(-(max(len(c) for c in chunks) + 2) // 32) * 32
    ids = torch.full((len(chunks), L), tok.pad_id, dtype=torch.long)
    for i, c in enumerate(chunks):
        ids[i, 0] = tok.cls_id
        ids[i, 1 : len(c) + 1] = torch.from_numpy(c)
        ids[i, len(c) + 1] = tok.eos_id
    return ids


def residue_positions(ids: torch.Tensor, tok: Tokens) -> torch.Tensor:
    return (ids != tok.pad_id) & (ids != tok.cls_id) & (ids != tok.eos_id)


def mlm_mask(ids: torch.Tensor, tok: Tokens, gen: torch.Generator):
    """Standard BERT masking: 15% of residue positions; 80% <mask>, 10% random residue, 10% kept.
    Returns (inputs, labels) with labels -100 where nothing is predicted."""
    picked = (torch.rand(ids.shape, generator=gen) < 0.15) & residue_positions(ids, tok)
    labels = torch.where(picked, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[picked & (roll < 0.8)] = tok.mask_id
    rand = picked & (roll >= 0.8) & (roll < 0.9)
    inputs[rand] = tok.standard[torch.randint(len(tok.standard), ids.shape, generator=gen)][rand]
    return inputs, labels


def epoch_batches(train_seqs, rng: np.random.Generator, crop: int, batch_tokens: int):
    """One epoch of random crops (<= crop residues), length-bucketed into token-budget batches:
    pools of 4,096 crops sorted by length, cut when a batch would pass batch_tokens, shuffled."""
    crops = []
    for i in rng.permutation(len(train_seqs)):
        s = train_seqs[i]
        if len(s) > crop:
            o = rng.integers(0, len(s) - crop + 1)
            s = s[o : o + crop]
        crops.append(s)
    batches = []
    pool = 4096
    for p in range(0, len(crops), pool):
        cur = []
        for c in sorted(crops[p : p + pool], key=len):
            if cur and (len(cur) + 1) * (max(len(cur[-1]), len(c)) + 2) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(c)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def eval_chunks(seqs, crop: int):
    """Every sequence cut into consecutive windows of at most crop residues, sorted by length."""
    return sorted((s[o : o + crop] for s in seqs for o in range(0, len(s), crop)), key=len)


def unigram_logp(train_seqs, tok: Tokens) -> torch.Tensor:
    """Log-frequencies of the training split's residues, add-one smoothed over the 25 residue tokens."""
    counts = torch.zeros(64, dtype=torch.float64)
    for s in train_seqs:
        counts += torch.bincount(torch.from_numpy(s), minlength=64).double()
    unigram = torch.zeros(64, dtype=torch.float64)
    unigram[tok.residues] = counts[tok.residues] + 1.0
    return (unigram / unigram.sum()).clamp_min(1e-30).log()


# --- model, optimizer, one step ----------------------------------------------------------------
def build_model(args, device: torch.device) -> EsmcForMaskedLM:
    config = EsmcConfig(
        vocab_size=64,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return EsmcForMaskedLM(config).to(device)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; float32 elsewhere."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def make_optimizer(model, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on embeddings, norms, biases)."""

    def decays(n, p):
        return p.dim() >= 2 and "embed" not in n

    decay = [p for n, p in model.named_parameters() if decays(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not decays(n, p)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
        **({"fused": True} if device.type == "cuda" else {}),
    )


def lr_at(step: int, peak: float, warmup: int, steps: int) -> float:
    """Linear warm-up to peak over `warmup` steps, then cosine decay to peak / 10 at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_step(model, opt, chunks, lr: float, gen: torch.Generator, tok: Tokens, device: torch.device):
    """One masked-LM step on one batch; returns (loss, gradient norm before clipping, tokens)."""
    ids = batch_tensor(chunks, tok)
    inputs, labels = mlm_mask(ids, tok, gen)
    attn = (ids != tok.pad_id).long()
    n_tokens = int(attn.sum())  # counted on the host: no device sync
    inputs, labels, attn = inputs.to(device), labels.to(device), attn.to(device)
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(device):
        logits = model(input_ids=inputs, attention_mask=attn).logits
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, gnorm, n_tokens


# --- evaluation --------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    model, chunks, passes: int, tok: Tokens, unigram: torch.Tensor, device: torch.device, max_tokens: int = 32768
) -> dict:
    """Masked-LM cross-entropy: residues are split into `passes` disjoint, seeded folds; each
    fold is replaced by <mask> in one forward pass, so every residue is scored exactly once
    when passes = 7 (~14% masked per pass). `unigram` is unigram_logp()'s baseline."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    nll = nll_uni = correct = count = 0.0
    i = 0
    while i < len(chunks):
        j = i
        while j < len(chunks) and (j - i + 1) * (len(chunks[j]) + 2) <= max_tokens:
            j += 1
        j = max(j, i + 1)
        ids = batch_tensor(chunks[i:j], tok)
        residue = residue_positions(ids, tok)
        fold = torch.randint(7, ids.shape, generator=gen)
        attn = (ids != tok.pad_id).long().to(device)
        for p in range(passes):
            picked = residue & (fold == p)
            if not picked.any():
                continue
            inputs = torch.where(picked, torch.full_like(ids, tok.mask_id), ids).to(device)
            with autocast(device):
                logits = model(input_ids=inputs, attention_mask=attn).logits
            logp = F.log_softmax(logits.float(), dim=-1)
            pk = picked.to(device)
            tgt = ids.to(device)[pk]
            lp = logp[pk]
            nll += -lp.gather(1, tgt[:, None]).sum().item()
            correct += (lp.argmax(-1) == tgt).sum().item()
            nll_uni += -unigram[tgt.cpu()].sum().item()
            count += tgt.numel()
        i = j
    model.train()
    return {
        "masked_residues": int(count),
        "cross_entropy": nll / count,
        "perplexity": math.exp(nll / count),
        "accuracy": correct / count,
        "unigram_cross_entropy": nll_uni / count,
        "unigram_perplexity": math.exp(nll_uni / count),
    }


# --- the training loop -------------------------------------------------------------------------
@dataclass
class TrainState:
    """Where the run is, its validation history and the best checkpoint so far (on the host)."""

    t_train: float = field(default_factory=time.time)
    step: int = 0
    epoch: int = 0
    train_tokens: int = 0
    stopped_by: str = "steps"
    train_seconds: float = 0.0
    history: list = field(default_factory=list)
    best: dict | None = None
    best_state: dict | None = None

    def record(self, entry: dict, model) -> None:
        """Append a validation entry; keep a copy of the weights when it is the best so far."""
        self.history.append(entry)
        if self.best is None or entry["val"]["cross_entropy"] < self.best["val"]["cross_entropy"]:
            self.best = entry
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def run_training(
    model, opt, train_seqs, val_chunks, tok: Tokens, unigram: torch.Tensor, device: torch.device, args
) -> TrainState:
    """args.steps steps (or args.max_train_seconds); validation every args.eval_every steps and at the
    end; leaves the best validation checkpoint loaded in `model`, in float32."""

    def validate():
        return evaluate(model, val_chunks, 2, tok, unigram, device)

    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    st = TrainState()
    model.train()
    while st.step < args.steps:
        st.epoch += 1
        for chunks in epoch_batches(train_seqs, rng, args.crop, args.batch_tokens):
            if st.step >= args.steps:
                break
            if time.time() - st.t_train > args.max_train_seconds:
                st.stopped_by = "time"
                break
            lr = lr_at(st.step, args.lr, args.warmup, args.steps)
            loss, gnorm, n_tokens = train_step(model, opt, chunks, lr, gen, tok, device)
            st.step += 1
            st.train_tokens += n_tokens
            if st.step % args.log_every == 0:
                print(
                    f"step {st.step} epoch {st.epoch} loss {loss.item():.4f} gnorm {gnorm.item():.2f} "
                    f"lr {lr_at(st.step, args.lr, args.warmup, args.steps):.2e} tokens {st.train_tokens} "
                    f"{time.time() - st.t_train:.0f}s",
                    flush=True,
                )
            if st.step % args.eval_every == 0 or st.step == args.steps:
                val = validate()
                st.record(
                    {
                        "step": st.step,
                        "epoch": st.epoch,
                        "train_loss": loss.item(),
                        "val": val,
                        "seconds": time.time() - st.t_train,
                    },
                    model,
                )
                print(
                    f"  val step {st.step}: ce {val['cross_entropy']:.4f} ppl {val['perplexity']:.3f} "
                    f"acc {val['accuracy']:.3f}",
                    flush=True,
                )
        if st.stopped_by == "time":
            break
    st.train_seconds = time.time() - st.t_train
    if st.best_state is None or (st.history and st.history[-1]["step"] != st.step):
        st.record({"step": st.step, "epoch": st.epoch, "val": validate(), "seconds": st.train_seconds}, model)
    model.load_state_dict(st.best_state)
    model.float()
    return st


def train(args) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device)

    tokenizer = EsmcTokenizer()
    tok = Tokens.from_vocab(tokenizer.get_vocab())
    enc = {k: [tok.encode(s) for _, s in v] for k, v in load_dataset(args.data).items()}
    print({k: (len(v), int(sum(len(x) for x in v))) for k, v in enc.items()}, flush=True)

    model = build_model(args, device)  # after torch.manual_seed: the initialisation is seeded
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"transformers {transformers.__version__} torch {torch.__version__} device {device} params {n_params}",
        flush=True,
    )
    unigram = unigram_logp(enc["train"], tok)
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    st = run_training(model, opt, enc["train"], eval_chunks(enc["val"], args.crop), tok, unigram, device, args)

    def final(split_name, passes):
        return evaluate(model, eval_chunks(enc[split_name], args.crop), passes, tok, unigram, device)

    results = {split_name: final(split_name, 7) for split_name in ("test", "val")}
    results["train_one_fold"] = final("train", 1)  # ~14% of training residues: overfit gauge
    print(json.dumps(results, indent=1), flush=True)

    model.cpu().save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = (out / "model.safetensors").stat().st_size
    metrics = {
        "command": " ".join(sys.argv),
        "reproduce": f"python scripts/train_tiny.py train --device {args.device} --out OUT --steps {st.step}"
        f" --seed {args.seed}  (other settings: hyperparameters below)",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": (torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"),
        "dataset_sha256": hashlib.sha256(Path(args.data).read_bytes()).hexdigest(),
        "split_sequences": {k: len(v) for k, v in enc.items()},
        "split_residues": {k: int(sum(len(x) for x in v)) for k, v in enc.items()},
        "params": n_params,
        "model_safetensors_bytes": size,
        "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "steps_run": st.step,
        "epochs_started": st.epoch,
        "stopped_by": st.stopped_by,
        "train_tokens": st.train_tokens,
        "train_seconds": st.train_seconds,
        "best_step": st.best["step"],
        "history": st.history,
        "test": results["test"],
        "val": results["val"],
        "train_one_fold": results["train_one_fold"],
        "total_seconds": time.time() - t_start,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "README.md").write_text(model_card(metrics))
    print(f"wrote {out} (model.safetensors {size / 1e6:.1f} MB)", flush=True)


def model_card(m):
    t, h = m["test"], m["hyperparameters"]
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: fill-mask
tags:
- esmc
- protein-language-model
- esmc-mlx
---

# esmc-tiny

A small ESMC (transformers `EsmcForMaskedLM`: {h["layers"]} layers, hidden {h["hidden"]}, {h["heads"]} heads
of 64, SwiGLU {h["intermediate"]}, vocabulary 64; {m["params"]:,} parameters, float32) trained by
esmc-mlx with masked-language modelling on {sum(m["split_sequences"].values())} real public protein
sequences shipped as files by the Debian packages `emboss-test`, `hmmer-examples` and
`any2fasta-examples` (UniProtKB/Swiss-Prot and TrEMBL entries, INSDC and NCBI RefSeq CDS
translations, PIR-PSD, WormBase wormpep, Pfam seed alignments, ungapped). It is the model that
`esmc-convert tiny` converts offline: a small demo model, a real trained network for tests,
demos and the quality side of validation (quantization error on trained weights).

**It is not a model for biology.** With {m["params"] / 1e6:.0f} M parameters trained on {m["split_residues"]["train"] / 1e6:.1f} M residues it predicts a
masked residue only a little better than the residue frequencies do (perplexity {t["perplexity"]:.1f} against
{t["unigram_perplexity"]:.1f} below), so its variant scores and embeddings say little about real proteins. For those,
convert ESMC-300M, 600M or 6B (`esmc-convert 300M`).

- Training: {m["steps_run"]} steps (best validation at step {m["best_step"]}), {m["train_tokens"]:,} tokens,
  AdamW lr {h["lr"]}, weight decay {h["weight_decay"]}, {h["batch_tokens"]} tokens a batch, crops of at most
  {h["crop"]} residues, 15% masking (80% `<mask>`, 10% random residue, 10% kept), seed {h["seed"]},
  on {m["device"]} with bf16 autocast, transformers {m["transformers"]}, torch {m["torch"]}.
- Held-out test split ({m["split_sequences"]["test"]} sequences, {t["masked_residues"]} residues, every residue
  masked once): cross-entropy {t["cross_entropy"]:.4f} nats, **perplexity {t["perplexity"]:.2f}** against
  {t["unigram_perplexity"]:.2f} for the unigram residue frequencies of the training split;
  top-1 accuracy {t["accuracy"]:.3f}. The split is by sequence (exact duplicates removed, exact
  substrings kept with their parent), not by homology: families such as globins, cytochromes c
  and the Pfam seeds have members on both sides, so the figure flatters unseen families.

Licence: the weights are released under Apache-2.0, like esmc-mlx. The training sequences come
from UniProtKB (CC BY 4.0, attribution: The UniProt Consortium), Pfam (CC0), INSDC and NCBI
RefSeq (no restrictions), PIR-PSD and WormBase (freely available). esmc-tiny is not affiliated
with EvolutionaryScale's or Biohub's ESMC models and contains none of their weights.

How it was made: `scripts/train_tiny.py` in the esmc-mlx repository; figures and data
provenance: `docs/esmc-tiny.md`.
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser(
        "prepare", help="gather, dedupe and split the sequences; write the panel (the same as scripts/tiny_data.py)"
    )
    tiny_data.add_prepare_arguments(p)
    p.set_defaults(func=lambda a: tiny_data.prepare(a.seed, a.list_test))
    t = sub.add_parser("train", help="train esmc-tiny on the prepared dataset")
    t.add_argument("--data", default=str(DATASET))
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--layers", type=int, default=6)
    t.add_argument("--intermediate", type=int, default=768)
    t.add_argument("--steps", type=int, default=4500)
    t.add_argument("--warmup", type=int, default=300)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.05)
    t.add_argument("--batch-tokens", type=int, default=16384)
    t.add_argument("--crop", type=int, default=MAX_CROP)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument(
        "--max-train-seconds",
        type=float,
        default=1e9,
        help="safety stop; the run records where it stopped (rerun with --steps N to reproduce)",
    )
    t.set_defaults(func=train)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
