"""Checkpoint sources (resolved by ``esmc_mlx.resolve``): read tensors one at a time, lazily."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from ..artifact import SAFETENSORS_DTYPES, safetensors_header
from ..config import ESMCConfig
from ..errors import ConfigError, ConvertError
from ..resolve import Source
from . import mapping


# --- safetensors --------------------------------------------------------------------------
def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ConvertError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{directory}: no *.safetensors checkpoint found (nor a .pth)")
    return files


@dataclasses.dataclass
class Checkpoint:
    """Tensor names, shapes and a lazy reader for one source checkpoint."""

    config: ESMCConfig
    shapes: dict[str, tuple[int, ...]]
    dtype: mx.Dtype  # dtype of the floating weights
    files: list[Path]
    read: Callable[[str], mx.array]  # name -> tensor, loaded only when asked
    license: str | None = None

    def tensors(self) -> Iterator[tuple[str, mx.array]]:
        for name in self.shapes:
            yield name, self.read(name)


def open_checkpoint(source: Source) -> Checkpoint:
    """Open a checkpoint without reading its weights."""
    if source.is_pth:
        return _open_pth(source.path)
    if not source.path.is_dir():
        raise ConvertError(f"{source.path}: expected a checkpoint directory or a .pth file")
    pths = sorted(source.path.glob("*.pth"))
    if not list(source.path.glob("*.safetensors")) and len(pths) == 1:
        return _open_pth(pths[0])
    files = _safetensors_files(source.path)
    shapes, dtypes, where = {}, set(), {}
    for f in files:
        for name, info in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            shapes[name] = tuple(info["shape"])
            where[name] = f
            if info["dtype"] in SAFETENSORS_DTYPES:
                dtypes.add(SAFETENSORS_DTYPES[info["dtype"]])
    loaded: dict[Path, dict[str, mx.array]] = {}

    def read(name: str) -> mx.array:
        f = where[name]
        if name not in loaded.get(f, {}):  # mx.load is lazy: a tensor is read when evaluated
            loaded.clear()
            loaded[f] = mx.load(str(f))
        # pop: once evaluated, a tensor kept here would stay in memory until the next shard
        return loaded[f].pop(name)

    return Checkpoint(
        config=_read_config(source.path, shapes),
        shapes=shapes,
        dtype=_dominant(dtypes),
        files=files,
        read=read,
        license=_read_license(source.path),
    )


def _dominant(dtypes: set) -> mx.Dtype:
    for dt in (mx.float32, mx.bfloat16, mx.float16):
        if dt in dtypes:
            return dt
    return mx.float32


def _read_config(directory: Path, shapes: dict[str, tuple[int, ...]]) -> ESMCConfig:
    path = directory / "config.json"
    if not path.exists():
        return mapping.infer_config(shapes)
    try:
        return ESMCConfig.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ConfigError) as e:
        raise ConvertError(f"{path}: {e}") from None


def _read_license(directory: Path) -> str | None:
    readme = directory / "README.md"
    if readme.exists():
        text = readme.read_text(errors="replace")
        if text.startswith("---"):
            for line in text.split("---")[1].splitlines():
                if line.startswith("license:"):
                    return line.split(":", 1)[1].strip()
    return None


# --- legacy .pth --------------------------------------------------------------------------
def torch_to_mlx(t) -> mx.array:
    """A torch tensor (any device) as an MLX array of the same dtype."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the raw bits
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def _open_pth(path: Path) -> Checkpoint:
    try:
        import torch
    except ImportError:
        raise ConvertError(
            f"{path}: reading a .pth checkpoint needs torch; install esmc-mlx[torch]"
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError ... for damage
        raise ConvertError(f"{path}: cannot read the .pth checkpoint ({type(e).__name__}: {e})") from None
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConvertError(f"{path}: not a state dict of tensors")
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}

    def read(name: str) -> mx.array:
        return torch_to_mlx(state[name])

    torch_to_mx = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    config_path = path.parent / "config.json"
    config = (_read_config(path.parent, shapes) if config_path.exists() else mapping.infer_config(shapes))
    return Checkpoint(
        config=config,
        shapes=shapes,
        dtype=_dominant({torch_to_mx.get(d, mx.float32) for d in dtypes}),
        files=[path],
        read=read,
    )
