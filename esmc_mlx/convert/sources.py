"""Checkpoint sources (resolved by ``esmc_mlx.resolve``): read tensors one at a time, lazily."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx

from ..artifact import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    check_against_tensors,
    index_files,
    quantization_record_problem,
    safetensors_header,
    tensor_files,
)
from ..config import ESMCConfig
from ..errors import ConfigError, ConvertError, install_hint
from ..fold_artifact import BACKBONE, check_fold_against_tensors, float32_in_transformers, is_fold_config
from ..fold_config import FoldConfig
from ..readers import read_json
from ..resolve import Source
from . import mapping


# --- safetensors --------------------------------------------------------------------------
def _safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a source directory: those its index names, else its one .safetensors.
    A directory whose files contradict its index (a stray .safetensors beside the shards) or
    that holds several files and no index is refused: which tensors win would be a guess."""
    index = directory / INDEX_FILE
    present = set(directory.glob("*.safetensors"))
    if index.is_file():
        files = index_files(index)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConvertError(f"{index} names shards that are missing: {', '.join(missing)}")
        strays = sorted(f.name for f in present - set(files))
        if strays:
            raise ConvertError(
                f"{directory}: {', '.join(strays)} not named by {INDEX_FILE}; move it out of the checkpoint directory"
            )
        return files
    if len(present) > 1:
        raise ConvertError(
            f"{directory}: {len(present)} .safetensors files ({', '.join(sorted(f.name for f in present))}) "
            f"and no {INDEX_FILE} to say which make up the model; keep only the checkpoint's"
        )
    if not present:
        raise ConvertError(f"{directory}: no .safetensors checkpoint (or single .pth) found")
    return sorted(present)


@dataclasses.dataclass
class Checkpoint:
    """Tensor names, shapes and a lazy reader for one source checkpoint: an ESMC, or an ESMFold2
    (``config`` a ``FoldConfig``: the folding model and its ESMC backbone under ``esmc.*``)."""

    config: ESMCConfig | FoldConfig
    shapes: dict[str, tuple[int, ...]]
    dtype: mx.Dtype  # dtype of the floating weights
    files: list[Path]
    read: Callable[[str], mx.array]  # name -> tensor, loaded only when asked
    license: str | None = None
    # tensors stored in a dtype that is not a float weight MLX reads (an integer, bool, F64): name -> dtype
    odd_dtypes: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def is_fold(self) -> bool:
        return isinstance(self.config, FoldConfig)

    @property
    def esmc_config(self) -> ESMCConfig:
        """The ESMC's architecture: the model's, or the backbone's of an ESMFold2."""
        return self.config.esmc_config if self.is_fold else self.config

    def target_names(self, source_name: str) -> tuple[str, ...] | None:
        """The MLX names a tensor of this checkpoint becomes (``mapping``), None if no rule knows it."""
        return (mapping.fold_target_names if self.is_fold else mapping.target_names)(source_name)

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
    if not list(source.path.glob("*.safetensors")):
        if len(pths) == 1:
            return _open_pth(pths[0])
        if pths:
            raise ConvertError(
                f"{source.path}: no .safetensors checkpoint, and {len(pths)} .pth files "
                f"({', '.join(p.name for p in pths)}); pass the one to convert"
            )
    files = _safetensors_files(source.path)
    tensor_files(files)  # each tensor in one file
    shapes, where, stored = {}, {}, {}
    for f in files:
        for name, info in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            shapes[name] = tuple(info["shape"])
            where[name] = f
            stored[name] = info["dtype"]
    loaded: dict[Path, dict[str, mx.array]] = {}

    def read(name: str) -> mx.array:
        f = where[name]
        if name not in loaded.get(f, {}):  # mx.load is lazy: a tensor is read when evaluated
            loaded.clear()
            loaded[f] = mx.load(str(f))
        # pop: once evaluated, a tensor kept here would stay in memory until the next shard
        return loaded[f].pop(name)

    packed = set()  # mlx-lm's quantized weights (U32), read dequantized
    if detect_layout(shapes) == "mlx-lm" and any(n.endswith(".scales") for n in shapes):
        packed = {n for n in shapes if n.endswith(".weight") and n.removesuffix(".weight") + ".scales" in shapes}
        shapes, read = _dequantized(shapes, read, source.path)
    config = _read_config(source.path, shapes)
    _check_config(config, shapes, source.path)
    dtypes = {n: SAFETENSORS_DTYPES[d] for n, d in stored.items() if d in SAFETENSORS_DTYPES}
    return Checkpoint(
        config=config,
        shapes=shapes,
        dtype=_dominant(config, dtypes),
        files=files,
        read=read,
        license=_read_license(source.path),
        odd_dtypes={n: stored[n] for n in shapes if stored[n] not in SAFETENSORS_DTYPES and n not in packed},
    )


def detect_layout(names) -> str:
    """Which of the four source layouts these tensor names are (docs/formats.md):
    ``published`` (transformers), ``esm`` (the esm package, TE names), ``legacy`` (2024-12
    .pth) or ``mlx-lm`` (mlx-lm's ESMC port); ``unknown`` for anything else."""
    names = list(names)
    if any(n.startswith("esmc.layers.") for n in names):
        return "published"
    if any(".attn.ln_qkv." in n or ".attn.qkv." in n for n in names):
        return "mlx-lm"
    if any(".attn.layernorm_qkv.1." in n for n in names):
        return "legacy"
    if any(".attn.layernorm_qkv." in n for n in names):
        return "esm"
    return "unknown"


def _dequantized(shapes: dict, read: Callable[[str], mx.array], directory: Path):
    """An mlx-lm-quantized checkpoint seen as float: each ``X.weight`` (packed uint32) with its
    ``X.scales``/``X.biases`` becomes one dequantized ``X.weight``, using the quantization
    record of config.json (mlx-lm's: ``group_size``, ``bits``, ``mode``, per-module overrides
    keyed by module path). The converter then handles it as any float source."""
    path = directory / "config.json"
    raw = read_json(path, ConvertError, max_bytes=1 << 20)
    record = raw.get("quantization") or raw.get("quantization_config") if isinstance(raw, dict) else None
    if not isinstance(record, dict):
        raise ConvertError(f"{directory}: quantized tensors (*.scales) but no quantization record in {path}")
    problem = quantization_record_problem(record)
    if problem:
        raise ConvertError(f"{path}: quantization: {problem}")
    params, out = {}, {}
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        quantized = module + ".scales" in shapes and module + ".weight" in shapes
        if quantized and leaf in ("scales", "biases"):
            continue  # folded into the weight
        if not (quantized and leaf == "weight"):
            out[name] = shape
            continue
        p = {**record, **record[module]} if isinstance(record.get(module), dict) else record
        bits, mode = p["bits"], p.get("mode") or "affine"
        params[name] = (module, bits, p["group_size"], mode)
        out[name] = (shape[0], shape[1] * 32 // bits)

    def read_float(name: str) -> mx.array:
        if name not in params:
            return read(name)
        module, bits, group_size, mode = params[name]
        weight, scales = read(name), read(module + ".scales")
        biases = read(module + ".biases") if module + ".biases" in shapes else None
        return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode)

    return out, read_float


def _dominant(config: ESMCConfig | FoldConfig, dtypes: dict[str, mx.Dtype]) -> mx.Dtype:
    """The dtype of the floating weights (``dtypes``: name -> dtype): float32 if any is. An
    ESMFold2 saved in half precision by transformers holds some tensors in float32 still
    (``fold_artifact.float32_in_transformers``): its dtype is that of the others."""
    if isinstance(config, FoldConfig):
        dtypes = {n: d for n, d in dtypes.items() if not float32_in_transformers(n)}
    for dt in (mx.float32, mx.bfloat16, mx.float16):
        if dt in dtypes.values():
            return dt
    return mx.float32


def _read_config(directory: Path, shapes: dict[str, tuple[int, ...]]) -> ESMCConfig | FoldConfig:
    """The architecture config.json describes (an ESMFold2 by its ``model_type``, else an ESMC in
    any spelling), or the one the shapes imply when there is no config.json."""
    path = directory / "config.json"
    if not path.exists():
        try:
            return mapping.infer_config(shapes)
        except ConfigError as e:
            raise ConvertError(f"{directory}: {e}") from None
    raw = read_json(path, ConvertError, max_bytes=1 << 20)
    try:
        return FoldConfig.from_dict(raw) if is_fold_config(raw) else ESMCConfig.from_dict(raw)
    except ConfigError as e:
        raise ConvertError(f"{path}: {e}") from None


def _check_config(config: ESMCConfig | FoldConfig, shapes: dict[str, tuple[int, ...]], where: Path) -> None:
    """The config against the checkpoint's tensors (in MLX names), before anything is built for
    it: a num_hidden_layers of 1e9 would otherwise build a billion layers' names."""
    fold = isinstance(config, FoldConfig)
    renamed: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        targets = (mapping.fold_target_names if fold else mapping.target_names)(name) or ()
        for target in targets:
            renamed[target] = (shape[0] // len(targets), *shape[1:]) if shape else shape
    origin = str(where / "config.json" if (where / "config.json").is_file() else where)
    if fold:
        backbone = {n: s for n, s in renamed.items() if n.startswith(BACKBONE)}
        check_against_tensors(config.esmc_config, backbone, f"{origin} (esmc_config)")
        check_fold_against_tensors(config, renamed, origin)
    else:
        check_against_tensors(config, renamed, origin)


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


def _is_pickle(path: Path, zipped: bool) -> bool:
    """Whether ``path`` holds a pickle (torch's zip format holds one): its first opcode is one, read
    by ``pickletools`` (which runs nothing). Text or random bytes are no pickle: torch's
    weights-only loader refuses both alike ("Unsupported operand")."""
    import pickletools

    if zipped:
        return True
    try:
        with open(path, "rb") as f:
            next(pickletools.genops(f))
    except Exception:  # ValueError: an unknown opcode; EOF
        return False
    return True


def _open_pth(path: Path) -> Checkpoint:
    try:
        import torch
    except ImportError:
        raise ConvertError(f"{path}: reading a .pth checkpoint needs torch: {install_hint('torch')}") from None
    import pickle
    import zipfile

    # torch's mmap reads only the zip format (torch >= 1.6); an older checkpoint loads whole
    mmap = zipfile.is_zipfile(path)
    try:
        with warnings.catch_warnings():  # its notes on pickle protocols are not the user's business
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if ("Weights only load failed" in str(e) or "Unsupported global" in str(e)) and _is_pickle(path, mmap):
            # torch's text goes on to advise unsafe loading: never repeat it
            raise ConvertError(
                f"{path}: holds Python objects besides tensors; esmc-mlx reads only a plain state dict, because "
                "unpickling anything else can run code. Save one from the code that made the file: "
                "torch.save(model.state_dict(), 'state_dict.pth')"
            ) from None
        raise ConvertError(f"{path}: cannot read it as a PyTorch checkpoint (not one, or damaged)") from None
    except Exception as e:  # RuntimeError, EOFError, KeyError ... for files that are not checkpoints
        detail = "its zip archive is truncated or corrupt" if "PytorchStreamReader" in str(e) else type(e).__name__
        raise ConvertError(
            f"{path}: cannot read it as a PyTorch checkpoint: not one, or truncated or damaged ({detail})"
        ) from None
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConvertError(f"{path}: not a state dict of tensors")
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    odd = {k: str(v.dtype).removeprefix("torch.") for k, v in state.items() if not v.is_floating_point()}

    def read(name: str) -> mx.array:
        return torch_to_mlx(state[name])

    torch_to_mx = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    config = _read_config(path.parent, shapes)
    _check_config(config, shapes, path.parent)
    dtypes = {k: torch_to_mx.get(v.dtype, mx.float32) for k, v in state.items() if v.is_floating_point()}
    return Checkpoint(
        config=config,
        shapes=shapes,
        dtype=_dominant(config, dtypes),
        files=[path],
        read=read,
        odd_dtypes=odd,
    )
