"""ESMC's 33-token character vocabulary, without torch, transformers or tokenizers.

Ids are those of transformers' ``EsmcTokenizer`` (tests compare them). Written by hand because
the runtime must not depend on transformers, and the vocabulary is a fixed character map.
Differences from ``EsmcTokenizer``, on purpose: lower-case residues are upper-cased (transformers
maps them to ``<unk>``), and any other unknown character raises ``TokenizerError`` naming it
and its position instead of silently becoming ``<unk>``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

VOCAB = (
    "<cls>", "<pad>", "<eos>", "<unk>",
    "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q", "N", "F", "Y", "M", "H", "W", "C",
    "X", "B", "U", "Z", "O",  # ambiguity codes and the rare residues
    ".", "-", "|",  # gap, insertion, chain break
    "<mask>",
)
SPECIAL_TOKENS = ("<cls>", "<pad>", "<eos>", "<unk>", "|", "<mask>")
AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"  # the 20 standard residues, in vocabulary order
_TOKEN_RE = re.compile(r"<[a-z]+>|.", re.DOTALL)


class TokenizerError(ValueError):
    """A sequence holds characters outside ESMC's vocabulary."""


class ESMCTokenizer:
    """Turns protein sequences into ESMC token ids.

    >>> tok = ESMCTokenizer()
    >>> tok.encode("MKV")
    [0, 20, 15, 7, 2]
    """

    vocab = VOCAB
    token_to_id = {t: i for i, t in enumerate(VOCAB)}
    cls_token_id, pad_token_id, eos_token_id, unk_token_id = 0, 1, 2, 3
    chain_break_token_id = token_to_id["|"]
    mask_token_id = token_to_id["<mask>"]

    def tokenize(self, sequence: str, name: str | None = None) -> list[str]:
        tokens, bad = [], []
        for match in _TOKEN_RE.finditer(sequence):
            token = match.group()
            if token not in self.token_to_id and token.upper() in self.token_to_id and len(token) == 1:
                token = token.upper()
            if token not in self.token_to_id:
                bad.append(f"{token!r} at position {match.start() + 1}")
            tokens.append(token)
        if bad:
            where = f"sequence {name!r}" if name else "sequence"
            shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            raise TokenizerError(
                f"{where} has characters outside the ESMC vocabulary: {shown}. "
                f"Allowed: the 20 amino acids, X B Z U O, '.', '-', '|' (chain break), <mask>."
            )
        return tokens

    def encode(self, sequence: str, add_special_tokens: bool = True, name: str | None = None) -> list[int]:
        ids = [self.token_to_id[t] for t in self.tokenize(sequence, name)]
        return [self.cls_token_id, *ids, self.eos_token_id] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out = [VOCAB[int(i)] for i in ids]
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
        if isinstance(sequences, str):
            sequences = [sequences]
        encoded = [self.encode(s, name=names[i] if names else None) for i, s in enumerate(sequences)]
        return self.pad(encoded, return_tensors, return_sequence_id)

    def pad(self, encoded: Sequence[Sequence[int]], return_tensors: str | None = "mlx",
            return_sequence_id: bool = False) -> dict:
        """Right-pad already encoded rows into a batch; the same outputs as ``__call__``."""
        width = max(len(e) for e in encoded)
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

    # --- files that transformers' AutoTokenizer loads -------------------------------------
    def save_pretrained(self, directory: str | Path) -> list[Path]:
        """Write tokenizer.json and tokenizer_config.json (loadable by ``AutoTokenizer``)."""
        directory = Path(directory)
        specials = [
            {"id": self.token_to_id[t], "content": t, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for t in SPECIAL_TOKENS
        ]
        tokenizer_json = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": specials,
            "normalizer": None,
            "pre_tokenizer": None,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<cls>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {t: {"id": t, "ids": [self.token_to_id[t]], "tokens": [t]}
                                   for t in ("<cls>", "<eos>")},
            },
            "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": dict(self.token_to_id), "merges": []},
        }
        config = {
            "tokenizer_class": "EsmcTokenizer",
            "backend": "tokenizers",
            "bos_token": "<cls>", "cls_token": "<cls>", "eos_token": "<eos>", "pad_token": "<pad>",
            "unk_token": "<unk>", "mask_token": "<mask>", "chain_break_token": "|",
            "extra_special_tokens": [],
            "model_max_length": 1000000000000000019884624838656,
        }
        paths = [directory / "tokenizer.json", directory / "tokenizer_config.json"]
        for path, payload in zip(paths, (tokenizer_json, config)):
            path.write_text(json.dumps(payload, indent=2) + "\n")
        return paths
