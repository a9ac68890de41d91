"""Expert parallel: under tensor parallel, rank r of N holds whole routed experts
[r * E / N, (r + 1) * E / N) instead of a 1/N slice of every expert's intermediate dim.

The router stays replicated, so every rank picks the same top-k of all E experts for a token;
each rank computes only the (token, expert) pairs whose expert it holds (the others add zero,
`moe.local_expert_ids`) and the all-reduce that already ends the MoE block (the shared expert's
row-parallel partial sum) adds the ranks' routed parts too. No extra collective, no host sync.

Why have both splits: sharding every expert makes each rank's expert GEMMs N times thinner (for
Qwen3-Next's 512 experts of intermediate 512 at N = 8: 64 columns, which also cuts every FP8
128 x 128 scale block, so a float8 load is refused), while whole experts keep the GEMMs and the
scale blocks whole; the price is load imbalance (a rank's share of a batch's pairs varies).

A checkpoint's experts come fused ([E, ...] tensors: a rank reads rows [first, first + count)
of dim 0, with the scales of those experts) or one tensor per expert (`experts.{e}.*`: a rank
reads only its own experts' tensors, whole, renamed to their local index).
"""

from __future__ import annotations

import re

import torch
from ballast.models.base import UnsupportedModel
from ballast.models.moe import Experts
from torch import nn


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count): the routed experts rank `rank` of `world` holds."""
    count = num_experts // world
    return rank * count, count


def check_expert_parallel(num_experts: int, world: int) -> None:
    """Raise UnsupportedModel unless num_experts routed experts split evenly over world ranks."""
    if num_experts <= 0:
        raise UnsupportedModel("--expert-parallel: this model has no routed experts")
    if num_experts % world:
        raise UnsupportedModel(
            f"--expert-parallel over {world} ranks: num_experts ({num_experts}) is not a multiple of "
            "the tensor-parallel size"
        )


def hold_local_experts(model: nn.Module, rank: int, world: int) -> None:
    """On the meta device, give every `Experts` module only this rank's experts: fused tensors of
    E / world experts (whole intermediate dims) and the index of its first one."""
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        first, count = expert_range(module.gate_up_proj.shape[0], rank, world)
        for name in ("gate_up_proj", "down_proj"):
            full: torch.Tensor = getattr(module, name)
            setattr(module, name, nn.Parameter(full.new_empty((count, *full.shape[1:]))))
        module.first = first


_EXPERT_INDEX = re.compile(r"(?<=\.mlp\.experts\.)(\d+)(?=\.)")


class LocalExperts:
    """Which checkpoint tensors of routed experts a rank reads under expert parallel."""

    def __init__(self, num_experts: int, rank: int, world: int) -> None:
        self.first, self.count = expert_range(num_experts, rank, world)

    def local_name(self, name: str) -> str | None:
        """An unfused `....mlp.experts.{e}.*` name -> the same name with this rank's index of
        expert e, or None when another rank holds e; any other name unchanged."""
        m = _EXPERT_INDEX.search(name)
        if m is None:
            return name
        local = int(m[1]) - self.first
        if not 0 <= local < self.count:
            return None
        return name[: m.start()] + str(local) + name[m.end() :]

    def fused_rows(self) -> tuple[tuple[int, int], ...]:
        """The rows of dim 0 of a fused [E, ...] expert tensor this rank keeps."""
        return ((self.first, self.first + self.count),)
