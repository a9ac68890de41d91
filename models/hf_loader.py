"""Load a Hugging Face model directory: config.json plus safetensors (one file, or shards listed in
model.safetensors.index.json).

Two steps so the engine can ask the memory layer first: `inspect_hf_dir` reads only the config and
the safetensors headers and states what loading will cost (`weights_bytes(dtype)`,
`transient_bytes()`); `load_hf_model` then builds the model and fills it a few tensors at a
time, so the peak is the model plus `transient_bytes()` of source tensors in flight.
"""

from __future__ import annotations

import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ballast.memory.types import MiB
from ballast.models.base import ConfigError, WeightLoadError
from ballast.models.registry import build_model
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Non-persistent buffers some older checkpoints saved; our models compute them.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_PROGRESS_MIN_BYTES = 256 * MiB
_LOAD_THREADS = 8
_READ_AHEAD = 2 * _LOAD_THREADS  # source tensors held at once, at most

_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class HFCheckpoint:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def weights_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of every tensor once cast to dtype (what the model will hold)."""
        size = torch.tensor([], dtype=dtype).element_size()
        return sum(t.numel for t in self.tensors.values()) * size

    def transient_bytes(self) -> int:
        """The extra a load holds at its peak besides the model: the source tensors read ahead
        (copies cast straight into the model's parameters)."""
        sizes = sorted((t.numel * _ST_DTYPE_BYTES.get(t.dtype, 4) for t in self.tensors.values()), reverse=True)
        return sum(sizes[: _READ_AHEAD])

    @property
    def files_bytes(self) -> int:
        return sum(f.stat().st_size for f in {t.file for t in self.tensors.values()})


def read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path} has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_file} does not hold a JSON object")
    return cfg


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightLoadError(f"{index} has no weight_map")
        files = sorted({path / str(f) for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index} lists shards that are not there: {missing}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise WeightLoadError(f"{path} has no safetensors weights (only safetensors are supported)")


def inspect_hf_dir(path: str | Path) -> HFCheckpoint:
    """Config and tensor table of an HF directory, from the headers only (no tensor data read)."""
    root = Path(path)
    if not root.is_dir():
        raise WeightLoadError(f"{root} is not a directory")
    config = read_config(root)
    tensors: dict[str, TensorInfo] = {}
    for file in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(name)
                    if name in tensors:
                        raise WeightLoadError(f"tensor {name} appears in {tensors[name].file.name} and {file.name}")
                    tensors[name] = TensorInfo(file, str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
        except (OSError, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError(ValueError-like)
            raise WeightLoadError(f"cannot read {file}: {e}") from e
    return HFCheckpoint(root, config, tensors)


def _names_to_load(ckpt: HFCheckpoint, model: nn.Module) -> list[str]:
    """The checkpoint tensors to copy (their names are the model's parameter names), after checking
    that nothing is missing, unexpected or of the wrong shape."""
    params = dict(model.state_dict(keep_vars=True))
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    wanted = {n for n in ckpt.tensors if not n.endswith(_IGNORED_SUFFIXES)}
    if tied:
        # The head shares the embedding; if the checkpoint also stores it, the embedding wins.
        wanted.discard("lm_head.weight")
    unexpected = sorted(wanted - params.keys())
    missing = sorted(params.keys() - wanted - ({"lm_head.weight"} if tied else set()))
    if unexpected or missing:
        raise WeightLoadError(
            f"{ckpt.path}: checkpoint does not match the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name in wanted:
        shape = tuple(params[name].shape)
        if ckpt.tensors[name].shape != shape:
            raise WeightLoadError(f"{name}: checkpoint shape {ckpt.tensors[name].shape}, model expects {shape}")
    return sorted(wanted)


def load_hf_model(
    ckpt: HFCheckpoint,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> nn.Module:
    """Build the model for ckpt.config and fill it from the safetensors files. The caller has
    already admitted `ckpt.weights_bytes(dtype)` (+ `ckpt.transient_bytes()`) with the memory layer.
    progress: a tqdm bar (None: only for loads over 256 MiB)."""
    model = build_model(ckpt.config, dtype=dtype, device=device)
    names = _names_to_load(ckpt, model)
    params = dict(model.state_dict(keep_vars=True))
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(ckpt.tensors[name].file, []).append(name)
    total = ckpt.weights_bytes(dtype)
    show = progress if progress is not None else total >= _PROGRESS_MIN_BYTES
    # Copies run on a few threads (copy_ releases the GIL): a load is mostly page faults on fresh
    # memory and dtype casts, which parallelise. At most 2 x workers source tensors are read
    # ahead, so the transient extra stays a few tensors' worth.
    workers = max(1, min(_LOAD_THREADS, os.cpu_count() or 1))
    with (
        tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not show) as bar,
        ThreadPoolExecutor(workers, thread_name_prefix="ballast-load") as pool,
    ):
        for file, file_names in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    pending: deque[Future[int]] = deque()
                    for n in file_names:
                        if len(pending) >= min(_READ_AHEAD, 2 * workers):  # bound what is read ahead
                            bar.update(pending.popleft().result())
                        pending.append(pool.submit(_copy_into, params[n], f.get_tensor(n)))
                    while pending:
                        bar.update(pending.popleft().result())
            except (OSError, ValueError, RuntimeError) as e:
                raise WeightLoadError(f"cannot load {file}: {e}") from e
    return model


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> int:
    with torch.no_grad():
        dst.copy_(src)  # copy_ casts: no intermediate tensor
    return dst.nbytes


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    """inspect + load in one call, for callers with nothing to admit (tests, tools)."""
    return load_hf_model(inspect_hf_dir(path), dtype=dtype, device=device)
