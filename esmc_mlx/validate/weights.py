"""Weights for the references, read one tensor (or one layer) at a time, in MLX names.

* ``SourceWeights``: the original checkpoint (any of the three layouts), renamed and split
  through ``esmc_mlx.convert.mapping``, exactly as the converter does.
* ``ArtifactWeights``: an esmc-mlx directory; quantized tensors come back dequantized with the
  artifact's own quantization record (``mx.dequantize``), in fp32.

Both hand out fp32 torch tensors on a given device (``get_many``: what the weights check
compares and the torch references then load) and hold nothing themselves: what stays in memory
is what the caller keeps. ``ArtifactWeights.share_reads()`` keeps the tensors read for one
layer until ``forget()``, so that the MLX pass and the torch pass on the artifact's weights,
run in the same sweep, read that layer from disk once.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..artifact import (
    check_against_tensors,
    expected_shapes,
    quantization_record,
    read_config,
    safetensors_header,
    weight_files,
)
from ..config import ESMCConfig
from ..convert.sources import open_checkpoint
from ..errors import ConfigError, ConvertError, ValidationError
from ..fold_artifact import read_fold_config
from ..fold_config import FoldConfig
from ..resolve import Source, resolve


def names_for(config: ESMCConfig, prefix: str) -> list[str]:
    """Parameter names (MLX / transformers spelling) under ``prefix`` for this architecture."""
    return [n for n in expected_shapes(config) if n.startswith(prefix)]


def _host(array: mx.array):
    """An evaluated mx.array as a torch tensor sharing its memory, through DLPack: MLX's memory is
    host-visible (unified on Apple silicon; managed with MLX's CUDA backend, which exports it as
    CPU memory). numpy (a copy) is the fallback."""
    import torch

    try:
        return torch.from_dlpack(array)
    except (TypeError, RuntimeError, BufferError, ValueError):
        return torch.from_numpy(np.array(array, copy=True))


class _OnDevice:
    """MLX's memory seen by torch as CUDA memory (``__cuda_array_interface__``): with MLX's CUDA
    backend it is managed memory, which the GPU reads in place, so a copy of it is a copy within
    the GPU, not a round trip through the host (measured on the H200: 0.27 GB took 90 ms to the
    GPU through numpy). bf16 travels as int16 (the interface has no bf16)."""

    def __init__(self, host):
        import torch

        self.host = host  # keeps MLX's buffer alive until the copy is done
        bits = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
        self.__cuda_array_interface__ = {
            "shape": tuple(bits.shape),
            "typestr": {torch.int16: "<i2", torch.float16: "<f2", torch.float32: "<f4"}[bits.dtype],
            "data": (bits.data_ptr(), False),
            "strides": tuple(x * bits.element_size() for x in bits.stride()),
            "version": 3,
        }


def _copy_to(host, device):
    """A torch tensor over MLX's memory (``_host``) copied to ``device``, as its own tensor."""
    import torch

    if torch.device(device).type == "cuda" and mx.default_device() == mx.gpu and mx.cuda.is_available():
        try:
            seen = torch.as_tensor(_OnDevice(host), device=device)
            if host.dtype == torch.bfloat16:
                seen = seen.view(torch.bfloat16)
            return seen.clone()
        except (TypeError, RuntimeError, ValueError):
            pass
    return host.to(device=device, copy=True)


def to_devices(arrays: dict[str, mx.array], device, narrow: bool | None = None) -> dict:
    """fp32 mx.arrays as fp32 torch tensors on ``device``, with one MLX evaluation for all of
    them (a synchronisation per tensor cost more than the copies: 1,048 of them in the 6B).
    Off the CPU (``narrow`` None), a tensor that bf16 holds exactly (dequantized
    mxfp4/nvfp4/mxfp8 weights, bf16-born floats) travels as bf16 and is widened there: half
    the bytes, the same fp32 values."""
    import torch

    if narrow is None:
        narrow = torch.device(device).type != "cpu"
    halves = {n: a.astype(mx.bfloat16) for n, a in arrays.items()} if narrow else {}
    exact = {n: mx.array_equal(h.astype(mx.float32), arrays[n]) for n, h in halves.items()}
    mx.eval(list(arrays.values()), list(halves.values()), list(exact.values()))
    out = {}
    for n, a in arrays.items():
        if n in exact and exact[n].item():
            out[n] = _copy_to(_host(halves[n]), device).float()
        else:
            out[n] = _copy_to(_host(a), device).float()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # the copies read MLX's buffers, released after this
    return out


def to_torch(array: mx.array):
    """An mx.array as an fp32 torch tensor on the CPU, owning its memory."""
    import torch

    mx.eval(array)
    return _host(array).to(dtype=torch.float32, copy=True)


class SourceWeights:
    """The original checkpoint: alias, Hub repo id, directory or legacy ``.pth``."""

    def __init__(self, reference: str, revision: str | None = None):
        try:
            self.source: Source = resolve(reference, revision)
            ckpt = open_checkpoint(self.source)
        except ValueError as e:  # shape inference on something that is not ESMC
            raise ValidationError(f"reference {reference}: {e}") from None
        self.config = ckpt.config
        self.id = self.source.id
        self.dtype = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}[ckpt.dtype]
        self._pth_read = ckpt.read if self.source.is_pth or ckpt.files[0].suffix != ".safetensors" else None
        self._where: dict[str, Path] = {}
        if self._pth_read is None:
            for f in ckpt.files:
                for name in safetensors_header(f):
                    if name != "__metadata__":
                        self._where[name] = f
        # target (MLX) name -> (source name, part, parts)
        self._origin: dict[str, tuple[str, int, int]] = {}
        for name in ckpt.shapes:
            targets = ckpt.target_names(name)  # an ESMFold2's folding tensors keep their names
            for part, target in enumerate(targets or ()):
                self._origin[target] = (name, part, len(targets))
        self._handles: dict[Path, object] = {}  # open (memory-mapped) files; closed after each get_many
        self._last: tuple[str, object] | None = None  # the fused q/k/v is read once for three names
        self.files = [*ckpt.files] + (
            [self.source.path / "config.json"]
            if self.source.path.is_dir() and (self.source.path / "config.json").exists()
            else []
        )

    def _read_source(self, name: str, device: str = "cpu"):
        import torch

        if self._last and self._last[0] == (name, device):
            return self._last[1]
        if self._pth_read is not None:
            tensor = to_torch(self._pth_read(name)).to(device)
        else:
            from safetensors import safe_open

            f = self._where[name]
            if (f, device) not in self._handles:  # straight to the reference's device (GPU: no host copy)
                self._handles[(f, device)] = safe_open(str(f), framework="pt", device=str(device))
            tensor = self._handles[(f, device)].get_tensor(name).to(torch.float32)
        self._last = ((name, device), tensor)
        return tensor

    def has(self, name: str) -> bool:
        return name in self._origin

    def get(self, name: str, device: str = "cpu"):
        """One tensor in MLX/transformers naming, fp32 torch. KeyError if the source lacks it."""
        source_name, part, parts = self._origin[name]
        tensor = self._read_source(source_name, device)
        return tensor if parts == 1 else tensor.chunk(parts, dim=0)[part].contiguous()

    def get_many(self, names: list[str], device: str = "cpu") -> dict:
        """Several tensors (one layer's) on ``device``; the files are unmapped afterwards, so that
        the pages read do not stay in this process's resident memory."""
        out = {n: self.get(n, device) for n in names}
        self._last = None
        self._handles.clear()
        return out

    def describe(self) -> dict:
        return {
            "id": self.id,
            "revision": self.source.revision,
            "path": str(self.source.path),
            "dtype": self.dtype,
            "layout": "legacy .pth" if self._pth_read else "safetensors",
        }


class ArtifactWeights:
    """An esmc-mlx output directory, read lazily; quantized weights dequantized on request."""

    def __init__(self, mlx_dir: str | Path):
        self.directory = Path(mlx_dir)
        path = self.directory / "config.json"
        if not path.exists():
            raise ValidationError(f"{self.directory}: no config.json (is this an esmc-mlx output directory?)")
        try:
            self.raw = read_config(self.directory)  # bounded; its dtype and quantization record checked
        except ConvertError as e:
            raise ValidationError(str(e)) from None
        self.record: dict | None = quantization_record(self.raw)
        self.dtype = self.raw.get("dtype", "float32")
        try:
            files = weight_files(self.directory)
        except ConvertError as e:
            raise ValidationError(str(e)) from None
        self._where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            for name, info in safetensors_header(Path(f)).items():
                if name != "__metadata__":
                    self._where[name] = f
                    self.shapes[name] = tuple(info["shape"])
        # a config the weights contradict fails the config check
        self.config, self.config_error = self._read_config(path)
        self._memo: dict[str, mx.array] | None = None

    def _read_config(self, path: Path) -> tuple[ESMCConfig | None, str | None]:
        """(the architecture config.json describes, None) or (None, why it cannot be read or
        does not fit the tensors' headers)."""
        try:
            config = ESMCConfig.from_dict(self.raw)
            check_against_tensors(config, self.shapes, str(path))
        except ConfigError as e:
            return None, f"{path}: {e}"
        except ConvertError as e:
            return None, str(e)
        return config, None

    def share_reads(self) -> None:
        """From now on keep what is read until ``forget()`` (one layer's tensors, for two passes)."""
        self._memo = {}

    def forget(self, stop: bool = False) -> None:
        """Drop the kept tensors; ``stop``: keep nothing from now on."""
        self._memo = None if stop or self._memo is None else {}

    # --- raw tensors, as MLX holds them ---------------------------------------------------
    def raw_many(self, names: list[str]) -> dict[str, mx.array]:
        """Stored tensors (quantized ones packed), evaluated; one ``mx.load`` per file touched,
        dropped afterwards so that nothing else stays in memory."""
        memo = self._memo if self._memo is not None else {}
        out: dict[str, mx.array] = {n: memo[n] for n in names if n in memo}
        by_file: dict[str, list[str]] = {}
        for n in names:
            if n not in out:
                by_file.setdefault(self._where[n], []).append(n)
        for f, ns in by_file.items():
            loaded = mx.load(f)
            for n in ns:
                out[n] = loaded[n]
            del loaded
        mx.eval(list(out.values()))
        if self._memo is not None:
            self._memo.update(out)
        return out

    def stored_names(self, prefix: str) -> list[str]:
        return [n for n in self._where if n.startswith(prefix)]

    def quant_params(self, module: str) -> dict | None:
        """(group_size, bits, mode) of a quantized module, by mlx-lm's rule: a per-layer entry of
        the record wins, else the record's defaults where the artifact holds ``.scales``."""
        if f"{module}.scales" not in self._where or not self.record:
            return None
        entry = self.record.get(module)
        params = entry if isinstance(entry, dict) else self.record
        return {
            "group_size": int(params["group_size"]),
            "bits": int(params["bits"]),
            "mode": params.get("mode", "affine"),
        }

    # --- dequantized fp32 torch tensors, for the fidelity reference -------------------------
    def has(self, name: str) -> bool:
        return name in self._where

    def get_many(self, names: list[str], device: str = "cpu") -> dict:
        """Parameters by MLX name as fp32 torch tensors on ``device`` (``....weight`` of a
        quantized module comes back dequantized)."""
        return to_devices(self.get_mx(names), device)

    def get_mx(self, names: list[str]) -> dict[str, mx.array]:
        """Parameters by MLX name, fp32 MLX arrays, quantized ones dequantized."""
        wanted: list[str] = []
        for n in names:
            module = n[: -len(".weight")] if n.endswith(".weight") else None
            if module and self.quant_params(module):
                wanted += [n, f"{module}.scales"] + ([f"{module}.biases"] if self.has(f"{module}.biases") else [])
            else:
                wanted.append(n)
        raw = self.raw_many(wanted)
        out = {}
        for n in names:
            module = n[: -len(".weight")] if n.endswith(".weight") else None
            params = self.quant_params(module) if module else None
            if params:
                out[n] = dequantize(raw[n], raw[f"{module}.scales"], raw.get(f"{module}.biases"), params)
            else:
                out[n] = raw[n].astype(mx.float32)
        return out


class FoldArtifactWeights(ArtifactWeights):
    """A fold artifact (``fold_artifact``): ``config`` is its ``FoldConfig``, checked against the
    tensors' headers as ``load_fold`` checks it; the tensors as ``ArtifactWeights`` hands them out
    (the backbone's quantized ones dequantized)."""

    def _read_config(self, path: Path) -> tuple[FoldConfig | None, str | None]:
        try:
            return read_fold_config(self.directory)[1], None
        except ConvertError as e:
            return None, str(e)


def dequantize(w: mx.array, scales: mx.array, biases: mx.array | None, params: dict) -> mx.array:
    """The fp32 matrix a quantized layer multiplies by: floating scales and biases are widened
    to fp32 first, as the runtime computes on the CPU."""

    def widen(a):
        return a.astype(mx.float32) if a is not None and mx.issubdtype(a.dtype, mx.floating) else a

    return mx.dequantize(
        w, widen(scales), widen(biases), group_size=params["group_size"], bits=params["bits"], mode=params["mode"]
    ).astype(mx.float32)
