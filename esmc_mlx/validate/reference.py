"""The torch reference: transformers' ``EsmcForMaskedLM``, whole or one layer at a time.

``full``: the model is built on the meta device, the weights are assigned (no random init, no
copy), and its own ``forward`` runs. ``layered``: transformers' modules run in the same order
as ``EsmcModel.forward`` (embedding, ``EsmcRotaryEmbedding``, the mask from
``create_bidirectional_mask``, each ``EsmcLayer``, ``EsmcLayerNorm``, ``EsmcMaskedLMHead``),
but only one layer's weights exist at a time: every batch passes through layer i before layer
i+1 is read. A test checks that both give the same logits to ~1e-6.

Both run in fp32 on the CPU with the ``sdpa`` attention that ``from_pretrained`` picks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ..config import ESMCConfig
from .panel import Batch


@dataclasses.dataclass
class Outputs:
    """Per input row (unpadded): logits (L, vocab) and last hidden state (L, d), fp32 numpy."""

    logits: list[np.ndarray]
    hidden: list[np.ndarray]


def hf_config(config: ESMCConfig):
    """transformers' EsmcConfig for ``config``, with sdpa attention."""
    from transformers import EsmcConfig

    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    cfg = EsmcConfig(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def collect(outputs: dict[int, tuple], n: int) -> Outputs:
    return Outputs([outputs[i][0] for i in range(n)], [outputs[i][1] for i in range(n)])


def unpad(batch: Batch, logits: np.ndarray, hidden: np.ndarray, sink: dict) -> None:
    """Store each row of a padded batch's fp32 outputs, cut to its length, under its input index."""
    lengths = batch.attention_mask.sum(axis=1)
    for r, row in enumerate(batch.rows):
        sink[row] = (logits[r, : lengths[r]].copy(), hidden[r, : lengths[r]].copy())


def _unpad(batch: Batch, logits, hidden, sink: dict) -> None:
    unpad(batch, logits.float().numpy(), hidden.float().numpy(), sink)


def _tensors(batch: Batch):
    import torch

    ids = torch.from_numpy(batch.input_ids.astype(np.int64))
    am = torch.from_numpy(batch.attention_mask.astype(np.int64))
    sid = None if batch.sequence_id is None else torch.from_numpy(batch.sequence_id.astype(np.int64))
    return ids, am, sid


def run_full(get: Callable[[list[str]], dict], config: ESMCConfig, batches: list[Batch], n_inputs: int,
             names: list[str], on_step: Callable[[], None] | None = None) -> Outputs:
    """transformers' EsmcForMaskedLM as a whole, with the weights ``get(names)`` returns."""
    import torch
    from transformers import EsmcForMaskedLM
    from transformers.models.esmc.modeling_esmc import EsmcRotaryEmbedding

    cfg = hf_config(config)
    with torch.device("meta"):
        model = EsmcForMaskedLM(cfg)
    model.load_state_dict(get(names), strict=True, assign=True)
    model.esmc.rotary_emb = EsmcRotaryEmbedding(cfg)  # its buffers are not in the state dict
    model.eval()
    sink: dict[int, tuple] = {}
    with torch.inference_mode():
        for batch in batches:
            ids, am, sid = _tensors(batch)
            kw = {"sequence_id": sid} if sid is not None else {"attention_mask": am}
            out = model(input_ids=ids, output_hidden_states=True, **kw)
            _unpad(batch, out.logits, out.hidden_states[-1], sink)
            if on_step:
                on_step()
    del model
    return collect(sink, n_inputs)


def run_layered(get: Callable[[list[str]], dict], config: ESMCConfig, batches: list[Batch], n_inputs: int,
                names: list[str], on_step: Callable[[], None] | None = None) -> Outputs:
    """The same computation as ``EsmcForMaskedLM.forward``, one layer's weights in memory at a time."""
    import torch
    import torch.nn.functional as F
    from transformers.masking_utils import create_bidirectional_mask, packed_sequence_mask_function
    from transformers.models.esmc.modeling_esmc import (EsmcLayer, EsmcLayerNorm, EsmcMaskedLMHead,
                                                        EsmcRotaryEmbedding)

    cfg = hf_config(config)
    rotary = EsmcRotaryEmbedding(cfg)

    def load(module_factory, prefix: str):
        with torch.device("meta"):
            module = module_factory()
        state = get([n for n in names if n.startswith(prefix)])
        module.load_state_dict({n[len(prefix):]: t for n, t in state.items()}, strict=True, assign=True)
        return module.eval()

    with torch.inference_mode():
        embed = get(["esmc.embed_tokens.weight"])["esmc.embed_tokens.weight"]
        states, masks, rope = [], [], []
        for batch in batches:
            ids, am, sid = _tensors(batch)
            h = F.embedding(ids, embed)
            position_ids = torch.arange(h.shape[1]).unsqueeze(0)
            rope.append(rotary(h, position_ids))
            if sid is not None:
                mask = create_bidirectional_mask(config=cfg, inputs_embeds=h, attention_mask=None,
                                                 and_mask_function=packed_sequence_mask_function(sid))
            else:
                mask = create_bidirectional_mask(config=cfg, inputs_embeds=h, attention_mask=am)
            states.append(h)
            masks.append(mask)
        del embed
        for i in range(config.num_hidden_layers):
            layer = load(lambda: EsmcLayer(cfg, layer_idx=i), f"esmc.layers.{i}.")
            for b in range(len(batches)):
                states[b] = layer(states[b], masks[b], position_embeddings=rope[b])
            del layer
            if on_step:
                on_step()
        norm = load(lambda: EsmcLayerNorm(cfg.hidden_size, bias=False), "esmc.norm.")
        head = load(lambda: EsmcMaskedLMHead(cfg.hidden_size, cfg.vocab_size), "lm_head.")
        sink: dict[int, tuple] = {}
        for b, batch in enumerate(batches):
            hidden = norm(states[b])
            _unpad(batch, head(hidden), hidden, sink)
            states[b] = None
    return collect(sink, n_inputs)


def fp32_bytes(config: ESMCConfig) -> int:
    return 4 * config.num_parameters
