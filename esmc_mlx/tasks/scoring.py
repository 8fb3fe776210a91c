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
import numbers
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from ..artifact import plural
from ..config import TRAINED_TOKENS, ESMCConfig
from ..errors import EsmcMlxWarning, JobError, MutationError, ScoringError, SequenceError
from ..runtime.execution import layer_activation_bytes
from ..runtime.model import ESMC
from ..runtime.quantized import backend
from ..runtime.tokenizer import ESMCTokenizer
from ..vocab import NONSTANDARD, as_sequences, check_sequence, item_names, nonstandard_positions, nonstandard_text
from .distributed import World
from .mutations import Substitution, apply, parse_mutant

METHODS = ("masked_marginal", "wt_marginal", "pppl")
MULTI = ("sum", "joint")  # multi-mutant conventions of masked-marginal
DEFAULT_WINDOW = TRAINED_TOKENS - 2  # residues per scoring window: the trained length
DEFAULT_BATCH_SIZE = 32  # masked copies per forward pass
DEFAULT_BATCH_TOKENS = 4096  # padded tokens per embedding batch
# Where larger batches pay: on an H200 the 300M embedded 1,472-1,517 sequences/s with 16384
# against 974-1,204 with 4096 (20,000 sequences of 50-500 residues; docs/scoring.md): fewer,
# larger forwards leave less host work per sequence. On a 2-vCPU host 16384 was slower (0.25
# against 0.33-0.35 sequences/s, 300M-shaped); Metal was not measured.
BATCH_TOKENS = {"cuda": 16384}
# Embedding batches are padded to a multiple of this many tokens. A compiled forward is traced
# once per input shape (and runs from the second sighting): 20,000 sequences of 50-500 residues
# in exact-width batches of 4096 tokens made 645 shapes in 1,413 batches (1,139 of them eager or
# tracing); widths in steps of 32 make a few dozen, for ~6% more padded tokens. Padded keys are
# masked: the outputs are the same function.
PAD_MULTIPLE = 32

_TOKENIZER = ESMCTokenizer()


# --- shared plumbing ------------------------------------------------------------------------


def encode(sequences: Sequence[str], tokenizer=None, names: Sequence[str] | None = None) -> list[np.ndarray]:
    tok = tokenizer or _TOKENIZER
    names = item_names(sequences, names)
    if hasattr(tok, "encode_array"):
        return [tok.encode_array(s, name=names[i] if names else None) for i, s in enumerate(sequences)]
    return [
        np.asarray(tok.encode(s, name=names[i] if names else None), dtype=np.int32) for i, s in enumerate(sequences)
    ]


def _pack(encoded: list[np.ndarray], rows: Sequence[int], tokenizer=None, pad_to_multiple_of: int | None = None):
    """Right-padded ids, attention mask (None when nothing is padded) and sequence_id (None
    unless a chain break is present) for ``encoded[rows]``."""
    tok = tokenizer or _TOKENIZER
    batch = tok.pad(
        [encoded[r] for r in rows], return_tensors="np", return_sequence_id=True, pad_to_multiple_of=pad_to_multiple_of
    )
    ids, attn = batch["input_ids"], batch["attention_mask"]
    sid = batch["sequence_id"] if (ids == tok.chain_break_token_id).any() else None
    return ids, (None if attn.all() else attn), sid


def _forward(model: ESMC, ids, attn, sid, output_hidden_states: bool = False):
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

POOLS = ("mean", "max", "cls", "per_residue")


class ByLayer(dict):
    """One pool's embeddings keyed by hidden-state index (0 = token embeddings, n = final): what
    ``Embeddings.mean`` / ``.per_residue`` and ``StoredEmbeddings.mean`` / ``.residues`` are when
    several layers were asked for, so that none of them is taken for the others.
    ``emb.mean[6]``; a negative index counts from the end (``emb.mean[-1]``: the final layer)."""

    def __init__(self, arrays: dict, pool: str, num_layers: int):
        super().__init__(arrays)
        self.pool, self.num_layers = pool, num_layers

    def __missing__(self, layer):
        if isinstance(layer, numbers.Integral) and not isinstance(layer, bool) and layer < 0:
            if (layer + self.num_layers + 1) in self:
                return self[layer + self.num_layers + 1]
        raise KeyError(f"no {self.pool} embeddings of layer {layer!r}: these hold layers {_listed(self)}")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        last = list(self)[-1]
        raise AttributeError(
            f"{self.pool} holds one array per layer ({_listed(self)}), a dict keyed by layer: take one, "
            f"e.g. .{self.pool}[{last}] or .get({self.pool!r}, layer={last}); {name!r} is not one of its attributes"
        )

    def __repr__(self) -> str:
        return f"ByLayer({self.pool}: " + ", ".join(f"layer {k} {_shape(v)}" for k, v in self.items()) + ")"


def _listed(layers) -> str:
    return ", ".join(map(str, layers))


def _width(value) -> int | str:
    """The hidden size of an (N, d) array, or of N per-residue arrays (L_i, d)."""
    if isinstance(value, list):
        value = next((v for v in value if v is not None), None)
    shape = getattr(value, "shape", ())
    return shape[-1] if shape else "?"


def _shape(value) -> str:
    """``(N, d)`` of an array, ``N x (L, d)`` of per-residue rows."""
    if isinstance(value, list):
        return f"{len(value)} x (L, {_width(value)})"
    return str(tuple(getattr(value, "shape", ())))


def of_layers(arrays: dict, layers: Sequence[int], pool: str, num_layers: int):
    """``pool`` of ``arrays`` (keyed by (layer, pool)): the array itself for one layer, a
    ``ByLayer`` for several, None when the pool was not computed."""
    found = {i: arrays[(i, pool)] for i in layers if (i, pool) in arrays}
    if not found:
        return None
    return next(iter(found.values())) if len(layers) == 1 else ByLayer(found, pool, num_layers)


@dataclasses.dataclass(repr=False)
class Embeddings:
    """``pooled[(layer, pool)]``: (N, d) float32 for pools mean / max / cls, or N arrays (L_i, d)
    for per_residue, for every hidden-state index in ``layers`` (0 = token embeddings,
    n_layers = final) and pool asked for. ``get(pool, layer)`` reads one (``layer`` may be left
    out when one layer was asked for).

    ``mean`` and ``per_residue``: for one layer, its array (None when that pool was not asked
    for); for several, a ``ByLayer`` dict keyed by layer (``emb.mean[6]``), never one layer taken
    for all. ``layer``: the one layer, None when there are several."""

    pooled: dict = dataclasses.field(default_factory=dict)
    layers: tuple[int, ...] = ()
    num_layers: int = 0

    @property
    def mean(self):
        return of_layers(self.pooled, self.layers, "mean", self.num_layers)

    @property
    def per_residue(self):
        return of_layers(self.pooled, self.layers, "per_residue", self.num_layers)

    @property
    def layer(self) -> int | None:
        return self.layers[0] if len(self.layers) == 1 else None

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for _, p in self.pooled))

    def get(self, pool: str = "mean", layer: int | None = None):
        """The embeddings of ``pool`` at hidden state ``layer`` (-1 = final). ``layer`` may be
        left out when one layer was asked for; with several, ScoringError naming them."""
        if not isinstance(pool, str):
            raise ScoringError(f"pool {pool!r}: give a pool name ({', '.join(self.pools)})")
        if layer is None:
            if len(self.layers) != 1:
                raise ScoringError(
                    f"get({pool!r}): these embeddings hold layers {_listed(self.layers)}; say which with "
                    f"layer= (one of them, or -1 for the final)"
                )
            layer = self.layers[0]
        else:
            layer = resolve_layer(layer, self.num_layers)
        key = (layer, pool.replace("-", "_"))
        if key not in self.pooled:
            asked = ", ".join(f"{p} at layer {i}" for i, p in self.pooled)
            raise ScoringError(f"no {key[1]} embeddings at layer {layer}: these hold {asked}")
        return self.pooled[key]

    def __len__(self) -> int:
        first = next(iter(self.pooled.values()), [])
        return len(first)

    def __repr__(self) -> str:
        width = _width(next(iter(self.pooled.values()), None))
        return (
            f"Embeddings({plural(len(self), 'sequence')}, hidden size {width}, layers [{_listed(self.layers)}], "
            f"pools [{', '.join(self.pools)}])"
        )


def resolve_layer(layer: int, num_layers: int) -> int:
    """Index into ``hidden_states`` (0 = token embeddings, i = after block i, ``num_layers`` =
    final, after the last LayerNorm); negative counts from the end (-1 = final)."""
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise ScoringError(f"layer {layer!r}: give an integer (0 = token embeddings, -1 = final)")
    if not -(num_layers + 1) <= layer <= num_layers:
        raise ScoringError(
            f"layer {layer} is out of range: this model has hidden states 0..{num_layers} "
            f"(0 = token embeddings, {num_layers} or -1 = final)"
        )
    return layer % (num_layers + 1)


def pick_layers(layer, layers):
    """``layers``, else ``layer``, else -1 (the final hidden state); ScoringError when both are
    given, since one would be ignored (as ``--layer`` with ``--layers``)."""
    if layer is not None and layers is not None:
        raise ScoringError(f"give layer={layer!r} or layers={layers!r}, not both")
    return layers if layers is not None else -1 if layer is None else layer


def resolve_layers(layers, num_layers: int) -> tuple[int, ...]:
    """``"all"``, ``"6,12,-1"``, an int or a list of ints -> distinct hidden-state indices, in
    the order given."""
    if isinstance(layers, str):
        text = layers.strip().lower()
        if text == "all":
            return tuple(range(num_layers + 1))
        try:
            layers = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ScoringError(f"layers {layers!r}: give 'all' or comma-separated integers like 6,12,-1") from None
    if isinstance(layers, numbers.Integral) or not isinstance(layers, Iterable):
        layers = [layers]
    out = tuple(dict.fromkeys(int(resolve_layer(x, num_layers)) for x in layers))
    if not out:
        raise ScoringError("no layer given")
    return out


def resolve_pools(pools, per_residue: bool = False) -> tuple[str, ...]:
    """``"mean,max,cls,per-residue"`` or a list (None: mean) -> distinct pool names (``per-residue``
    and ``per_residue`` both accepted); ``per_residue`` adds per_residue, as ``--per-residue`` does."""
    if pools is None:
        pools = ("mean",)
    if isinstance(pools, str):
        pools = pools.split(",")
    if not isinstance(pools, Iterable) or not all(isinstance(p, str) for p in pools):
        raise ScoringError(f"pools {pools!r}: give pool names (mean, max, cls, per-residue)")
    out = tuple(dict.fromkeys(p.strip().lower().replace("-", "_") for p in pools if p.strip()))
    unknown = [p for p in out if p not in POOLS]
    if unknown or not out:
        raise ScoringError(f"unknown pooling {unknown or pools!r}; choose from mean, max, cls, per-residue")
    return (*out, "per_residue") if per_residue and "per_residue" not in out else out


def positive_int(value, name: str) -> int:
    """``value`` as an int, or ScoringError naming ``name`` when it is not a positive integer
    (a float, a string or a bool would fail deep in numpy, or be used as 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ScoringError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def memory_bytes() -> int:
    """The memory a forward pass may use: the GPU's (MLX's ``device_info``) on a GPU, else the
    machine's RAM."""
    if mx.default_device().type != mx.DeviceType.cpu:
        try:
            size = int(mx.device_info().get("memory_size") or 0)
        except (AttributeError, RuntimeError, ValueError, TypeError):
            size = 0
        if size:
            return size
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def forward_bytes(
    config: ESMCConfig,
    rows: int,
    width: int,
    hidden_states: bool = False,
    training: bool = False,
    checkpointing: bool = False,
    attentions: bool = False,
) -> int:
    """An upper estimate of one forward pass's memory over ``rows`` x ``width`` tokens (fp32):
    one block's intermediates (the runtime evaluates the residual stream in chunks), with the
    (rows, heads, width, width) attention scores on the CPU, where attention is not fused; and
    every hidden state when they are all kept. ``training``: a training step's, whose backward
    pass needs what the forward made: every block's intermediates, attention scores included
    (attention's gradient is not fused on any device), or with ``checkpointing`` every block's
    input and one block's intermediates, recomputed. ``attentions``: a forward that gives its
    attention maps (computed unfused on every device), one block's kept beside it."""
    per_layer = layer_activation_bytes(config, rows, width, 4)
    n, scores = config.num_hidden_layers, 4 * rows * config.num_attention_heads * width**2
    if training:
        stream = 4 * rows * width * config.hidden_size * (n + 1)
        return stream + 2 * per_layer if checkpointing else (n + 1) * per_layer
    if attentions:
        return per_layer + scores
    if mx.default_device().type != mx.DeviceType.cpu:
        per_layer -= scores
    kept = 4 * rows * width * config.hidden_size * (n + 1) if hidden_states else 0
    return per_layer + kept


def check_forward_memory(config: ESMCConfig, rows: int, width: int, what: str, fix: str, **kwargs) -> None:
    """ScoringError naming ``what`` (the input or option at fault) and saying how to run it
    (``fix``) when a forward pass (``training``: a training step) over ``rows`` x ``width``
    tokens needs more memory than this machine has (``forward_bytes``): checked before any
    work, where MLX would fail deep inside or the process would be killed."""
    need, have = forward_bytes(config, rows, width, **kwargs), memory_bytes()
    if need > have:
        step = "one training step" if kwargs.get("training") else "one forward pass"
        raise ScoringError(
            f"{what}: {step} would need about {need / 2**30:,.1f} GiB, more than the "
            f"{have / 2**30:,.1f} GiB here; {fix}"
        )


SPLIT_RECORD = (
    "attention grows with the square of the length: split the record (into domains, or overlapping pieces) "
    "before running it"
)


def check_records_memory(
    config: ESMCConfig,
    lengths: Sequence[int],
    batch_tokens: int,
    name_of,
    fix_record: str = SPLIT_RECORD,
    fix_batch: str = "give a smaller --batch-tokens",
    **kwargs,
) -> None:
    """ScoringError, before anything is written, when the longest of the records (``lengths``:
    residues) alone, or a batch of ``batch_tokens`` padded tokens, would not fit in memory
    (``check_forward_memory``; ``kwargs``: its ``forward_bytes`` options). ``name_of(i)`` names
    record i (its file and ID). The one check of every job: embed, features, finetune, predict,
    attention."""
    if not len(lengths):
        return
    longest = int(np.argmax(lengths))
    residues = int(lengths[longest])
    width = -(-(residues + 2) // PAD_MULTIPLE) * PAD_MULTIPLE
    if width > batch_tokens:
        check_forward_memory(config, 1, width, f"{name_of(longest)} ({residues:,} residues)", fix_record, **kwargs)
    rows = max(1, batch_tokens // width)
    check_forward_memory(config, rows, width, f"--batch-tokens {batch_tokens:,}", fix_batch, **kwargs)


def default_batch_tokens() -> int:
    """Padded tokens per embedding batch on the default device (BATCH_TOKENS, else 4096)."""
    return BATCH_TOKENS.get(backend(), DEFAULT_BATCH_TOKENS)


def length_batches(token_lengths: Sequence[int], batch_tokens: int, multiple: int = 1) -> list[np.ndarray]:
    """Group indices longest first so that a batch holds at most ``batch_tokens`` padded
    tokens (rows x longest row, rounded up to ``multiple``); a sequence longer than that runs
    alone."""
    batch_tokens = positive_int(batch_tokens, "batch_tokens")
    lengths = np.asarray(token_lengths)
    widths = -(-lengths // multiple) * multiple
    order = np.argsort(-lengths, kind="stable")
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * widths[current[0]] > batch_tokens:
            batches.append(np.array(current))
            current = []
        current.append(int(i))
    if current:
        batches.append(np.array(current))
    return batches


_NONSTANDARD_IDS = np.array([_TOKENIZER.token_to_id[c] for c in NONSTANDARD])


def iter_embeddings(
    model: ESMC,
    encoded: list[np.ndarray],
    batches: Sequence[Sequence[int]],
    *,
    layers=(-1,),
    pools=("mean",),
    keep_nonstandard: bool = False,
) -> Iterator[tuple[np.ndarray, dict]]:
    """For each batch of indices into ``encoded`` (token ids with <cls>/<eos>): the indices and
    ``{(layer, pool): value}`` for every layer and pool, from one forward pass: pooled values
    (n, d) float32, per-residue values a list of (L_i, d) float32 arrays. Pools over the residue
    rows (between <cls> and <eos>, padding excluded; non-standard residues too unless
    ``keep_nonstandard``): mean, max; cls is the <cls> row; per-residue keeps every row."""
    n_layers = model.config.num_hidden_layers
    layers, pools = resolve_layers(list(layers), n_layers), resolve_pools(pools)
    need_all = any(i != n_layers for i in layers)

    def start(rows):
        rows = np.asarray(rows)
        ids, attn, sid = _pack(encoded, rows, pad_to_multiple_of=PAD_MULTIPLE)
        out = _forward(model, ids, attn, sid, output_hidden_states=need_all)
        lengths = np.array([len(encoded[r]) - 2 for r in rows])
        positions = np.arange(ids.shape[1])[None, :]
        pooled = (positions >= 1) & (positions <= lengths[:, None])
        if not keep_nonstandard:
            pooled &= ~np.isin(ids, _NONSTANDARD_IDS)
        counts = pooled.sum(axis=1, keepdims=True).astype(np.float32)
        inside = mx.array(pooled)[..., None]
        lazy = {}
        for i in layers:
            h = (out.last_hidden_state if i == n_layers else out.hidden_states[i]).astype(mx.float32)
            for pool in pools:
                if pool == "mean":
                    lazy[(i, pool)] = (h * inside).sum(axis=1) / mx.array(counts)
                elif pool == "max":
                    lazy[(i, pool)] = mx.where(inside, h, mx.array(-np.inf, mx.float32)).max(axis=1)
                elif pool == "cls":
                    lazy[(i, pool)] = h[:, 0]
                else:
                    lazy[(i, pool)] = h
        mx.async_eval(*lazy.values())
        return rows, lengths, lazy

    def finish(rows, lengths, lazy):
        values = {}
        for key, v in lazy.items():
            v = np.array(v)  # waits for this batch only
            values[key] = [v[k, 1 : 1 + n].copy() for k, n in enumerate(lengths)] if key[1] == "per_residue" else v
        return rows, values

    yield from one_batch_ahead(batches, start, finish)


def one_batch_ahead(batches, start, finish):
    """``finish(*start(rows))`` for each batch, with the next batch packed and queued
    (``start``) before this one is copied to host memory and handed on (``finish``): the device
    is not idle while the host copies, gathers and writes. The same graphs are evaluated: the
    values are the same."""
    running = None
    for rows in batches:
        queued = start(rows)
        if running is not None:
            yield finish(*running)
        running = queued
    if running is not None:
        yield finish(*running)


def embed(
    model: ESMC,
    sequences: str | Sequence[str],
    *,
    layer: int | None = None,
    per_residue: bool = False,
    layers=None,
    pools=None,
    batch_tokens: int | None = None,
    keep_nonstandard: bool = False,
    tokenizer=None,
    progress: bool = False,
) -> Embeddings:
    """Embeddings of ``sequences`` from the hidden states ``layers`` (0 = token embeddings, -1 =
    final; default: ``layer``, else -1) pooled as ``pools`` (mean, max, cls, per_residue; default: mean),
    plus per_residue with ``per_residue``, all from one forward pass per batch. Sequences are
    batched by length, at most ``batch_tokens`` padded tokens a pass (default:
    ``default_batch_tokens()``). Mean and max leave non-standard residues (X B Z U O) out, with
    a warning, unless ``keep_nonstandard``; per-residue rows keep every residue. Raises
    TokenizerError for characters outside the vocabulary, a sequence of non-standard residues
    alone (nothing to pool), ScoringError for a layer the model does not have."""
    sequences = as_sequences(sequences)
    n_layers = model.config.num_hidden_layers
    layers = resolve_layers(pick_layers(layer, layers), n_layers)
    pools = resolve_pools(pools, per_residue)
    encoded = encode(sequences, tokenizer)
    tally = NonstandardTally(keep_nonstandard, pools)
    for i, (name, e) in enumerate(zip(item_names(sequences) or [None], encoded)):
        tally.add(name or str(i + 1), e[1:-1])
    tally.warn()
    d, n = model.config.hidden_size, len(encoded)
    pooled = {
        (i, p): ([None] * n if p == "per_residue" else np.zeros((n, d), np.float32)) for i in layers for p in pools
    }
    if batch_tokens is None:
        batch_tokens = default_batch_tokens()
    batches = length_batches([len(e) for e in encoded], batch_tokens, PAD_MULTIPLE)
    with _progress(n, "seq", "embed", progress) as bar:
        for rows, values in iter_embeddings(
            model, encoded, batches, layers=layers, pools=pools, keep_nonstandard=keep_nonstandard
        ):
            for key, v in values.items():
                if key[1] == "per_residue":
                    for r, x in zip(rows, v):
                        pooled[key][r] = x
                else:
                    pooled[key][rows] = v
            bar.update(len(rows))
    return Embeddings(pooled, layers, n_layers)


# --- masked and unmasked log-probabilities ---------------------------------------------------


def token_log_probs(
    model: ESMC,
    sequences: Sequence[str],
    seq_index,
    mask_pos,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    targets_only: bool = False,
    world: World | None = None,
    progress: bool = False,
    desc: str = "score",
) -> tuple[np.ndarray, int]:
    """Full-vocabulary log-probabilities for a list of jobs, ``batch_size`` rows a pass.

    Job j runs ``sequences[seq_index[j]]`` with residue ``mask_pos[j]`` (0-based) masked and reads
    that one position; with ``mask_pos[j] < 0`` it runs the sequence unmasked and reads every
    position between <cls> and <eos>. Rows come back concatenated in job order, (rows, vocab)
    float32, or (rows,) log p(true token) with ``targets_only``. Under a ``world`` of several
    ranks each runs a strided slice of the jobs and all get every row. Also returns the
    number of forward passes this rank ran.
    """
    seq_index, mask_pos = np.asarray(seq_index, dtype=np.int64), np.asarray(mask_pos, dtype=np.int64)
    lengths = [len(s) for s in sequences]
    masks = [np.array([p]) if p >= 0 else np.zeros(0, np.int64) for p in mask_pos]
    reads = [np.array([p]) if p >= 0 else np.arange(lengths[i]) for i, p in zip(seq_index, mask_pos)]
    return run_jobs(
        model,
        sequences,
        seq_index,
        masks,
        reads,
        batch_size=batch_size,
        targets_only=targets_only,
        world=world,
        progress=progress,
        desc=desc,
    )


def run_jobs(
    model: ESMC,
    sequences: Sequence[str],
    seq_index,
    masks: Sequence[np.ndarray],
    reads: Sequence[np.ndarray],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    targets_only: bool = False,
    world: World | None = None,
    progress: bool = False,
    desc: str = "score",
) -> tuple[np.ndarray, int]:
    """The general form of ``token_log_probs``: job j runs ``sequences[seq_index[j]]`` with the
    residues ``masks[j]`` (0-based, any number, none for an unmasked pass) replaced by <mask>
    and reads the rows at ``reads[j]``. One row per job goes into a batch of ``batch_size``.
    Rows come back concatenated in job order; the true tokens of ``targets_only`` are the
    unmasked sequence's."""
    batch_size = positive_int(batch_size, "batch_size")
    world = world or World()
    seq_index = np.asarray(seq_index, dtype=np.int64)
    encoded = encode(sequences)
    lengths = np.array([len(e) - 2 for e in encoded], dtype=np.int64)
    rows_per_job = np.array([len(r) for r in reads], dtype=np.int64)
    if len(seq_index):
        longest = int(lengths[seq_index].max())
        check_forward_memory(
            model.config,
            min(batch_size, len(seq_index)),
            longest + 2,
            f"a sequence of {longest:,} residues in batches of {batch_size}",
            "score it in windows (--window, 2046 residues by default) or with a smaller --batch-size",
        )
    order = np.argsort(lengths[seq_index], kind="stable")  # similar lengths share a batch
    mine = world.shard(order)
    mask_id, vocab = _TOKENIZER.mask_token_id, model.config.vocab_size
    pieces, passes = [], 0
    n_batches = math.ceil(len(mine) / batch_size)
    with _progress(n_batches, "pass", desc, progress and world.is_root) as bar:
        for start in range(0, len(mine), batch_size):
            jobs = mine[start : start + batch_size]
            ids, attn, sid = _pack(encoded, seq_index[jobs])
            read_r = np.concatenate([np.full(len(reads[j]), k) for k, j in enumerate(jobs)]).astype(np.int64)
            read_c = np.concatenate([np.asarray(reads[j], dtype=np.int64) + 1 for j in jobs])
            targets = ids[read_r, read_c].copy()
            for k, j in enumerate(jobs):
                if len(masks[j]):
                    ids[k, np.asarray(masks[j], dtype=np.int64) + 1] = mask_id
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


def _residue_positions(sequence: str, what: str | None = None, skip=()) -> np.ndarray:
    """0-based positions of residues (letters), skipping gaps, chain breaks and the positions
    ``skip``. With ``what``: SequenceError naming it when there are none (a pseudo-perplexity of
    nothing is NaN)."""
    skip = set(skip)
    positions = np.array([i for i, c in enumerate(sequence) if c.isalpha() and i not in skip], dtype=np.int64)
    if what is not None and not positions.size:
        also = ", or non-standard residues (--keep-nonstandard scores those)" if skip else ""
        raise SequenceError(f"{what}: no residues to score, only gaps or chain breaks{also} ({sequence!r})")
    return positions


# --- windows over long sequences ---------------------------------------------------------------


def window_bounds(center: int, length: int, width: int | None) -> tuple[int, int]:
    """[start, end) of the residues scored with the window centred on residue ``center``
    (ProteinGym's ``scoring_window="optimal"``): the whole sequence when it fits in ``width``,
    else ``width`` residues centred on ``center``, slid inwards at either end. A masked copy
    is made for its site anyway, so it gets the window centred on it."""
    if width is None or length <= width:
        return 0, length
    half = width // 2
    start = min(max(center - half, 0), length - width)
    return start, start + width


def unmasked_window(site: int, length: int, width: int | None) -> tuple[int, int]:
    """[start, end) of the window an unmasked pass reads residue ``site`` from. Windows of
    ``width`` residues starting every ``width // 2`` residues (the last one ending at the last
    residue) tile the sequence; a site is read from the one whose centre is nearest, which
    leaves it at least ``width // 4`` residues of context on either side where the sequence has
    them. All sites share these few windows: a wt-marginal scan of L residues costs about
    2L / width window passes, where a window centred on each site cost one pass per site."""
    if width is None or length <= width:
        return 0, length
    stride = max(1, width // 2)
    starts = np.append(np.arange(0, length - width, stride), length - width)
    start = int(starts[np.argmin(np.abs(starts + (width - 1) / 2 - site))])  # ties: the earlier window
    return start, start + width


def check_multi_window(multi: str, window: int | None, methods: Sequence[str] = ("masked_marginal",)) -> None:
    """ScoringError for an unknown ``multi``, ``joint`` without masked-marginal (the only method
    it changes), or a ``window`` that is not None or a positive int."""
    if multi not in MULTI:
        raise ScoringError(f"unknown multi-mutant convention {multi!r}; choose from {', '.join(MULTI)}")
    if multi == "joint" and "masked_marginal" not in methods:
        asked = ", ".join(m.replace("_", "-") for m in methods)
        raise ScoringError(
            f"--multi joint masks the sites of a multi-mutant together, which only masked-marginal does; "
            f"it would change nothing for {asked}: add --method masked-marginal or leave --multi out"
        )
    if window is not None:
        positive_int(window, "window")


def joint_window_problem(subs: Sequence[Substitution], length: int, window: int | None) -> str | None:
    """Why no window of ``window`` residues holds all sites of the multi-mutant ``subs`` (joint
    masking reads them from one window), or None when one does."""
    if len(subs) < 2:
        return None
    lo, hi = min(s.index for s in subs), max(s.index for s in subs)
    start, end = window_bounds((lo + hi) // 2, length, window)
    if lo >= start and hi < end:
        return None
    return (
        f"its sites span more than the window of {window} residues ({hi - lo + 1}); "
        "--multi joint needs them in one window (raise --window)"
    )


class LongSequenceWarning(EsmcMlxWarning):
    """A sequence longer than ESMC's training length."""


def check_length(sequence: str, window: int | None, what: str = "sequence") -> None:
    """Warn when ``sequence`` is longer than the model was trained on (2,048 tokens);
    ScoringError for a ``window`` that is not None or a positive integer."""
    if window is not None:
        positive_int(window, "window")
    if len(sequence) + 2 > TRAINED_TOKENS:
        how = (
            f"it is scored through windows of {window} residues around each scored site (--window)"
            if window and len(sequence) > window
            else "it is scored whole (no --window), beyond the trained length"
        )
        warnings.warn(
            f"{what} has {len(sequence)} residues, longer than the {TRAINED_TOKENS} tokens "
            f"({TRAINED_TOKENS - 2} residues) ESMC was trained on; {how}",
            LongSequenceWarning,
            stacklevel=3,
        )


# --- non-standard residues ---------------------------------------------------------------------


class NonstandardResidueWarning(EsmcMlxWarning):
    """A sequence holding X, B, Z, U or O, which the residue policy skips or keeps."""


KEEP_HINT = "--keep-nonstandard (keep_nonstandard=True) keeps them"


def warn_nonstandard(sequence: str, what: str, skipped: str, offset: int = 1) -> list[int]:
    """The residue policy in one place: the 0-based positions of ``sequence``'s non-standard
    residues (``vocab.NONSTANDARD``), with a warning naming them and saying what ``skipped``
    (what the caller leaves out of its results). The model still reads them as context."""
    positions = nonstandard_positions(sequence)
    if positions:
        warnings.warn(
            f"{what} holds {len(positions)} non-standard residue{'s' if len(positions) > 1 else ''} "
            f"({nonstandard_text(sequence, positions, offset)}; X B Z are ambiguity codes, U O rare residues): "
            f"{skipped}; {KEEP_HINT}",
            NonstandardResidueWarning,
            stacklevel=3,
        )
    return positions


class NonstandardTally:
    """The residue policy for embeddings: counts the sequences whose mean and max pooling leave
    non-standard residues out, for one warning once the input is read (not one per sequence);
    SequenceError for a sequence with nothing else to pool."""

    def __init__(self, keep: bool, pools: Sequence[str]):
        self.active = not keep and bool({"mean", "max"} & set(pools))
        self.count, self.total, self.example = 0, 0, ""

    def add(self, name: str, sequence: str | np.ndarray) -> None:
        """Count ``sequence``: its residues, or their token ids (decoded only when it matters)."""
        self.total += 1
        if not self.active:
            return
        if isinstance(sequence, np.ndarray):
            if not np.isin(sequence, _NONSTANDARD_IDS).any():
                return
            sequence = _TOKENIZER.decode(sequence)
        positions = nonstandard_positions(sequence)
        if not positions:
            return
        if len(positions) == sum(c.isalpha() for c in sequence):
            raise SequenceError(
                f"sequence {name!r} holds only non-standard residues ({sequence[:20]!r}): nothing to pool; {KEEP_HINT}"
            )
        self.count += 1
        if not self.example:
            self.example = f"{name!r}: {nonstandard_text(sequence, positions, limit=3)}"

    def warn(self) -> None:
        if self.count:
            warnings.warn(
                f"{self.count} of {self.total} sequences hold non-standard residues (X B Z U O; {self.example}): "
                f"they are left out of mean and max pooling (per-residue rows keep them); {KEEP_HINT}",
                NonstandardResidueWarning,
                stacklevel=3,
            )


# --- one validator for mutant rows -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A mutant row that cannot be scored: its index, where it came from (``"data.csv, line 7:
    "``) and why."""

    index: int
    where: str
    mutant: str
    reason: str
    error: type = MutationError

    def __str__(self) -> str:
        return f"{self.where}{self.reason}"


SHOWN_REJECTS = 20  # rows an error message lists (the --skip-invalid file holds them all)


def check_mutants(
    mutants: Sequence,
    sequence: str,
    offset: int = 1,
    where: Sequence[str] | None = None,
    *,
    joint_window: int | None | bool = False,
    mutated_sequences: Sequence[str | None] | None = None,
) -> tuple[list[list[Substitution] | None], list[Rejected]]:
    """Every mutant row checked, all of them: the parsed substitutions (None for a rejected row)
    and one ``Rejected`` for each row that is malformed, does not fit ``sequence`` (wild type,
    range, a site twice), spans more than ``joint_window`` residues (given when joint masking
    reads its sites from one window; False: not checked), or whose ``mutated_sequences`` entry
    (when given and not empty) is not the mutant applied to ``sequence``."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise MutationError(f"offset must be an integer (the number of the first residue), got {offset!r}")
    parsed: list[list[Substitution] | None] = []
    rejects: list[Rejected] = []
    for i, mutant in enumerate(mutants):
        prefix = where[i] if where else f"mutant {i + 1}: "
        try:
            subs = parse_mutant(mutant, sequence, offset)
        except MutationError as e:
            parsed.append(None)
            rejects.append(Rejected(i, prefix, str(mutant), str(e)))
            continue
        problem, error = None, MutationError
        if joint_window is not False:
            problem = joint_window_problem(subs, len(sequence), joint_window)
            error = ScoringError
        given = (mutated_sequences[i] or "").strip().upper() if mutated_sequences is not None else ""
        if problem is None and given and given != apply(sequence, subs):
            problem, error = (
                "mutated_sequence does not match the mutant applied to the wild type (wrong --sequence or --offset?)",
                JobError,
            )
        if problem is not None:
            parsed.append(None)
            rejects.append(Rejected(i, prefix, str(mutant), f"{str(mutant).strip()!r}: {problem}", error))
        else:
            parsed.append(subs)
    return parsed, rejects


def rejection_error(rejects: Sequence[Rejected], total: int) -> Exception:
    """One error listing the rejected rows (the first ``SHOWN_REJECTS``), of the first one's class."""
    if len(rejects) == 1:
        return rejects[0].error(str(rejects[0]))
    lines = [f"{len(rejects)} of {total} mutants cannot be scored:"]
    lines += [f"  {r}" for r in rejects[:SHOWN_REJECTS]]
    if len(rejects) > SHOWN_REJECTS:
        lines.append(f"  and {len(rejects) - SHOWN_REJECTS} more")
    return rejects[0].error("\n".join(lines))


class _Jobs:
    """Forward-pass jobs over (windows of) sequences, run together by ``run_jobs``. A job is one
    row of a batch: a sequence with some residues masked. Asking again for a sequence with the
    same residues masked adds the reads to that job: each distinct window is computed once."""

    def __init__(self):
        self.sequences: list[str] = []
        self._sequence: dict[str, int] = {}
        self.seq_index: list[int] = []
        self.masks: list[np.ndarray] = []
        self.reads: list[dict[int, int]] = []  # per job: residue -> its row among the job's reads
        self._job: dict[tuple, int] = {}
        self._asks: list[tuple[int, list[int]]] = []  # per ask: (job, residues read)

    def add(self, sequence: str, masks, reads) -> int:
        """Ask for the rows ``reads`` of ``sequence`` with ``masks`` masked; returns the ask's
        index into what ``run`` returns."""
        k = self._sequence.setdefault(sequence, len(self.sequences))
        if k == len(self.sequences):
            self.sequences.append(sequence)
        key = (k, tuple(sorted(int(m) for m in np.asarray(masks).ravel())))
        j = self._job.setdefault(key, len(self.reads))
        if j == len(self.reads):
            self.seq_index.append(k)
            self.masks.append(np.asarray(key[1], dtype=np.int64))
            self.reads.append({})
        reads = [int(r) for r in np.asarray(reads).ravel()]
        for r in reads:
            self.reads[j].setdefault(r, len(self.reads[j]))
        self._asks.append((j, reads))
        return len(self._asks) - 1

    def site(self, sequence: str, sites, *, masked: bool, window: int | None) -> int:
        """Read the residues ``sites`` (0-based in ``sequence``) masked from the window centred on
        their middle, or one site unmasked from its ``unmasked_window``."""
        sites = np.asarray(sites, dtype=np.int64)
        if not masked and len(sites) == 1:
            start, end = unmasked_window(int(sites[0]), len(sequence), window)
        else:
            start, end = window_bounds(int(sites.min() + sites.max()) // 2, len(sequence), window)
        if sites.min() < start or sites.max() >= end:
            raise ScoringError(
                f"sites {sites.min() + 1}..{sites.max() + 1} span more than the window of {window} "
                "residues; joint masking needs them in one window (raise --window)"
            )
        local = sites - start
        return self.add(sequence[start:end], local if masked else [], local)

    def run(self, model, **kwargs) -> tuple[list[np.ndarray], int]:
        """Each ask's rows, in ask order, and the forward passes run."""
        if not self._asks:
            return [], 0
        reads = [np.fromiter(r, dtype=np.int64, count=len(r)) for r in self.reads]
        rows, passes = run_jobs(model, self.sequences, self.seq_index, self.masks, reads, **kwargs)
        blocks = np.split(rows, np.cumsum([len(r) for r in reads])[:-1])
        return [blocks[j][[self.reads[j][r] for r in residues]] for j, residues in self._asks], passes


def pseudo_perplexity(
    model: ESMC,
    sequences: str | Sequence[str],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    window: int | None = DEFAULT_WINDOW,
    keep_nonstandard: bool = False,
    group=None,
    progress: bool = False,
) -> np.ndarray:
    """exp(-mean_i log p(x_i | x with i masked)) over each sequence's residues: one masked
    copy per residue, masked copies of all sequences share passes, ``batch_size`` a pass
    (a sequence given twice is computed once). A sequence longer than ``window`` residues is
    read through a window centred on each masked residue. Non-standard residues (X B Z U O)
    are left out of the mean, with a warning, unless ``keep_nonstandard``. Returns (N,) float64."""
    sequences = [check_sequence(s, str(i + 1), label="sequence") for i, s in enumerate(as_sequences(sequences))]
    if not sequences:
        return np.zeros(0, np.float64)
    jobs, owner = _Jobs(), []
    for i, s in enumerate(sequences):
        what = f"sequence {i + 1}"
        check_length(s, window, what)
        skip = [] if keep_nonstandard else warn_nonstandard(s, what, "left out of its pseudo-perplexity")
        for p in _residue_positions(s, what, skip):
            jobs.site(s, [p], masked=True, window=window)
            owner.append(i)
    rows, _ = jobs.run(
        model, batch_size=batch_size, targets_only=True, world=World.of(group), progress=progress, desc="pppl"
    )
    logp = np.concatenate(rows).astype(np.float64)
    owner = np.array(owner)
    sums = np.bincount(owner, weights=logp, minlength=len(sequences))
    return np.exp(-sums / np.bincount(owner, minlength=len(sequences)))


# --- variant scores --------------------------------------------------------------------------


def resolve_methods(methods) -> tuple[str, ...]:
    """Scoring methods as a tuple (one name is that method, not its letters), or ScoringError."""
    methods = (methods,) if isinstance(methods, str) else tuple(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ScoringError(f"unknown scoring method {unknown or methods!r}; choose from {', '.join(METHODS)}")
    return methods


@dataclasses.dataclass
class MutationScores:
    """Scores aligned with ``mutants``: ``scores[method]`` is (N,) float64 for each method run,
    NaN for the mutants ``skipped`` (indices: a site at a non-standard residue, see
    ``keep_nonstandard``). ``wt_pppl`` is the wild type's pseudo-perplexity (with method
    ``pppl``); ``passes`` the forward passes this process ran."""

    mutants: list[str]
    scores: dict[str, np.ndarray]
    wt_pppl: float | None = None
    passes: int = 0
    skipped: list[int] = dataclasses.field(default_factory=list)

    def __getitem__(self, method: str) -> np.ndarray:
        return self.scores[method]


def score_mutations(
    model: ESMC,
    sequence: str,
    mutations: Sequence[str],
    *,
    methods: Sequence[str] = ("masked_marginal", "wt_marginal"),
    batch_size: int = DEFAULT_BATCH_SIZE,
    offset: int = 1,
    multi: str = "sum",
    window: int | None = DEFAULT_WINDOW,
    keep_nonstandard: bool = False,
    group=None,
    progress: bool = False,
    where: Sequence[str] | None = None,
) -> MutationScores:
    """Score ProteinGym-style mutant strings (``A23G``, ``A23G:L40P``; 1-based from ``offset``)
    against the wild-type ``sequence``.

    methods: ``masked_marginal`` (sum over sites of log p(mut) - log p(wt), each site masked
    alone; masked copies batched ``batch_size`` a pass), ``wt_marginal`` (the same from
    unmasked passes over the wild type) and ``pppl`` (pseudo-perplexity of each mutated
    sequence, L masked copies each, and of the wild type). Log-probabilities are log_softmax
    over the full logits row.
    ``multi``: ``sum`` adds single-site masked marginals of a multi-mutant; ``joint`` masks
    all its sites together in one copy and sums their log-ratios from that copy.
    ``window``: a sequence longer than this many residues is scored through windows of that
    width: centred on each masked site (on the middle of a joint mutant's sites), and for
    wt-marginal the ``unmasked_window`` tiling; None: never.
    ``keep_nonstandard``: score mutants at X B Z U O too (default: their scores are NaN, listed
    in ``skipped``, with a warning, and pseudo-perplexities leave those residues out).
    Under ``mlx.launch`` pass ``group=mx.distributed.init()`` to split the passes over ranks.
    Raises MutationError (every malformed, mismatched or out-of-range mutant listed at once),
    FastaError (bad characters in ``sequence``), ScoringError (unknown method or multi, joint
    sites beyond a window).
    """
    methods = resolve_methods(methods)
    check_multi_window(multi, window, methods)
    sequence = check_sequence(sequence, "wild type", label="sequence")
    if isinstance(mutations, str):
        mutations = [mutations]
    if not isinstance(mutations, Iterable):
        raise MutationError(f"mutations: expected a list of mutant strings, got {type(mutations).__name__}")
    mutants = list(mutations)
    if where is not None and len(where) != len(mutants):
        raise ScoringError(f"where has {len(where)} entries for {len(mutants)} mutants")
    joint = "masked_marginal" in methods and multi == "joint"
    parsed, rejects = check_mutants(
        mutants, sequence, offset, list(where) if where else None, joint_window=window if joint else False
    )
    if rejects:
        raise rejection_error(rejects, len(mutants))
    check_length(sequence, window, "the wild type")
    skip = set() if keep_nonstandard else set(nonstandard_positions(sequence))
    skipped = [i for i, subs in enumerate(parsed) if any(s.index in skip for s in subs)]
    if skip:
        warn_nonstandard(
            sequence,
            "the wild type",
            f"{len(skipped)} of {len(mutants)} mutants are at them and are not scored (NaN, empty in a CSV)"
            + (", and pseudo-perplexities leave them out" if "pppl" in methods else ""),
            offset,
        )
    scored = sorted(set(range(len(parsed))) - set(skipped))
    result = _score(
        model, sequence, [parsed[i] for i in scored], methods, batch_size, multi, window, sorted(skip), group, progress
    )
    scores = {m: np.full(len(mutants), np.nan) for m in result.scores}
    for m, values in result.scores.items():
        scores[m][scored] = values
    return MutationScores(mutants, scores, result.wt_pppl, result.passes, skipped)


def _score(model, sequence, parsed, methods, batch_size, multi, window, skip, group, progress) -> MutationScores:
    """``score_mutations`` on checked substitutions, none at the positions ``skip``."""
    world = World.of(group)
    tid = _TOKENIZER.token_to_id
    scores: dict[str, np.ndarray] = {}

    # Every pass over the wild type goes into one job list, so they share batches.
    jobs = _Jobs()
    sites = sorted({s.index for subs in parsed for s in subs})
    masked_sites = sites if "masked_marginal" in methods else []
    positions = _residue_positions(sequence, "the wild type", skip) if "pppl" in methods else []
    masked_sites = sorted(set(masked_sites) | {int(p) for p in positions})
    masked_job = {p: jobs.site(sequence, [p], masked=True, window=window) for p in masked_sites}
    joint_job = {}
    if "masked_marginal" in methods and multi == "joint":
        for subs in parsed:
            key = tuple(sorted(s.index for s in subs))
            if len(key) > 1 and key not in joint_job:
                joint_job[key] = jobs.site(sequence, key, masked=True, window=window)
    unmasked_job = {}
    if "wt_marginal" in methods:
        unmasked_job = {p: jobs.site(sequence, [p], masked=False, window=window) for p in sites}
    rows, passes = jobs.run(model, batch_size=batch_size, world=world, progress=progress)

    def ratio(row, s: Substitution) -> float:
        return float(row[tid[s.mut]]) - float(row[tid[s.wt]])

    if "masked_marginal" in methods:
        values = []
        for subs in parsed:
            key = tuple(sorted(s.index for s in subs))
            if key in joint_job:
                block, at = rows[joint_job[key]], {p: k for k, p in enumerate(key)}
                values.append(sum(ratio(block[at[s.index]], s) for s in subs))
            else:
                values.append(sum(ratio(rows[masked_job[s.index]][0], s) for s in subs))
        scores["masked_marginal"] = np.array(values, dtype=np.float64)
    if "wt_marginal" in methods:
        scores["wt_marginal"] = np.array(
            [sum(ratio(rows[unmasked_job[s.index]][0], s) for s in subs) for subs in parsed], dtype=np.float64
        )
    wt_pppl = None
    if "pppl" in methods:
        wt_logp = np.array([rows[masked_job[p]][0, tid[sequence[p]]] for p in positions], dtype=np.float64)
        wt_pppl = float(np.exp(-wt_logp.mean()))
        variants = sorted({apply(sequence, subs) for subs in parsed if subs} - {sequence})
        values = {sequence: wt_pppl}
        if variants:
            more_jobs = _Jobs()
            for v in variants:
                for p in positions:
                    more_jobs.site(v, [p], masked=True, window=window)
            logp, more = more_jobs.run(
                model, batch_size=batch_size, targets_only=True, world=world, progress=progress, desc="pppl"
            )
            means = np.concatenate(logp).astype(np.float64).reshape(len(variants), len(positions)).mean(axis=1)
            passes += more
            values.update(zip(variants, np.exp(-means)))
        scores["pppl"] = np.array([values[apply(sequence, subs)] for subs in parsed])
    return MutationScores([], scores, wt_pppl, passes)


def _token_ids(sequence: str, positions: np.ndarray) -> np.ndarray:
    """Token ids of ``sequence``'s residues at ``positions``."""
    return np.array([_TOKENIZER.token_to_id[sequence[p]] for p in positions], dtype=np.int64)
