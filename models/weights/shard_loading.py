"""Filling a tensor-parallel shard with its part of each tensor (`parallel.ShardPlan`): from a whole
model's state dict, or from an HF safetensors directory, reading only the rank's slices.

A float8 weight's part keeps the scales that cover exactly its ranges, so a split must fall on
whole scale blocks (a range may end inside the dim's last, partial block). Where the rank keeps
float8 a split inside a block is refused (`UnsupportedModel`); where it dequantizes at load, such
a weight is read whole, dequantized and then cut.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from ballast.models.arch.parallel import Cut, ShardPlan, apply_cut
from ballast.models.base import UnsupportedModel, WeightLoadError
from ballast.models.blocks.moe import fused_param, per_expert_target, place_expert_tensor
from ballast.models.layers.fp8 import FP8, Block, dequantize_blocks
from ballast.models.weights.hf_loader import HFCheckpoint, TensorInfo, tied_params
from safetensors import safe_open
from torch import Tensor, nn

Read = Callable[[tuple[slice, ...]], Tensor]


def load_full_into_shard(model: nn.Module, full: Mapping[str, Tensor], plan: ShardPlan) -> None:
    """Fill a shard from a whole model's state dict (built-in random models: small by design)."""
    params = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, param in params.items():
            if name in tied_params(model):
                continue
            src = full[name]
            cut = plan.cut(name, tuple(src.shape))
            param.copy_(apply_cut(cut, src.__getitem__, tuple(src.shape)))


def load_hf_shard(model: nn.Module, ckpt: HFCheckpoint, plan: ShardPlan) -> None:
    """Fill a shard from an HF safetensors directory, reading only this rank's slices (a float8
    weight keeps its scales where its parameter is float8, else is dequantized)."""
    params = dict(model.state_dict(keep_vars=True))
    tied = tied_params(model)
    filled: set[str] = set()
    by_file: dict[Any, list[str]] = {}
    for name, info in ckpt.tensors.items():
        by_file.setdefault(info.file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    info = ckpt.tensors[name]
                    key = plan.local_name(info.key)
                    if key is None or key in tied:  # another rank's expert, or the tied head
                        continue
                    read = f.get_slice(name).__getitem__  # a safetensors slice reads only those bytes
                    cut = plan.cut(key, info.shape)
                    scale = ckpt.scales.get(name)
                    if scale is None:
                        _place(params, key, apply_cut(cut, read, info.shape), name, filled, ckpt)
                        continue
                    keep = fused_param(key) in params and params[fused_param(key)].dtype == FP8
                    part, scales = fp8_part(cut, info, name, read, scale, ckpt.fp8_block, keep)
                    _place(params, key, part, name, filled, ckpt)
                    if scales is not None:
                        scale_key = plan.local_name(scale.key)
                        assert scale_key is not None  # the same expert as its weight
                        _place(params, scale_key, scales, name + "_scale_inv", filled, ckpt)
    missing = sorted(params.keys() - tied - filled)
    if missing:
        raise WeightLoadError(f"{ckpt.path}: checkpoint lacks {missing[:8]}")


def _place(
    params: Mapping[str, Tensor], key: str, part: Tensor, name: str, filled: set[str], ckpt: HFCheckpoint
) -> None:
    """Copy a rank's part of `name` (model name `key`) into its parameter or its expert's place."""
    target = per_expert_target(key)
    if key in params:
        if params[key].shape != part.shape:
            raise WeightLoadError(
                f"{name}: shard shape {tuple(part.shape)}, model expects {tuple(params[key].shape)}"
            )
        params[key].copy_(part)
        filled.add(key)
    elif target is not None and target[0] in params:
        place_expert_tensor(params[target[0]], target[1], target[2], part)
        filled.add(target[0])
    else:
        raise WeightLoadError(f"{ckpt.path}: tensor {name} has no place in the model")


def scale_ranges(
    dim: int, ranges: tuple[tuple[int, int], ...], shape: tuple[int, ...], block: Block
) -> tuple[tuple[int, int], ...] | None:
    """The ranges of the scale grid that cover `ranges` of the weight's dim `dim` exactly; None
    when a range starts or ends inside a block (a leading dim has one scale per index)."""
    nd = len(shape)
    b = block[0] if dim == nd - 2 else block[1] if dim == nd - 1 else 1
    out = []
    for lo, hi in ranges:
        if lo % b or (hi % b and hi != shape[dim]):
            return None
        out.append((lo // b, -(-hi // b)))
    return tuple(out)


def fp8_part(
    cut: Cut, info: TensorInfo, name: str, read_weight: Read, scale_info: TensorInfo, block: Block, keep: bool
) -> tuple[Tensor, Tensor | None]:
    """The rank's part of float8 weight `name`: (part, its scales) if `keep`, else (dequantized, None)."""
    covering = scale_ranges(cut.dim, cut.ranges, info.shape, block) if cut.ranges else ()
    with safe_open(str(scale_info.file), framework="pt", device="cpu") as f:
        scale_slice = f.get_slice(name + "_scale_inv")
        if covering is None:
            if keep:
                raise UnsupportedModel(
                    f"tensor parallel: {name} {info.shape} would be split at {cut.ranges} of dim "
                    f"{cut.dim}, inside its {block[0]} x {block[1]} FP8 scale blocks; choose a "
                    "tensor-parallel size that splits it on whole blocks, or --fp8-weights dequantize"
                )
            everything = tuple(slice(None) for _ in info.shape)
            whole = dequantize_blocks(read_weight(everything), scale_slice[everything], block, torch.float32)
            return apply_cut(cut, lambda index: whole[index], info.shape), None
        part = apply_cut(cut, read_weight, info.shape)
        scale_cut = replace(cut, ranges=covering)
        scales: Tensor = apply_cut(scale_cut, lambda index: scale_slice[index], scale_info.shape)
    if keep:
        return part, scales
    return dequantize_blocks(part, scales, block, torch.float32), None
