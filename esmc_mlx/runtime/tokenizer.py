"""ESMC's 33-token character vocabulary, without torch, transformers or tokenizers.

Ids are those of transformers' ``EsmcTokenizer`` (tests compare them). Written by hand because
the runtime must not depend on transformers, and the vocabulary is a fixed character map.
Differences from ``EsmcTokenizer``, on purpose: lower-case residues are upper-cased (transformers
maps them to ``<unk>``), and any other unknown character raises ``SequenceError`` (alias
``TokenizerError``) naming it and its position instead of silently becoming ``<unk>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import TokenizerError  # re-exported: the tokenizer's error
from ..vocab import AMINO_ACIDS, TOKEN_TO_ID, VOCAB, as_sequences, item_names, split_tokens, write_tokenizer_files  # noqa: F401

# ASCII code -> id of the one-character token it reads as (lower case as upper case, as
# split_tokens does), -1 for any other character and for "<" (which starts <mask> and the
# other special tokens): a plain sequence is encoded with one numpy lookup instead of a Python
# step per residue (~2.7 us a residue), and anything else takes split_tokens and its errors.
_ASCII_IDS = np.array(
    [-1 if chr(b) == "<" else TOKEN_TO_ID.get(chr(b), TOKEN_TO_ID.get(chr(b).upper(), -1)) for b in range(128)],
    dtype=np.int32,
)


class ESMCTokenizer:
    """Turns protein sequences into ESMC token ids.

    >>> tok = ESMCTokenizer()
    >>> tok.encode("MKV")
    [0, 20, 15, 7, 2]
    """

    vocab = VOCAB
    token_to_id = TOKEN_TO_ID
    cls_token_id, pad_token_id, eos_token_id, unk_token_id = 0, 1, 2, 3
    chain_break_token_id = token_to_id["|"]
    mask_token_id = token_to_id["<mask>"]

    def tokenize(self, sequence: str, name: str | None = None) -> list[str]:
        return split_tokens(sequence, name, special_tokens=True)

    def encode(self, sequence: str, add_special_tokens: bool = True, name: str | None = None) -> list[int]:
        return self.encode_array(sequence, add_special_tokens, name).tolist()

    def encode_array(self, sequence: str, add_special_tokens: bool = True, name: str | None = None) -> np.ndarray:
        """``encode`` as an int32 array."""
        ids = None
        if isinstance(sequence, str) and sequence and sequence.isascii():
            ids = _ASCII_IDS[np.frombuffer(sequence.encode("ascii"), dtype=np.uint8)]
            ids = ids if (ids >= 0).all() else None
        if ids is None:
            ids = np.array([self.token_to_id[t] for t in self.tokenize(sequence, name)], dtype=np.int32)
        if add_special_tokens:
            return np.concatenate([[self.cls_token_id], ids, [self.eos_token_id]]).astype(np.int32)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        outside = [i for i in ids if not 0 <= i < len(VOCAB)]
        if outside:  # a negative id would index from the end: a wrong token, not an error
            raise TokenizerError(f"token id {outside[0]} is not in the vocabulary (ids 0..{len(VOCAB) - 1})")
        out = [VOCAB[i] for i in ids]
        if skip_special_tokens:
            out = [t for t in out if t not in ("<cls>", "<pad>", "<eos>")]
        return "".join(out)

    def __call__(
        self,
        sequences: str | Sequence[str],
        return_tensors: str | None = "mlx",
        return_sequence_id: bool = False,
        names: Sequence[str] | None = None,
    ) -> dict:
        """Batch-encode with ``<cls>``/``<eos>`` and right padding.

        Returns ``input_ids`` and ``attention_mask`` (and ``sequence_id`` when asked: chain index,
        counting ``|`` breaks, -1 on padding; a ``|`` token belongs to the chain it closes) as
        ``mx.array`` (``return_tensors="mlx"``), ``np.ndarray`` (``"np"``) or lists (``None``).
        """
        sequences = as_sequences(sequences)
        if names is not None and len(names) != len(sequences):
            raise TokenizerError(f"names: {len(names)} names for {len(sequences)} sequences")
        names = item_names(sequences, names)
        encoded = [self.encode(s, name=names[i] if names else None) for i, s in enumerate(sequences)]
        return self.pad(encoded, return_tensors, return_sequence_id)

    def pad(
        self,
        encoded: Sequence[Sequence[int]],
        return_tensors: str | None = "mlx",
        return_sequence_id: bool = False,
        pad_to_multiple_of: int | None = None,
    ) -> dict:
        """Right-pad already encoded rows into a batch; the same outputs as ``__call__``.
        ``pad_to_multiple_of``: widen the batch to a multiple of this many tokens."""
        if return_tensors not in ("mlx", "np", None):  # e.g. "pt": it would get numpy arrays
            raise TokenizerError(f"return_tensors {return_tensors!r}: choose 'mlx', 'np' or None (lists)")
        if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool) or pad_to_multiple_of < 0):
            raise TokenizerError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
        width = max((len(e) for e in encoded), default=0)
        if pad_to_multiple_of:
            width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        ids = np.full((len(encoded), width), self.pad_token_id, dtype=np.int32)
        mask = np.zeros((len(encoded), width), dtype=np.int32)
        for row, e in enumerate(encoded):
            ids[row, : len(e)] = e
            mask[row, : len(e)] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if return_sequence_id:
            breaks = np.cumsum(ids == self.chain_break_token_id, axis=1)
            chain = breaks - (ids == self.chain_break_token_id)
            batch["sequence_id"] = np.where(mask == 1, chain, -1).astype(np.int32)
        if return_tensors == "mlx":
            import mlx.core as mx

            return {k: mx.array(v) for k, v in batch.items()}
        if return_tensors is None:
            return {k: v.tolist() for k, v in batch.items()}
        return batch

    def save_pretrained(self, directory: str | Path) -> list[Path]:
        """Write tokenizer.json and tokenizer_config.json (loadable by ``AutoTokenizer``)."""
        return write_tokenizer_files(directory)
