"""Filling a tensor-parallel shard (built by `parallel.build_shard`) with its part of each tensor:
from a whole model's state dict, or from an HF safetensors directory, reading only the rank's
slices (`parallel.ShardPlan` says which)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from ballast.models.base import WeightLoadError
from ballast.models.fp8 import FP8
from ballast.models.fp8_shards import fp8_part
from ballast.models.hf_loader import HFCheckpoint
from ballast.models.moe import per_expert_target, place_expert_tensor
from ballast.models.parallel import ShardPlan, apply_cut
from safetensors import safe_open
from torch import Tensor, nn


def _tied(model: nn.Module) -> set[str]:
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def load_full_into_shard(model: nn.Module, full: Mapping[str, Tensor], plan: ShardPlan) -> None:
    """Fill a shard from a whole model's state dict (built-in random models: small by design)."""
    params = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, param in params.items():
            if name in _tied(model):
                continue
            src = full[name]
            cut = plan.cut(name, tuple(src.shape))
            part = apply_cut(cut, src.__getitem__, tuple(src.shape))
            if cut.rank0_only and plan.rank != 0:
                part = torch.zeros_like(part)
            param.copy_(part)


def load_hf_shard(model: nn.Module, ckpt: HFCheckpoint, plan: ShardPlan) -> None:
    """Fill a shard from an HF safetensors directory, reading only this rank's slices. A float8
    weight fills a float8 parameter with its scales (the shard was built with `fp8`), or is
    dequantized into the model's dtype."""
    params = dict(model.state_dict(keep_vars=True))
    tied = _tied(model)
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
                        part = apply_cut(cut, read, info.shape)
                        if cut.rank0_only and plan.rank != 0:
                            part = torch.zeros_like(part)
                        _place(params, key, part, name, filled, ckpt)
                        continue
                    keep = _param_of(params, key).dtype == FP8
                    scale_name = name + "_scale_inv"
                    part, scales = fp8_part(
                        cut, (info, name, read), (scale, scale_name), ckpt.fp8_block, keep
                    )
                    _place(params, key, part, name, filled, ckpt)
                    if scales is not None:
                        scale_key = plan.local_name(scale.key)
                        assert scale_key is not None  # the same expert as its weight
                        _place(params, scale_key, scales, scale_name, filled, ckpt)
    missing = sorted(params.keys() - tied - filled)
    if missing:
        raise WeightLoadError(f"{ckpt.path}: checkpoint lacks {missing[:8]}")


def _param_of(params: Mapping[str, Tensor], key: str) -> Tensor:
    target = per_expert_target(key)
    name = key if target is None else target[0]
    if name not in params:
        raise WeightLoadError(f"tensor {key} has no place in the model")
    return params[name]


def _place(
    params: Mapping[str, Tensor], key: str, part: Tensor, name: str, filled: set[str], ckpt: HFCheckpoint
) -> None:
    """Copy a rank's part of checkpoint tensor `name` (model name `key`) into its parameter, or
    into its expert's place in a fused expert parameter."""
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
