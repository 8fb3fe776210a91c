"""Sparse autoencoder features of ESMC's hidden states (``ProteinModel.sae_features``).

Which hidden state an SAE reads is the ``esm`` package's choice (3.4, ``EsmcModel._get_sae_outputs``):
layer N is ``hidden_states[N]`` (0 = token embeddings, N = the input of block N + 1, n_layers =
after the final norm); an SAE trained on residual updates
(``use_residual_update_instead_of_states``) reads ``hidden_states[N] - hidden_states[N - 1]``
(layer 0 stays the state itself). Every token is encoded, ``<cls>`` and ``<eos>`` included
(padding is dropped); inputs holding ``<mask>`` are refused (the SAEs were trained on unmasked sequences).

One forward per batch serves every (SAE, layer) asked for, and stops at the deepest hidden state
they need (``ESMC.hidden_states_at``). Batches are bucketed by length as ``embed``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np

from ..errors import ScoringError, SequenceError
from ..runtime.model import ESMC
from ..runtime.sae import SparseAutoencoder
from ..vocab import as_sequences, item_names
from .scoring import (
    _TOKENIZER,
    PAD_MULTIPLE,
    _pack,
    _progress,
    default_batch_tokens,
    encode,
    length_batches,
    one_batch_ahead,
)


@dataclasses.dataclass
class SAEFeatures:
    """One sequence's features from one SAE at one layer: the ``k`` active features of each
    token (``<cls>``, the residues, ``<eos>``), largest first. ``indices`` (T, k) int32 and
    ``values`` (T, k) float32; ``dense()`` scatters them into (T, codebook_dim)."""

    indices: np.ndarray
    values: np.ndarray
    codebook_dim: int
    layer: int
    sae: str

    def dense(self) -> np.ndarray:
        out = np.zeros((len(self.indices), self.codebook_dim), np.float32)
        np.put_along_axis(out, self.indices.astype(np.int64), self.values, axis=1)
        return out


@dataclasses.dataclass(frozen=True)
class Probe:
    """One SAE at one backbone layer, and the hidden states it reads."""

    sae: SparseAutoencoder
    layer: int

    @property
    def residual(self) -> bool:
        return self.sae.config.use_residual_update_instead_of_states and self.layer > 0

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.layer, self.layer - 1) if self.residual else (self.layer,)


def probes(model: ESMC, saes, layer=None) -> list[Probe]:
    """Every (SAE, layer) pair of ``saes`` (one SAE or several) and ``layer`` (an int or several;
    default: each SAE's only layer). ScoringError for a layer an SAE lacks or the model does not
    have, or an SAE of another width than the model's hidden states."""
    saes = [saes] if isinstance(saes, SparseAutoencoder) else list(saes)
    if not saes or not all(isinstance(s, SparseAutoencoder) for s in saes):
        raise ScoringError("sae: give a SparseAutoencoder from esmc_mlx.load_sae (or a list of them)")
    n, d = model.config.num_hidden_layers, model.config.hidden_size
    out = []
    for sae in saes:
        if sae.config.d_model != d:
            raise ScoringError(
                f"{sae.name} reads hidden states of width {sae.config.d_model}; this model's are {d} wide "
                "(an SAE belongs to one backbone: ESMC-6B is 2560, 600M 1152, 300M 960)"
            )
        if layer is None:
            if len(sae.config.available_layers) != 1:
                raise ScoringError(
                    f"{sae.name} holds SAEs for layers {', '.join(map(str, sae.config.available_layers))}: "
                    "say which (layer=N in Python, --layer N on the command line; several are allowed)"
                )
            layers = list(sae.config.available_layers)
        else:
            layers = [layer] if isinstance(layer, (int, np.integer)) else list(layer)
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i <= n:
                raise ScoringError(f"layer {i!r}: this model has hidden states 0..{n}")
            out.append(Probe(sae, sae.check_layer(int(i))))
    return out


def check_unmasked(encoded: Sequence[np.ndarray], labels: Sequence[str]) -> None:
    """SequenceError naming (``labels``) the first sequence holding ``<mask>``: SAEs read
    unmasked inputs."""
    for where, ids in zip(labels, encoded):
        if (ids == _TOKENIZER.mask_token_id).any():
            raise SequenceError(
                f"{where}: holds <mask>; SAE features are defined on unmasked sequences (esm refuses them too)"
            )


def iter_sae_features(
    model: ESMC, encoded: list[np.ndarray], batches: Sequence[Sequence[int]], plan: Sequence[Probe], normalize: bool
) -> Iterator[tuple[np.ndarray, list[list[tuple[np.ndarray, np.ndarray]]]]]:
    """For each batch of indices into ``encoded`` (token ids with <cls>/<eos>): the indices and,
    per probe of ``plan``, per sequence, (indices (T, k) int32, values (T, k) float32). The next
    batch is queued before this one is copied to host memory."""
    reads = sorted({i for p in plan for i in p.reads})
    for p in plan:
        p.sae.layer(p.layer)  # read every SAE before the first forward

    def start(rows):
        rows = np.asarray(rows)
        ids, attn, sid = _pack(encoded, rows, pad_to_multiple_of=PAD_MULTIPLE)
        states = model.hidden_states_at(
            ids, reads, None if attn is None else mx.array(attn), None if sid is None else mx.array(sid)
        )
        tokens = np.array([len(encoded[r]) for r in rows])
        B, L = ids.shape
        real = (np.arange(L)[None, :] < tokens[:, None]).reshape(-1)
        lazy = []
        for p in plan:
            h = states[p.layer].astype(mx.float32)
            if p.residual:
                h = h - states[p.layer - 1].astype(mx.float32)
            # padding rows too, dropped on the host: the encoder then sees the forward's few
            # shapes, not a new row count every batch
            lazy.append(p.sae.layer(p.layer).encode(h.reshape(B * L, -1), normalize))
        return rows, tokens, real, lazy

    def finish(rows, tokens, real, lazy):
        cuts = np.cumsum(tokens)[:-1]
        out = []
        for top, vals in lazy:
            top, vals = np.array(top)[real], np.array(vals)[real]
            out.append(list(zip(np.split(top, cuts), np.split(vals, cuts))))
        return rows, out

    yield from one_batch_ahead(batches, start, finish)


def sae_features(
    model: ESMC,
    sequences: str | Sequence[str],
    sae,
    *,
    layer=None,
    normalize: bool = False,
    batch_tokens: int | None = None,
    tokenizer=None,
    progress: bool = False,
):
    """SAE features of every token of ``sequences`` (<cls> and <eos> included), as esm 3.4's
    ``EsmcForMaskedLM(..., normalize_sae=...).sae_outputs`` gives them, from one forward pass per
    batch that stops at the deepest hidden state needed.

    ``sae``: an SAE from ``load_sae``, or several; ``layer``: the backbone hidden state (an int,
    or several; default: the SAE's only layer). ``normalize``: scale each feature by idf / max.
    Returns one ``SAEFeatures`` per sequence for one SAE at one layer; else a dict
    ``{(sae.name, layer): [SAEFeatures per sequence]}``. Sequences are batched by length, at most
    ``batch_tokens`` padded tokens a pass. Raises SequenceError for sequences ESMC cannot read
    or that hold <mask>, ScoringError for a layer the SAE or the model lacks."""
    sequences = as_sequences(sequences)
    plan = probes(model, sae, layer)
    encoded = encode(sequences, tokenizer)
    names = item_names(sequences, None)
    check_unmasked(encoded, [f"sequence {n}" for n in names] if names else ["the sequence"])
    single = isinstance(sae, SparseAutoencoder) and (layer is None or isinstance(layer, (int, np.integer)))
    keys = [(p.sae.name, p.layer) for p in plan]
    if len(set(keys)) < len(keys):
        raise ScoringError("two SAEs of the same name at one layer: their results would mix")
    if batch_tokens is None:
        batch_tokens = default_batch_tokens()
    batches = length_batches([len(e) for e in encoded], batch_tokens, PAD_MULTIPLE)
    results: list[list] = [[None] * len(encoded) for _ in plan]
    with _progress(len(encoded), "seq", "features", progress) as bar:
        for rows, per_probe in iter_sae_features(model, encoded, batches, plan, normalize):
            for p, (probe, got) in enumerate(zip(plan, per_probe)):
                for r, (top, vals) in zip(rows, got):
                    results[p][r] = SAEFeatures(top, vals, probe.sae.config.codebook_dim, probe.layer, probe.sae.name)
            bar.update(len(rows))
    return results[0] if single else dict(zip(keys, results))
