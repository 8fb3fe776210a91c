"""ESMFold2's language-model input: the ESMC backbone's hidden states of every layer.

The reference runs ESMC once over ``<cls> chain1 <eos> <cls> chain2 ... <eos>`` (each chain
wrapped as ESMC saw single sequences in training; chains kept apart by ``sequence_id`` when
there are several) and stacks the embedding output and every block's output. The backbone is
the ESMC runtime itself, quantized layers and all.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..model import ESMC
from ..tokenizer import ESMCTokenizer


def lm_layout(asym_id: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For one complex's tokens (chains contiguous, numbered by ``asym_id`` in order): where
    each token sits in the backbone's input, where its ``<cls>``/``<eos>`` go, and the chain
    index of every backbone position (``sequence_id``). One token is one residue (protein
    chains of standard residues: no atom-tokenized modifications to collapse)."""
    asym_id = np.asarray(asym_id)
    chains = np.unique(asym_id)
    chain_of = np.searchsorted(chains, asym_id)
    if np.any(np.diff(chain_of) < 0):
        raise ValueError("chains must be contiguous and in asym_id order")
    positions = np.arange(len(asym_id)) + 1 + 2 * chain_of  # one <cls> before, <eos><cls> between chains
    total = len(asym_id) + 2 * len(chains)
    sequence_id = np.zeros(total, dtype=np.int64)
    for i in range(len(chains)):
        members = positions[chain_of == i]
        sequence_id[members[0] - 1 : members[-1] + 2] = i
    return positions, sequence_id, chains


def lm_hidden_states(esmc: ESMC, input_ids: np.ndarray, asym_id: np.ndarray) -> mx.array:
    """``(1, L, n_layers + 1, d)``: ESMC's hidden states (embeddings, then each block) at each of
    one complex's ``L`` tokens (``input_ids`` in ESMC's vocabulary, ``asym_id`` its chain ids)."""
    positions, sequence_id, chains = lm_layout(asym_id)
    ids = np.full(len(sequence_id), ESMCTokenizer.eos_token_id, dtype=np.int64)
    ids[positions] = np.asarray(input_ids)
    starts = np.concatenate([[0], positions[np.flatnonzero(np.diff(asym_id)) + 1] - 1])
    ids[starts] = ESMCTokenizer.cls_token_id
    # One chain: no mask at all (the fused attention); several: attention within each chain only.
    chain_ids = mx.array(sequence_id[None]) if len(chains) > 1 else None
    ids, mask = esmc.inputs(mx.array(ids[None]), sequence_id=chain_ids)
    out = esmc.forward(ids, mask, output_hidden_states=True, chunk=esmc.chunk_for(ids))
    stacked = mx.stack(out.hidden_states, axis=2)  # (1, T, n + 1, d)
    return stacked[:, mx.array(positions)]
