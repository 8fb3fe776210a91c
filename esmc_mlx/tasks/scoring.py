"""Embeddings and variant scores from an MLX ESMC. Pure MLX + numpy (no torch, no transformers).

Conventions (docs/scoring.md has the formulas):

* A log-probability is ``log_softmax`` over the model's whole logits row (all ``vocab_size`` =
  64 entries, the 33 tokens and the 31 never-trained padding slots), in float32, as ESM's
  ``predict.py`` does and as transformers' MLM loss does. Mutation scores are differences of two
  log-probabilities at one position, so the normalization cancels in them; it matters only for
  pseudo-perplexity, which then equals ``exp`` of transformers' masked-LM loss.
* masked-marginal: sum over the substituted sites of log p(mut) - log p(wt), each site read
  with that site alone masked in the wild type. wild-type-marginal: the same difference read
  from one unmasked pass over the wild type. pseudo-perplexity: exp of minus the mean of
  log p(x_i | x with i masked) over residue positions.
* Masked copies share forward passes, ``batch_size`` rows a pass; the unmasked wild-type row
  rides along in the same batches, so all single substitutions of an L-residue protein cost
  ceil((L + 1) / B) <= L/B + 1 passes.
* Mean embeddings average the tokens between ``<cls>`` and ``<eos>`` (padding and the two
  special tokens excluded); per-residue embeddings are those same rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from ..errors import ScoringError
from ..runtime.tokenizer import ESMCTokenizer
from ..vocab import check_sequence
from .distributed import World
from .mutations import Substitution, apply, parse_mutants

METHODS = ("masked_marginal", "wt_marginal", "pppl")
DEFAULT_BATCH_SIZE = 32  # masked copies per forward pass
DEFAULT_BATCH_TOKENS = 4096  # padded tokens per embedding batch

_TOKENIZER = ESMCTokenizer()


# --- shared plumbing ------------------------------------------------------------------------

def encode(sequences: Sequence[str], tokenizer=None, names: Sequence[str] | None = None) -> list[np.ndarray]:
    tok = tokenizer or _TOKENIZER
    return [np.asarray(tok.encode(s, name=names[i] if names else None), dtype=np.int32)
            for i, s in enumerate(sequences)]


def _pack(encoded: list[np.ndarray], rows: Sequence[int], tokenizer=None):
    """Right-padded ids, attention mask (None when nothing is padded) and sequence_id (None
    unless a chain break is present) for ``encoded[rows]``."""
    tok = tokenizer or _TOKENIZER
    batch = tok.pad([encoded[r] for r in rows], return_tensors="np", return_sequence_id=True)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    sid = batch["sequence_id"] if (ids == tok.chain_break_token_id).any() else None
    return ids, (None if attn.all() else attn), sid


def _forward(model, ids, attn, sid, output_hidden_states: bool = False):
    return model(
        mx.array(ids),
        attention_mask=None if attn is None else mx.array(attn),
        sequence_id=None if sid is None else mx.array(sid),
        output_hidden_states=output_hidden_states,
    )


def _progress(total: int, unit: str, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=not enabled, dynamic_ncols=True)


# --- embeddings ------------------------------------------------------------------------------

@dataclasses.dataclass
class Embeddings:
    """``mean``: (N, d) float32, row i for sequence i. ``per_residue``: N arrays (L_i, d) when
    asked for. ``layer``: the hidden-state index used (0 = token embeddings, n_layers = final)."""

    mean: np.ndarray
    per_residue: list[np.ndarray] | None
    layer: int


def resolve_layer(layer: int, num_layers: int) -> int:
    """Index into ``hidden_states`` (0 = token embeddings, i = after block i, ``num_layers`` =
    final, after the last LayerNorm); negative counts from the end (-1 = final)."""
    if not -(num_layers + 1) <= layer <= num_layers:
        raise ScoringError(f"layer {layer} is out of range: this model has hidden states 0..{num_layers} "
                           f"(0 = token embeddings, {num_layers} or -1 = final)")
    return layer % (num_layers + 1)


def length_batches(token_lengths: Sequence[int], batch_tokens: int) -> list[np.ndarray]:
    """Group indices longest first so that a batch holds at most ``batch_tokens`` padded
    tokens (rows x longest row); a sequence longer than that runs alone."""
    if batch_tokens < 1:
        raise ScoringError(f"batch_tokens must be positive, got {batch_tokens}")
    lengths = np.asarray(token_lengths)
    order = np.argsort(-lengths, kind="stable")
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > batch_tokens:
            batches.append(np.array(current))
            current = []
        current.append(int(i))
    if current:
        batches.append(np.array(current))
    return batches


def iter_embeddings(model, encoded: list[np.ndarray], batches: Sequence[Sequence[int]], *, layer: int = -1,
                    per_residue: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, list[np.ndarray] | None]]:
    """For each batch of indices into ``encoded`` (token ids with <cls>/<eos>): the indices,
    their mean embeddings (n, d) float32 and, with ``per_residue``, their (L_i, d) rows."""
    index = resolve_layer(layer, model.config.num_hidden_layers)
    final = index == model.config.num_hidden_layers
    for rows in batches:
        rows = np.asarray(rows)
        ids, attn, sid = _pack(encoded, rows)
        out = _forward(model, ids, attn, sid, output_hidden_states=not final)
        h = (out.last_hidden_state if final else out.hidden_states[index]).astype(mx.float32)
        lengths = np.array([len(encoded[r]) - 2 for r in rows])
        positions = np.arange(ids.shape[1])[None, :]
        inside = ((positions >= 1) & (positions <= lengths[:, None])).astype(np.float32)
        mean = (h * mx.array(inside)[..., None]).sum(axis=1) / mx.array(lengths[:, None].astype(np.float32))
        if per_residue:
            mx.eval(mean, h)
            full = np.array(h)
            yield rows, np.array(mean), [full[k, 1 : 1 + n].copy() for k, n in enumerate(lengths)]
        else:
            mx.eval(mean)
            yield rows, np.array(mean), None


def embed(model, sequences: str | Sequence[str], *, layer: int = -1, per_residue: bool = False,
          batch_tokens: int = DEFAULT_BATCH_TOKENS, tokenizer=None, progress: bool = False) -> Embeddings:
    """Mean-pooled (and optionally per-residue) embeddings of ``sequences`` from hidden state
    ``layer`` (0 = token embeddings, -1 = final). Sequences are batched by length, at most
    ``batch_tokens`` padded tokens a pass. Raises TokenizerError for characters outside the
    vocabulary, ScoringError for a layer the model does not have."""
    if isinstance(sequences, str):
        sequences = [sequences]
    encoded = encode(sequences, tokenizer)
    d = model.config.hidden_size
    mean = np.zeros((len(encoded), d), dtype=np.float32)
    residues: list[np.ndarray | None] = [None] * len(encoded)
    batches = length_batches([len(e) for e in encoded], batch_tokens)
    with _progress(len(encoded), "seq", "embed", progress) as bar:
        for rows, m, per in iter_embeddings(model, encoded, batches, layer=layer, per_residue=per_residue):
            mean[rows] = m
            if per is not None:
                for r, p in zip(rows, per):
                    residues[r] = p
            bar.update(len(rows))
    return Embeddings(mean, residues if per_residue else None,
                      resolve_layer(layer, model.config.num_hidden_layers))


# --- masked and unmasked log-probabilities ---------------------------------------------------

def token_log_probs(model, sequences: Sequence[str], seq_index, mask_pos, *, batch_size: int = DEFAULT_BATCH_SIZE,
                    targets_only: bool = False, world: World | None = None, progress: bool = False,
                    desc: str = "score") -> tuple[np.ndarray, int]:
    """Full-vocabulary log-probabilities for a list of jobs, ``batch_size`` rows a pass.

    Job j runs ``sequences[seq_index[j]]`` with residue ``mask_pos[j]`` (0-based) masked and reads
    that one position; with ``mask_pos[j] < 0`` it runs the sequence unmasked and reads every
    position between <cls> and <eos>. Rows come back concatenated in job order, (rows, vocab)
    float32, or (rows,) log p(true token) with ``targets_only``. Under a ``world`` of several
    ranks each runs a strided slice of the jobs and all get every row. Also returns the
    number of forward passes this rank ran.
    """
    if batch_size < 1:
        raise ScoringError(f"batch_size must be positive, got {batch_size}")
    world = world or World()
    seq_index, mask_pos = np.asarray(seq_index, dtype=np.int64), np.asarray(mask_pos, dtype=np.int64)
    encoded = encode(sequences)
    lengths = np.array([len(e) - 2 for e in encoded], dtype=np.int64)
    rows_per_job = np.where(mask_pos >= 0, 1, lengths[seq_index])
    order = np.argsort(lengths[seq_index], kind="stable")  # similar lengths share a batch
    mine = world.shard(order)
    mask_id, vocab = _TOKENIZER.mask_token_id, model.config.vocab_size
    pieces, passes = [], 0
    n_batches = math.ceil(len(mine) / batch_size)
    with _progress(n_batches, "pass", desc, progress and world.is_root) as bar:
        for start in range(0, len(mine), batch_size):
            jobs = mine[start : start + batch_size]
            ids, attn, sid = _pack(encoded, seq_index[jobs])
            read_r, read_c = [], []
            for k, j in enumerate(jobs):
                if mask_pos[j] >= 0:
                    read_r.append(k)
                    read_c.append(int(mask_pos[j]) + 1)
                else:
                    n = int(lengths[seq_index[j]])
                    read_r.extend([k] * n)
                    read_c.extend(range(1, n + 1))
            read_r, read_c = np.array(read_r), np.array(read_c)
            targets = ids[read_r, read_c].copy()
            masked = np.nonzero(mask_pos[jobs] >= 0)[0]
            ids[masked, mask_pos[jobs][masked] + 1] = mask_id
            hidden = _forward(model, ids, attn, sid).last_hidden_state
            # The LM head on the rows read only (lazily, the full-width logits are never built).
            logits = model.lm_head(hidden[mx.array(read_r), mx.array(read_c)]).astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if targets_only:
                logp = mx.take_along_axis(logp, mx.array(targets)[:, None], axis=-1)[:, 0]
            mx.eval(logp)
            pieces.append(np.array(logp))
            passes += 1
            bar.update(1)
    width = () if targets_only else (vocab,)
    local = np.concatenate(pieces) if pieces else np.zeros((0, *width), dtype=np.float32)
    parts = world.gather(local)
    offsets = np.concatenate([[0], np.cumsum(rows_per_job)])
    result = np.empty((int(offsets[-1]), *width), dtype=np.float32)
    for rank, part in enumerate(parts):
        jobs = order[rank :: world.size]
        if np.all(rows_per_job[jobs] == 1):
            result[offsets[jobs]] = part
            continue
        at = 0
        for j in jobs:
            n = int(rows_per_job[j])
            result[offsets[j] : offsets[j] + n] = part[at : at + n]
            at += n
    return result, passes


def _residue_positions(sequence: str) -> np.ndarray:
    """0-based positions of residues (letters), skipping gaps and chain breaks."""
    return np.array([i for i, c in enumerate(sequence) if c.isalpha()], dtype=np.int64)


def pseudo_perplexity(model, sequences: str | Sequence[str], *, batch_size: int = DEFAULT_BATCH_SIZE,
                      group=None, progress: bool = False) -> np.ndarray:
    """exp(-mean_i log p(x_i | x with i masked)) over each sequence's residues: one masked
    copy per residue, ``batch_size`` copies a pass. Returns (N,) float64."""
    if isinstance(sequences, str):
        sequences = [sequences]
    sequences = [check_sequence(s, str(i + 1), label="sequence") for i, s in enumerate(sequences)]
    seq_index, mask_pos = [], []
    for i, s in enumerate(sequences):
        pos = _residue_positions(s)
        seq_index.append(np.full(len(pos), i))
        mask_pos.append(pos)
    seq_index, mask_pos = np.concatenate(seq_index), np.concatenate(mask_pos)
    logp, _ = token_log_probs(model, sequences, seq_index, mask_pos, batch_size=batch_size, targets_only=True,
                              world=World.of(group), progress=progress, desc="pppl")
    sums = np.bincount(seq_index, weights=logp.astype(np.float64), minlength=len(sequences))
    counts = np.bincount(seq_index, minlength=len(sequences))
    return np.exp(-sums / counts)


# --- variant scores --------------------------------------------------------------------------

@dataclasses.dataclass
class MutationScores:
    """Scores aligned with ``mutants``: ``scores[method]`` is (N,) float64 for each method run.
    ``wt_pppl`` is the wild type's pseudo-perplexity (with method ``pppl``); ``passes`` the
    forward passes this process ran."""

    mutants: list[str]
    scores: dict[str, np.ndarray]
    wt_pppl: float | None = None
    passes: int = 0

    def __getitem__(self, method: str) -> np.ndarray:
        return self.scores[method]


def score_mutations(model, sequence: str, mutations: Sequence[str], *,
                    methods: Sequence[str] = ("masked_marginal", "wt_marginal"),
                    batch_size: int = DEFAULT_BATCH_SIZE, offset: int = 1, group=None,
                    progress: bool = False, where: Sequence[str] | None = None) -> MutationScores:
    """Score ProteinGym-style mutant strings (``A23G``, ``A23G:L40P``; 1-based from ``offset``)
    against the wild-type ``sequence``.

    methods: ``masked_marginal`` (sum over sites of log p(mut) - log p(wt), each site masked
    alone; masked copies batched ``batch_size`` a pass), ``wt_marginal`` (the same from one
    unmasked pass) and ``pppl`` (pseudo-perplexity of each mutated sequence, L masked copies
    each, and of the wild type). Log-probabilities are log_softmax over the full logits row.
    Under ``mlx.launch`` pass ``group=mx.distributed.init()`` to split the passes over ranks.
    Raises MutationError (malformed, wild type mismatch, out of range), FastaError (bad
    characters in ``sequence``), ScoringError (unknown method).
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ScoringError(f"unknown scoring method {unknown or methods!r}; choose from {', '.join(METHODS)}")
    sequence = check_sequence(sequence, "wild type", label="sequence")
    if isinstance(mutations, str):
        mutations = [mutations]
    mutants = list(mutations)
    parsed = parse_mutants(mutants, sequence, offset, list(where) if where else None)
    world = World.of(group)
    tid = _TOKENIZER.token_to_id
    scores: dict[str, np.ndarray] = {}
    passes, wt_pppl = 0, None

    # One call for everything read from the wild type: masked sites (+ the unmasked row).
    sites = sorted({s.index for subs in parsed for s in subs}) if "masked_marginal" in methods else []
    if "pppl" in methods:
        sites = list(_residue_positions(sequence))
    mask_pos = list(sites) + ([-1] if "wt_marginal" in methods else [])
    table = None
    if mask_pos:
        table, passes = token_log_probs(model, [sequence], np.zeros(len(mask_pos), dtype=np.int64), mask_pos,
                                        batch_size=batch_size, world=world, progress=progress)
    row_of = {p: k for k, p in enumerate(sites)}

    def total(subs: list[Substitution], rows) -> float:
        return float(sum(float(rows(s)[tid[s.mut]]) - float(rows(s)[tid[s.wt]]) for s in subs))

    if "masked_marginal" in methods:
        scores["masked_marginal"] = np.array([total(subs, lambda s: table[row_of[s.index]]) for subs in parsed])
    if "wt_marginal" in methods:
        unmasked = table[len(sites) :]  # (L, vocab), one row per position
        scores["wt_marginal"] = np.array([total(subs, lambda s: unmasked[s.index]) for subs in parsed])
    if "pppl" in methods:
        positions = _residue_positions(sequence)
        wt_logp = table[[row_of[p] for p in positions], _token_ids(sequence, positions)]
        wt_pppl = float(np.exp(-wt_logp.astype(np.float64).mean()))
        variants = sorted({apply(sequence, subs) for subs in parsed if subs} - {sequence})
        values = {sequence: wt_pppl}
        if variants:
            seq_index = np.repeat(np.arange(len(variants)), len(positions))
            pos = np.tile(positions, len(variants))
            logp, more = token_log_probs(model, variants, seq_index, pos, batch_size=batch_size, targets_only=True,
                                         world=world, progress=progress, desc="pppl")
            passes += more
            means = logp.astype(np.float64).reshape(len(variants), len(positions)).mean(axis=1)
            values.update(zip(variants, np.exp(-means)))
        scores["pppl"] = np.array([values[apply(sequence, subs)] for subs in parsed])
    return MutationScores(mutants, scores, wt_pppl, passes)


def _token_ids(sequence: str, positions: np.ndarray) -> np.ndarray:
    """Token ids of ``sequence``'s residues at ``positions``."""
    return np.array([_TOKENIZER.token_to_id[sequence[p]] for p in positions], dtype=np.int64)
