"""Load a Hugging Face model directory: config.json plus safetensors (one file or an index).

Two steps so the engine can ask the memory layer first: `inspect_hf_dir` reads only the config and
headers and states the cost (`weights_bytes`, `transient_bytes`); `load_hf_model` then fills the
model a few tensors at a time, so the peak is the model plus `transient_bytes()` in flight.
A model class may rename or drop checkpoint tensors (`checkpoint_key`); per-expert MoE tensors
are copied into the fused expert parameters. FP8 checkpoints (HF fine-grained: float8 e4m3 plus
a float32 `weight_scale_inv` per block) stay float8 with `keep_fp8`, else each weight is
dequantized while copied, one at a time, so no more than the read-ahead is held in float32.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ballast.memory.types import MiB
from ballast.models.arch.registry import build_model, model_class, without_mtp
from ballast.models.base import ModelConfigError, UnsupportedModel, WeightLoadError
from ballast.models.blocks.moe import fused_param, per_expert_target, place_expert_tensor
from ballast.models.layers.fp8 import FP8, dequantize_blocks
from safetensors import safe_open
from torch import Tensor, nn
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Non-persistent buffers some older checkpoints saved; our models compute them.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_FP8_SCALE_SUFFIX = ".weight_scale_inv"
# Static activation scales of an FP8 checkpoint: unused once its weights are dequantized.
_FP8_ACTIVATION_SUFFIXES = (".input_scale", ".activation_scale")
_PROGRESS_MIN_BYTES = 256 * MiB
_LOAD_THREADS = 8
_READ_AHEAD = 2 * _LOAD_THREADS  # source tensors held at once, at most


def _st_dtype_bytes(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name ("BF16", "F8_E4M3", "BOOL", ...)."""
    bits = re.search(r"\d+", dtype)
    return max(1, int(bits[0]) // 8) if bits else 1


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    key: str  # the model's name for it (see checkpoint_key); a per-expert name stays unfused here

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class HFCheckpoint:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]  # by checkpoint name; only the tensors the model uses
    # FP8 checkpoints: the block scale of each float8 weight (by the weight's checkpoint name), and
    # the block shape [rows, cols] the scales cover.
    scales: dict[str, TensorInfo] = field(default_factory=dict)
    fp8_block: tuple[int, int] = (128, 128)

    def weights_bytes(self, dtype: torch.dtype, keep_fp8: bool = False) -> int:
        """Bytes the model will hold: tensors in dtype, or keep_fp8's float8 weights and float32 scales."""
        size = torch.tensor([], dtype=dtype).element_size()
        kept = self.kept_fp8() if keep_fp8 else set()
        return sum(
            t.numel + self.scales[name].numel * 4 if name in kept else t.numel * size
            for name, t in self.tensors.items()
        )

    def info(self, name: str) -> TensorInfo:
        """A weight's or (`..._scale_inv`) an FP8 scale's entry."""
        return self.tensors.get(name) or self.scales[name.removesuffix("_scale_inv")]

    def kept_fp8(self) -> set[str]:
        """The float8 weights (checkpoint names) a keep_fp8 load keeps in float8: all but experts
        whose gate and up halves would split a scale block (`registry.convert_model`'s rule)."""
        kept = set()
        for name in self.scales:
            info = self.tensors[name]
            target = per_expert_target(info.key)
            rows = 0 if target is None else info.shape[1 if target[2] == "down_proj" else 0]
            if rows % self.fp8_block[0] == 0:
                kept.add(name)
        return kept

    def fp8_params(self) -> set[str]:
        """The model parameters (fused expert names included) that hold float8 checkpoint weights."""
        return {fused_param(self.tensors[name].key) for name in self.scales}

    def transient_bytes(self) -> int:
        """The extra a load holds at its peak besides the model: the source tensors read ahead (a
        float8 weight also with its float32 dequantized copy)."""
        sizes = sorted(
            (
                t.numel * (_st_dtype_bytes(t.dtype) + (4 if name in self.scales else 0))
                for name, t in self.tensors.items()
            ),
            reverse=True,
        )
        return sum(sizes[:_READ_AHEAD])

    @property
    def files_bytes(self) -> int:
        return sum(f.stat().st_size for f in {t.file for t in self.tensors.values()})


def read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelConfigError(f"{path} has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{cfg_file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{cfg_file} does not hold a JSON object")
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


def inspect_hf_dir(path: str | Path, mtp: bool = False) -> HFCheckpoint:
    """Config and tensor table of an HF directory, from the headers only; tensors the model does
    not use are left out, so the byte figures count only what loads. mtp: keep the
    multi-token-prediction layers (`mtp.*`, for drafting); else they are dropped."""
    root = Path(path)
    if not root.is_dir():
        raise WeightLoadError(f"{root} is not a directory")
    config = without_mtp(read_config(root), mtp)
    fp8_block = _fp8_block(config)
    model_key = getattr(model_class(config), "checkpoint_key", None)
    tensors: dict[str, TensorInfo] = {}
    scales: dict[str, TensorInfo] = {}
    for file in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in tensors:
                        raise WeightLoadError(
                            f"tensor {name} appears in {tensors[name].file.name} and {file.name}"
                        )
                    key = name if model_key is None else model_key(name)
                    if not mtp and name.startswith("mtp."):
                        continue
                    if key is None or key.endswith(_IGNORED_SUFFIXES):
                        continue
                    sl = f.get_slice(name)
                    info = TensorInfo(file, str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()), key)
                    if fp8_block is not None and name.endswith(_FP8_SCALE_SUFFIX):
                        scales[name.removesuffix("_scale_inv")] = info
                    elif fp8_block is None or not name.endswith(_FP8_ACTIVATION_SUFFIXES):
                        tensors[name] = info
        except (OSError, ValueError, RuntimeError) as e:  # safetensors' SafetensorError is ValueError-like
            raise WeightLoadError(f"cannot read {file}: {e}") from e
    if fp8_block is None:
        return HFCheckpoint(root, config, tensors)
    _check_fp8_scales(root, tensors, scales, fp8_block)
    return HFCheckpoint(root, config, tensors, scales, fp8_block)


def _fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The scale block of an FP8 checkpoint's config (None: not an FP8 checkpoint)."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise UnsupportedModel(f"quantization method {method!r} is not supported (supported: fp8)")
    block = quant.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelConfigError(
            f"quantization_config.weight_block_size must be two positive ints, got {block!r}"
        )
    return block[0], block[1]


def _check_fp8_scales(
    root: Path, tensors: dict[str, TensorInfo], scales: dict[str, TensorInfo], block: tuple[int, int]
) -> None:
    """Every float8 weight has a scale of the right block grid, and every scale a float8 weight."""
    for name, info in tensors.items():
        scale = scales.get(name)
        if not info.dtype.startswith("F8_"):
            if scale is not None:
                raise WeightLoadError(f"{root}: {name} is {info.dtype} but has a weight_scale_inv")
            continue
        want = (
            tuple(-(-d // b) for d, b in zip(info.shape, block, strict=True))
            if len(info.shape) == 2
            else None
        )
        if scale is None or want is None or scale.shape != want:
            got = None if scale is None else scale.shape
            raise WeightLoadError(
                f"{root}: float8 {name} {info.shape} needs a {want} weight_scale_inv, found {got}"
            )
    orphans = sorted(scales.keys() - tensors.keys())
    if orphans:
        raise WeightLoadError(f"{root}: scales without a float8 weight: {_few(orphans)}")


@dataclass(frozen=True)
class _Copy:
    """One checkpoint tensor and the parameter it fills: whole, or one expert's projection of a
    fused expert parameter (expert, part as `per_expert_target` names them)."""

    name: str
    param: str
    expert: int | None = None
    part: str = ""


def _expert_shape(fused: Tensor, expert: int, part: str) -> tuple[int, ...] | None:
    """The shape one expert's `part` has in the fused parameter; None if there is no such expert."""
    if not 0 <= expert < fused.shape[0]:
        return None
    if part == "down_proj":
        return tuple(fused.shape[1:])
    return (fused.shape[1] // 2, fused.shape[2])  # gate_proj and up_proj: each half of gate_up_proj


def _pieces_in(param: str, fused: Tensor) -> int:
    """How many per-expert tensors fill a fused expert parameter (gate and up, or down, per expert)."""
    return fused.shape[0] * (1 if param.endswith((".down_proj", ".down_proj_scale_inv")) else 2)


def _plan_copies(ckpt: HFCheckpoint, model: nn.Module) -> list[_Copy]:
    """Where each checkpoint tensor goes, after checking that every parameter is filled exactly
    once, nothing is unexpected and every shape fits."""
    params = dict(model.state_dict(keep_vars=True))
    tied = tied_params(model)
    copies: list[_Copy] = []
    unexpected: list[str] = []
    # A float8 weight kept in float8 (its parameter is float8) brings its scale along.
    kept_scales = {
        name + "_scale_inv": scale
        for name, scale in ckpt.scales.items()
        if _is_fp8(ckpt.tensors[name].key, params)
    }
    for name, info in sorted({**ckpt.tensors, **kept_scales}.items()):
        if info.key in tied:
            continue
        target = per_expert_target(info.key)
        shape: tuple[int, ...] | None = None
        if info.key in params:
            copy, shape = _Copy(name, info.key), tuple(params[info.key].shape)
        elif target is not None and target[0] in params:
            copy = _Copy(name, *target)
            shape = _expert_shape(params[target[0]], target[1], target[2])
        if shape is None:
            unexpected.append(name)
        elif info.shape != shape:
            raise WeightLoadError(f"{name}: checkpoint shape {info.shape}, model expects {shape}")
        else:
            copies.append(copy)
    # every parameter filled once: whole, or (a fused expert parameter) by all of its pieces
    slots = Counter((c.param, c.expert, c.part) for c in copies)
    whole = {p for p, e, _ in slots if e is None}
    pieces = Counter(p for p, e, _ in slots if e is not None)
    twice = sorted({p for (p, _, _), n in slots.items() if n > 1} | (whole & pieces.keys()))
    complete = whole | {p for p, n in pieces.items() if n == _pieces_in(p, params[p])}
    missing = sorted(params.keys() - tied - complete)
    if unexpected or missing or twice:
        raise WeightLoadError(
            f"{ckpt.path}: checkpoint does not match the model: missing {_few(missing)}, unexpected "
            f"{_few(unexpected)}" + (f", filled twice {_few(twice)}" if twice else "")
        )
    return copies


def tied_params(model: nn.Module) -> set[str]:
    """The head where it shares the embedding: if the checkpoint also stores it, the embedding wins."""
    return (
        {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    )


def _is_fp8(key: str, params: dict[str, Tensor]) -> bool:
    """Whether the parameter a checkpoint tensor fills holds float8."""
    param = params.get(fused_param(key))
    return param is not None and param.dtype == FP8


def _few(names: list[str]) -> str:
    return f"{names[:8]}{'...' if len(names) > 8 else ''}"


def load_hf_model(
    ckpt: HFCheckpoint,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    keep_fp8: bool = False,
) -> nn.Module:
    """Build the model for ckpt.config and fill it; the caller has admitted `ckpt.weights_bytes`
    and `transient_bytes()` with the memory layer. progress: a tqdm bar (None: loads over 256 MiB)."""
    fp8_params = (ckpt.fp8_params().__contains__, ckpt.fp8_block) if keep_fp8 and ckpt.scales else None
    model = build_model(ckpt.config, dtype=dtype, device=device, fp8=fp8_params)
    copies = _plan_copies(ckpt, model)
    params = dict(model.state_dict(keep_vars=True))
    by_file: dict[Path, list[_Copy]] = {}
    for c in copies:
        by_file.setdefault(ckpt.info(c.name).file, []).append(c)
    total = ckpt.weights_bytes(dtype, keep_fp8)
    show = progress if progress is not None else total >= _PROGRESS_MIN_BYTES
    # Copies run on a few threads (copy_ releases the GIL): a load is mostly page faults and dtype
    # casts, which parallelise; the read-ahead bound keeps the transient extra a few tensors.
    workers = max(1, min(_LOAD_THREADS, os.cpu_count() or 1))
    with (
        tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not show) as bar,
        ThreadPoolExecutor(workers, thread_name_prefix="ballast-load") as pool,
    ):
        for file, file_copies in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    pending: deque[Future[int]] = deque()
                    for c in file_copies:
                        if len(pending) >= min(_READ_AHEAD, 2 * workers):  # bound what is read ahead
                            bar.update(pending.popleft().result())
                        src, scale = f.get_tensor(c.name), None
                        if c.name in ckpt.scales and params[c.param].dtype != FP8:  # dequantized as copied
                            with safe_open(str(ckpt.scales[c.name].file), framework="pt", device="cpu") as sf:
                                scale = sf.get_tensor(c.name + "_scale_inv")
                        pending.append(
                            pool.submit(_copy_into, params[c.param], c, src, scale, ckpt.fp8_block)
                        )
                    while pending:
                        bar.update(pending.popleft().result())
            except (OSError, ValueError, RuntimeError) as e:
                raise WeightLoadError(f"cannot load {file}: {e}") from e
    return model


def _copy_into(
    param: Tensor, copy: _Copy, src: Tensor, scale_inv: Tensor | None, block: tuple[int, int]
) -> int:
    """Copy src into its place, casting; returns the bytes written."""
    nbytes = src.numel() * param.element_size()
    if scale_inv is not None:
        src = dequantize_blocks(src, scale_inv, block, torch.float32)
    with torch.no_grad():
        if copy.expert is None:
            param.copy_(src)
        else:
            place_expert_tensor(param, copy.expert, copy.part, src)
    return nbytes


def load_hf_dir(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    keep_fp8: bool = False,
) -> nn.Module:
    """inspect + load in one call, for callers with nothing to admit (tests, tools)."""
    return load_hf_model(inspect_hf_dir(path), dtype=dtype, device=device, keep_fp8=keep_fp8)
