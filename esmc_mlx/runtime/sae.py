"""ESMC's sparse autoencoders (SAEs) in MLX: ``load_sae`` and the encoder.

The semantics are the ``esm`` package's (``EsmcSaeLayer`` in ``esm/models/esmc/sae.py``, 3.4):
each token's hidden state ``x`` (d_model wide) is z-scored over its features (the mean removed,
then divided by the sample standard deviation (Bessel's n - 1) plus 1e-5), the decoder bias
``b_dec`` is subtracted, and the features are ``relu((x - b_dec) @ W_enc)`` with all but the
``k`` largest set to zero. ``normalize`` scales each feature by ``idf / max`` (its inverse
document frequency over its maximum activation). Which hidden state, and the residual-update
variant, is the caller's choice (``tasks.sae``).

Layers are read on demand, one ``layer_{i}.safetensors`` at a time: a 6B SAE repo holds tens of
GB, of which a run needs one or two layers. Only the encoder's tensors are kept in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..artifact import check_finite, load_safetensors
from ..errors import ConfigError, ScoringError
from ..hashes import file_hashes
from ..resolve import SAE_ALIASES, download_checkpoint, download_file
from ..sae_artifact import CONFIG_NAME, SAEConfig, check_layer_file, layer_file, read_sae_config
from .load import compute_dtype

EPS = 1e-5  # added to the standard deviation (not the variance), as esm does
# Rows of hidden states encoded at a time: the pre-activations (rows x codebook_dim, float32)
# stay under this many bytes whatever the batch (a batch of 16,384 tokens at codebook 65,536
# would otherwise hold 4 GiB of them).
ENCODE_BYTES = 256 << 20
# Columns per group in ``top_k``'s first pass.
TOP_K_GROUP = 16


def zscore(x: mx.array) -> mx.array:
    """Each row centred and divided by its sample standard deviation + EPS, in float32."""
    x = x.astype(mx.float32)
    x = x - x.mean(axis=-1, keepdims=True)
    std = mx.sqrt((x * x).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))
    return x / (std + EPS)


def top_k(x: mx.array, k: int) -> mx.array:
    """Indices of the ``k`` largest entries of each row of ``x`` (N, C), unordered.

    Partitioning every row across all C columns is the features job's dearest step. Instead the
    row is cut into groups of ``TOP_K_GROUP`` columns and only the k groups with the largest
    maxima are searched: every entry above the k-th largest group maximum lies in one of them, so
    the values found are exactly the k largest (at ties, which index is found may differ)."""
    n, c = x.shape
    g = TOP_K_GROUP
    if c % g or c // g <= k:
        return mx.argpartition(x, kth=c - k, axis=-1)[:, -k:]
    groups = x.reshape(n, c // g, g)
    best = mx.argpartition(groups.max(axis=-1), kth=c // g - k, axis=-1)[:, -k:]
    candidates = mx.take_along_axis(groups, best[..., None], axis=1).reshape(n, k * g)
    inner = mx.argpartition(candidates, kth=k * g - k, axis=-1)[:, -k:]
    return mx.take_along_axis(best, inner // g, axis=-1) * g + inner % g


class SAELayer:
    """One backbone layer's SAE: the encoder's matrix (float or 8-bit), ``b_dec``, ``idf``, ``max``."""

    def __init__(
        self,
        config: SAEConfig,
        layer: int,
        tensors: dict[str, mx.array],
        dtype: mx.Dtype | None = None,
        where: str = "the SAE",
    ):
        self.config, self.layer = config, layer
        self.b_dec, self.idf, self.max = (tensors[n].astype(mx.float32) for n in ("b_dec", "idf", "max"))
        q = config.quantization
        if q:
            self.w_enc = tensors["W_enc.weight"]
            self.scales, self.biases = tensors["W_enc.scales"], tensors["W_enc.biases"]
            self.group_size, self.bits = q["group_size"], q["bits"]
        else:
            w = tensors["W_enc"]
            self.w_enc = w if dtype is None else w.astype(dtype)
            if dtype is not None and dtype != w.dtype:  # a float16 copy of float32 values may overflow
                check_finite("W_enc", w, self.w_enc, where=where, error=ConfigError, fix="load it in float32")
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        extra = [self.scales, self.biases] if self.config.quantization else []
        return [self.w_enc, *extra, self.b_dec, self.idf, self.max]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def preactivations(self, states: mx.array) -> mx.array:
        """relu((zscore(states) - b_dec) @ W_enc), (N, codebook_dim) float32."""
        x = zscore(states) - self.b_dec
        if self.config.quantization:
            x = x.astype(self.scales.dtype)
            pre = mx.quantized_matmul(
                x, self.w_enc, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=self.bits
            )
        else:
            pre = x.astype(self.w_enc.dtype) @ self.w_enc
        return mx.maximum(pre.astype(mx.float32), 0)

    def encode(self, states: mx.array, normalize: bool = False) -> tuple[mx.array, mx.array]:
        """The k largest features of each row of ``states`` (N, d_model): indices (N, k) int32
        and values (N, k) float32, largest first, scaled by idf / max with ``normalize``.
        Rows are encoded ``ENCODE_BYTES`` of pre-activations at a time (queued, not waited for)."""
        if states.ndim != 2 or states.shape[-1] != self.config.d_model:
            raise ScoringError(
                f"SAE layer {self.layer}: hidden states of shape {tuple(states.shape)}; it reads (tokens, "
                f"{self.config.d_model})"
            )
        k, rows = self.config.k, max(1, ENCODE_BYTES // (4 * self.config.codebook_dim))
        indices, values = [], []
        for start in range(0, states.shape[0], rows):
            pre = self.preactivations(states[start : start + rows])
            top = top_k(pre, k)
            vals = mx.take_along_axis(pre, top, axis=-1)
            if normalize:
                vals = vals / self.max[top] * self.idf[top]
            order = mx.argsort(-vals, axis=-1)
            top, vals = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
            top = top.astype(mx.int32)
            mx.async_eval(top, vals)
            indices.append(top)
            values.append(vals)
        if not indices:
            return mx.zeros((0, k), mx.int32), mx.zeros((0, k), mx.float32)
        return mx.concatenate(indices), mx.concatenate(values)


class SparseAutoencoder:
    """An SAE container (one SAE per backbone layer, all of one d_model / codebook_dim / k), read
    lazily: ``layer(i)`` loads ``layer_{i}.safetensors`` the first time it is asked for."""

    def __init__(
        self,
        config: SAEConfig,
        fetch: Callable[[int], Path],
        name: str,
        dtype: mx.Dtype | None = None,
        revision: str | None = None,
    ):
        self.config, self.name, self._fetch, self._dtype = config, name, fetch, dtype
        self.revision = revision  # the Hub commit its files come from (None: a local folder)
        self._layers: dict[int, SAELayer] = {}
        self._files: dict[int, Path] = {}

    def __repr__(self) -> str:
        c = self.config
        return (
            f"SparseAutoencoder({self.name!r}, d_model={c.d_model}, codebook_dim={c.codebook_dim}, k={c.k}, "
            f"layers={list(c.available_layers)}, {c.precision})"
        )

    @property
    def loaded_layers(self) -> list[int]:
        return sorted(self._layers)

    def check_layer(self, layer: int) -> int:
        """``layer`` if this container has an SAE for it, else ScoringError naming those it has."""
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in self.config.available_layers:
            raise ScoringError(
                f"{self.name} has no SAE for layer {layer!r}; its layers: "
                f"{', '.join(map(str, self.config.available_layers))}"
            )
        return layer

    def file(self, layer: int) -> Path:
        """The local path of ``layer_{layer}.safetensors`` (downloaded first from a Hub repo)."""
        self.check_layer(layer)
        if layer not in self._files:
            path = self._fetch(layer)
            if not path.is_file():
                raise ConfigError(f"{path}: missing; config.json lists layer {layer} as available")
            check_layer_file(path, self.config)
            self._files[layer] = path
        return self._files[layer]

    def tensors(self, layer: int) -> dict[str, mx.array]:
        """The stored tensors of ``layer``'s file: its header checked (``file``), then read, each
        checked finite (``artifact.load_safetensors``). ConfigError naming the file and tensor."""
        return load_safetensors(self.file(layer), ConfigError)

    def layer(self, layer: int) -> SAELayer:
        """The SAE of backbone hidden state ``layer``, read from its file on first use."""
        if layer not in self._layers:
            where = str(self.file(layer))
            self._layers[layer] = SAELayer(self.config, layer, self.tensors(layer), self._dtype, where)
        return self._layers[layer]

    def release(self, layer: int) -> None:
        """Drop ``layer``'s weights from memory (read again on the next use)."""
        self._layers.pop(layer, None)

    def fingerprint(self, layers) -> str:
        """A sha256 naming this SAE's config and the files of ``layers``: what a resumed job
        checks (the files' hashes are remembered across runs, ``esmc_mlx.hashes``)."""
        digest = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        for layer in sorted(layers):
            path = self.file(layer)
            digest.update(f"{layer} {file_hashes([path])[path.name]}\n".encode())
        return digest.hexdigest()


def load_sae(path_or_repo_id: str | Path, revision: str | None = None, dtype=None) -> SparseAutoencoder:
    """An SAE container from a local folder, a Hub repo id (``biohub/esmc-6b-2024-12-sae-k64-
    codebook16384``) or ``tiny`` (the packaged SAE on esmc-tiny's layer 4, offline): config.json is read now, each ``layer_{i}.safetensors`` when first used
    (from a Hub repo: downloaded then, at the commit config.json came from).

    ``dtype``: the float dtype the encoder's matrix is computed in (default float32, whatever
    the stored dtype: the matmul is about 1% of a backbone's forward, and a bf16 SAE then loses
    only its storage rounding, the same on every device). Raises ConfigError for a folder that is not an SAE,
    HubError for a failed download, ConvertError for a ``dtype`` that is not a float dtype.
    """
    dtype = compute_dtype(dtype)
    text = str(path_or_repo_id)
    if text in SAE_ALIASES and not Path(text).exists():  # "tiny": the packaged esmc-tiny-sae
        text = str(SAE_ALIASES[text])
    local = Path(text).expanduser()
    if local.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        if not local.is_dir():
            raise ConfigError(f"{text}: no such SAE folder (give a local folder or a Hub repo id ORG/NAME)")
        if revision is not None:
            raise ConfigError(f"revision {revision!r}: {text} is a local folder, and a revision names a Hub version")
        config, name = read_sae_config(local), local.resolve().name

        def fetch(layer: int) -> Path:
            return local / layer_file(layer)

        commit = None
    else:
        snapshot, commit = download_checkpoint(text, revision, patterns=[CONFIG_NAME])
        config, name = read_sae_config(snapshot), text

        def fetch(layer: int) -> Path:
            return download_file(text, layer_file(layer), commit or revision)

    return SparseAutoencoder(config, fetch, name, None if config.quantization else dtype or mx.float32, commit)
