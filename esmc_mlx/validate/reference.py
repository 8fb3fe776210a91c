"""The torch reference: transformers' ``EsmcForMaskedLM``, whole or one layer at a time.

``full``: the model is built on the meta device, the weights are assigned (no random init, no
copy) and its own ``forward`` runs. ``layered``: transformers' modules run in the same order
as ``EsmcModel.forward`` (embedding, ``EsmcRotaryEmbedding``, the mask from
``create_bidirectional_mask``, each ``EsmcLayer``, ``EsmcLayerNorm``, ``EsmcMaskedLMHead``),
but only one layer's weights exist at a time: every batch passes through layer i before layer
i+1 is read. ``layered_steps`` is that loop as a generator (one step per layer), so that
several passes (MLX, torch on the artifact, torch on the original) advance in one sweep over
the layers. A test checks that both give the same logits to ~1e-6.

Both run in fp32 on ``device`` (``pick_device``: CUDA with TF32 off, else MPS, else the CPU)
with the ``sdpa`` attention that ``from_pretrained`` picks; weights are moved there one layer
at a time, so the host never holds more than a layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import numpy as np

from ..config import ESMCConfig
from ..errors import ValidationError
from .panel import Batch


@dataclasses.dataclass
class Outputs:
    """Per input row (unpadded): logits (L, vocab) and last hidden state (L, d), fp32 numpy."""

    logits: list[np.ndarray]
    hidden: list[np.ndarray]


DEVICES = ("auto", "cpu", "cuda", "mps")


def pick_device(name: str = "auto"):
    """The torch device of the reference: ``auto`` is CUDA when present, else MPS (Apple
    Silicon), else the CPU. On CUDA, TF32 is switched off for matmuls and convolutions: the
    reference computes in true fp32. Raises ValidationError for an unknown or absent device."""
    import torch

    if name not in DEVICES:
        raise ValidationError(f"reference device {name!r}: choose one of {', '.join(DEVICES)}")
    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        name = "cuda" if cuda else "mps" if mps else "cpu"
    if (name == "cuda" and not cuda) or (name == "mps" and not mps):
        raise ValidationError(f"--reference-device {name}: torch {torch.__version__} sees no {name.upper()} device")
    if name == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # An explicit index: MLX's CUDA backend sets the thread's current device as it sets up
        # each GPU it sees (on a 2-GPU host, plain "cuda" meant cuda:0 before MLX's pass and
        # cuda:1 after it, and the reference failed with tensors on two devices). MLX runs on
        # GPU 0 of the visible ones; so does the reference.
        return torch.device("cuda", 0)
    return torch.device(name)


@contextlib.contextmanager
def cpu_threads(device, own_load: float = 0.0):
    """torch's intra-op threads for a CPU reference: its default, but no more than the cores
    the other jobs leave idle (the 1-minute load average less ``own_load``, this process's own
    busy threads), restored afterwards. Measured on a 2-core host at load 7-10: a 2-thread pass
    over the panel 7-14x slower than a 1-thread one (OpenMP threads spinning against the other
    jobs); an idle machine keeps the default."""
    import torch

    if torch.device(device).type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    try:
        idle = (os.cpu_count() or 1) - max(0.0, os.getloadavg()[0] - own_load)
    except OSError:  # no load average on this platform
        idle = before
    threads = max(1, min(before, int(idle)))
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def describe_device(device) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)}, fp32, TF32 off)"
    return f"{device.type} (fp32)"


def device_memory(device) -> int | None:
    """Bytes of memory of a CUDA device (None elsewhere: MPS and the CPU share the host's RAM)."""
    import torch

    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


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
    unpad(batch, logits.float().cpu().numpy(), hidden.float().cpu().numpy(), sink)


def _tensors(batch: Batch, device="cpu"):
    import torch

    ids = torch.from_numpy(batch.input_ids.astype(np.int64)).to(device)
    am = torch.from_numpy(batch.attention_mask.astype(np.int64)).to(device)
    sid = None if batch.sequence_id is None else torch.from_numpy(batch.sequence_id.astype(np.int64)).to(device)
    return ids, am, sid


def _by_layer(names: list[str]) -> list[list[str]]:
    """``names`` in groups of one layer (then the rest): how weights travel to the device."""
    groups: dict[str, list[str]] = {}
    for n in names:
        key = ".".join(n.split(".")[:3]) if n.startswith("esmc.layers.") else ""
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def run_full(
    get: Callable[..., dict],
    config: ESMCConfig,
    batches: list[Batch],
    n_inputs: int,
    names: list[str],
    on_step: Callable[[], None] | None = None,
    device=None,
) -> Outputs:
    """transformers' EsmcForMaskedLM as a whole on ``device`` (default: the CPU), with the
    weights ``get(names, device)`` returns, fetched one layer at a time."""
    import torch
    from transformers import EsmcForMaskedLM
    from transformers.models.esmc.modeling_esmc import EsmcRotaryEmbedding

    device = torch.device(device or "cpu")
    cfg = hf_config(config)
    with torch.device("meta"):
        model = EsmcForMaskedLM(cfg)
    state: dict = {}
    for group in _by_layer(names):
        state.update(get(group, device))
    model.load_state_dict(state, strict=True, assign=True)
    del state
    with torch.device(device):
        model.esmc.rotary_emb = EsmcRotaryEmbedding(cfg)  # its buffers are not in the state dict
    model.eval()
    sink: dict[int, tuple] = {}
    with torch.inference_mode():
        for batch in batches:
            ids, am, sid = _tensors(batch, device)
            kw = {"sequence_id": sid} if sid is not None else {"attention_mask": am}
            out = model(input_ids=ids, output_hidden_states=True, **kw)
            _unpad(batch, out.logits, out.hidden_states[-1], sink)
            if on_step:
                on_step()
    del model
    return collect(sink, n_inputs)


def run_layered(
    get: Callable[..., dict],
    config: ESMCConfig,
    batches: list[Batch],
    n_inputs: int,
    names: list[str],
    on_step: Callable[[], None] | None = None,
    device=None,
) -> Outputs:
    """The same computation as ``EsmcForMaskedLM.forward``, one layer's weights in memory at a time."""
    return drain(layered_steps(get, config, batches, n_inputs, names, device), on_step)


def drain(steps, on_step: Callable[[], None] | None = None):
    """Run a ``*_steps`` generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if on_step:
            on_step()


def layered_steps(
    get: Callable[..., dict], config: ESMCConfig, batches: list[Batch], n_inputs: int, names: list[str], device=None
):
    """``run_layered`` as a generator: yields after the embedding and after each layer
    (``num_hidden_layers + 1`` steps), returns the Outputs."""
    import torch
    import torch.nn.functional as F
    from transformers.masking_utils import create_bidirectional_mask, packed_sequence_mask_function
    from transformers.models.esmc.modeling_esmc import EsmcLayer, EsmcLayerNorm, EsmcMaskedLMHead, EsmcRotaryEmbedding

    device = torch.device(device or "cpu")
    cfg = hf_config(config)
    with torch.device(device):
        rotary = EsmcRotaryEmbedding(cfg)

    def load(module_factory, prefix: str):
        with torch.device("meta"):
            module = module_factory()
        state = get([n for n in names if n.startswith(prefix)], device)
        module.load_state_dict({n[len(prefix) :]: t for n, t in state.items()}, strict=True, assign=True)
        return module.eval()

    with torch.inference_mode():
        embed = get(["esmc.embed_tokens.weight"], device)["esmc.embed_tokens.weight"]
        states, masks, rope = [], [], []
        for batch in batches:
            ids, am, sid = _tensors(batch, device)
            h = F.embedding(ids, embed)
            position_ids = torch.arange(h.shape[1], device=device).unsqueeze(0)
            rope.append(rotary(h, position_ids))
            if sid is not None:
                mask = create_bidirectional_mask(
                    config=cfg,
                    inputs_embeds=h,
                    attention_mask=None,
                    and_mask_function=packed_sequence_mask_function(sid),
                )
            else:
                mask = create_bidirectional_mask(config=cfg, inputs_embeds=h, attention_mask=am)
            states.append(h)
            masks.append(mask)
        del embed
    yield
    for i in range(config.num_hidden_layers):
        with torch.inference_mode():
            layer = load(lambda i=i: EsmcLayer(cfg, layer_idx=i), f"esmc.layers.{i}.")
            for b in range(len(batches)):
                states[b] = layer(states[b], masks[b], position_embeddings=rope[b])
            del layer
        yield
    with torch.inference_mode():
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
