"""Tensor parallelism, Megatron style: each of N ranks (one process per device) holds a shard and
runs the same forward on the same batch. Attention, gated DeltaNet (by key heads), dense MLPs and
the shared expert are column-parallel in, row-parallel out; fewer KV heads than ranks are
replicated (a rank's query heads then fall inside one KV group); routed experts split their
intermediate dim, or under `expert_parallel` each rank holds E / N whole experts; embedding and
head are vocabulary-parallel. Each mixer and MLP ends in a partial sum, completed by one
all-reduce (a forward hook); a row-parallel bias lives on rank 0 only so it is added once.

The shard is built from a per-rank config (`shard_hf_config`), so the architectures' code runs
unchanged and its `layer_specs` describe the per-rank caches. `ShardPlan.cut` says which part of
each checkpoint tensor a rank keeps; `shard_loading` reads only that.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ballast.models.arch.registry import convert_model, materialize, model_class
from ballast.models.base import ModelConfigError, UnsupportedModel
from ballast.models.blocks.moe import Experts
from ballast.models.layers.core import linear
from ballast.models.layers.fp8 import Block
from torch import Tensor, nn


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group: rank r of world ranks."""

    rank: int
    world: int
    group: Any = None  # the torch.distributed process group (None: the default group)

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """Every rank's x, concatenated along the last dim."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _parsed(hf: Mapping[str, Any]) -> Any:
    """The architecture's own (frozen) config of the whole model."""
    with torch.device("meta"):
        return model_class(hf).from_hf_config(hf).config


def _divide(what: str, value: int, world: int) -> int:
    if value % world:
        raise UnsupportedModel(
            f"tensor parallel {world}: {what} ({value}) is not a multiple of the tensor-parallel size"
        )
    return value // world


def shard_hf_config(hf: Mapping[str, Any], world: int, expert_parallel: bool = False) -> dict[str, Any]:
    """The config of one rank's shard: heads and intermediate sizes divided by world
    (UnsupportedModel when one does not divide). The vocabulary, and under expert_parallel the
    routed experts, stay whole: they are cut after the build."""
    cfg = _parsed(hf)
    nested = isinstance(hf.get("text_config"), Mapping)  # a multimodal config: the text model's is inside
    text = dict(hf["text_config"] if nested else hf)
    text["num_attention_heads"] = _divide("num_attention_heads", cfg.num_attention_heads, world)
    kv = cfg.num_key_value_heads
    if kv >= world:
        text["num_key_value_heads"] = _divide("num_key_value_heads", kv, world)
    else:
        if world % kv:
            raise UnsupportedModel(
                f"tensor parallel {world}: num_key_value_heads ({kv}) must divide it to be replicated"
            )
        text["num_key_value_heads"] = 1
    text["head_dim"] = cfg.head_dim
    split = ["intermediate_size", "shared_expert_intermediate_size"]
    if expert_parallel:
        check_expert_parallel(int(getattr(cfg, "num_experts", 0) or 0), world)
    else:
        split.append("moe_intermediate_size")
    for name in split:
        if int(getattr(cfg, name, 0) or 0) > 0:
            text[name] = _divide(name, int(getattr(cfg, name)), world)
    if hasattr(cfg, "linear_num_key_heads"):
        text["linear_num_key_heads"] = _divide("linear_num_key_heads", cfg.linear_num_key_heads, world)
        text["linear_num_value_heads"] = _divide("linear_num_value_heads", cfg.linear_num_value_heads, world)
    return {**hf, "text_config": text} if nested else text


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them gives zeros here, and one
    all-reduce sums in the row from the rank that holds it."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.per_rank = -(-vocab // tp.world)
        self.first = tp.rank * self.per_rank
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.per_rank)
        h = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside[:, None], 0))


class VocabParallelHead(nn.Module):
    """The head's rows of this rank's vocabulary slice; every rank returns the gathered [T, vocab]."""

    def __init__(self, hidden: int, vocab: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab = vocab
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(-(-vocab // tp.world), hidden))

    def forward(self, h: Tensor) -> Tensor:
        return self.tp.all_gather_last(linear(h, self.weight))[..., : self.vocab]


@dataclass(frozen=True)
class Cut:
    """Keep `ranges` (start, stop) of dim `dim`, concatenated; pad_rows: pad with zero rows to this
    many (the vocabulary's last shard); zeros: this rank holds zeros (a row-parallel bias)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    pad_rows: int = 0
    zeros: bool = False


REPLICATE = Cut()


class ShardPlan:
    """Per parameter name, which part of the full tensor rank `rank` of `world` holds;
    expert_parallel: whole routed experts, E / world of them (see `local_name`)."""

    def __init__(self, hf: Mapping[str, Any], rank: int, world: int, expert_parallel: bool = False) -> None:
        self.cfg = _parsed(hf)
        self.rank, self.world = rank, world
        num_experts = int(getattr(self.cfg, "num_experts", 0) or 0)
        # expert parallel: (first, count) of the routed experts this rank holds whole
        self.experts = expert_range(num_experts, rank, world) if expert_parallel else None

    def local_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this shard: under expert parallel a per-expert tensor's
        index becomes the local one (None: another rank's expert); other names unchanged."""
        m = None if self.experts is None else _EXPERT_INDEX.search(name)
        if m is None or self.experts is None:
            return name
        first, count = self.experts
        local = int(m[1]) - first
        return name[: m.start()] + str(local) + name[m.end() :] if 0 <= local < count else None

    def _even(self, size: int, dim: int) -> Cut:
        n = size // self.world
        return Cut(dim, ((self.rank * n, (self.rank + 1) * n),))

    def _segments(self, sizes: tuple[int, ...], dim: int) -> Cut:
        ranges, offset = [], 0
        for size in sizes:
            n = size // self.world
            ranges.append((offset + self.rank * n, offset + (self.rank + 1) * n))
            offset += size
        return Cut(dim, tuple(ranges))

    def _kv_heads(self, size: int) -> Cut:
        kv, hd = self.cfg.num_key_value_heads, self.cfg.head_dim
        if kv >= self.world:
            return self._even(size, 0)
        head = self.rank * kv // self.world  # replicated: N / kv ranks share each KV head
        return Cut(0, ((head * hd, (head + 1) * hd),))

    def cut(self, name: str, shape: tuple[int, ...]) -> Cut:
        """The cut of the full tensor `name` (our parameter name, or an unfused per-expert name)."""
        c = self.cfg
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            per = -(-shape[0] // self.world)
            lo = min(shape[0], self.rank * per)
            return Cut(0, ((lo, min(shape[0], lo + per)),), pad_rows=per)
        parts = name.split(".")
        leaf, owner = parts[-1], parts[-2] if len(parts) > 1 else ""
        if self.experts is not None and owner != "experts" and ".mlp.experts." in name:
            return REPLICATE  # one of this rank's experts' tensors (see local_name): whole
        if leaf == "bias" and owner in ("o_proj", "down_proj", "out_proj"):
            return Cut(zeros=self.rank != 0)
        if owner == "q_proj":
            return self._even(shape[0], 0)
        if owner in ("k_proj", "v_proj"):
            return self._kv_heads(shape[0])
        if owner in ("o_proj", "out_proj", "down_proj") and len(shape) == 2:
            return self._even(shape[1], 1)
        if owner in ("gate_proj", "up_proj", "in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b"):
            return self._even(shape[0], 0)
        if owner == "in_proj_a" or leaf in ("dt_bias", "A_log"):
            return self._even(shape[0], 0)
        if owner == "experts" and self.experts is not None:  # [E, ...]: this rank's experts, whole
            return Cut(0, ((self.experts[0], sum(self.experts)),))
        if owner == "experts" and leaf == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            half = shape[1] // 2
            return self._segments((half, half), 1)
        if owner == "experts" and leaf == "down_proj":  # [E, H, I]
            return self._even(shape[2], 2)
        if owner in ("in_proj_qkv", "conv1d"):
            key = c.linear_num_key_heads * c.linear_key_head_dim
            return self._segments((key, key, c.linear_num_value_heads * c.linear_value_head_dim), 0)
        return REPLICATE


def apply_cut(cut: Cut, read: Callable[[tuple[slice, ...]], Tensor], shape: tuple[int, ...]) -> Tensor:
    """The rank's part of a tensor of `shape`, reading only its ranges through read(index)."""
    if not cut.ranges:
        whole = read(tuple(slice(None) for _ in shape))
        return torch.zeros_like(whole) if cut.zeros else whole
    pieces = []
    for lo, hi in cut.ranges:
        index = tuple(slice(lo, hi) if d == cut.dim else slice(None) for d in range(len(shape)))
        pieces.append(read(index))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=cut.dim)
    if cut.pad_rows > out.shape[0]:
        out = torch.cat([out, out.new_zeros((cut.pad_rows - out.shape[0], *out.shape[1:]))])
    return out


# Expert parallel: rank r of N holds whole routed experts [r * E / N, (r + 1) * E / N). The router
# stays replicated, so every rank picks the same top-k; a rank computes only the pairs of its own
# experts (the others add zero, `moe.local_expert_ids`), and the all-reduce that already ends the
# MoE block adds the ranks' parts: no extra collective, no host sync. Why both splits: slicing
# every expert makes the GEMMs N times thinner (Qwen3-Next at N = 8: 64 columns, which also cuts
# the FP8 128 x 128 scale blocks, so a float8 load is refused); whole experts keep GEMMs and scale
# blocks whole, at the price of load imbalance.

_EXPERT_INDEX = re.compile(r"(?<=\.mlp\.experts\.)(\d+)(?=\.)")


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
    """On the meta device, cut every `Experts` module to this rank's whole experts."""
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        first, count = expert_range(module.gate_up_proj.shape[0], rank, world)
        for name in ("gate_up_proj", "down_proj"):
            full: Tensor = getattr(module, name)
            setattr(module, name, nn.Parameter(full.new_empty((count, *full.shape[1:]))))
        module.first = first


Fp8Spec = tuple[Callable[[str], bool], Block]  # which parameters hold float8, and their scale block


def shard_on_meta(
    hf: Mapping[str, Any],
    tp: TPGroup,
    dtype: torch.dtype,
    fp8: Fp8Spec | None = None,
    expert_parallel: bool = False,
) -> nn.Module:
    """Rank tp.rank's shard on the meta device, parameters in dtype (`fp8` names in float8)."""
    cls = model_class(hf)
    with torch.device("meta"):
        model: nn.Module = cls.from_hf_config(shard_hf_config(hf, tp.world, expert_parallel))
        if expert_parallel:
            hold_local_experts(model, tp.rank, tp.world)
        cfg: Any = model.config
        vocab, hidden = int(cfg.vocab_size), int(cfg.hidden_size)
        inner: Any = model.model
        inner.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp)
        model.lm_head = VocabParallelHead(hidden, vocab, tp)
        model = model.to(dtype)
        if fp8 is not None:
            convert_model(model, *fp8)
        tie = getattr(model, "tie_weights", None)
        if tie is not None:
            tie()
    return model


def build_shard(
    hf: Mapping[str, Any],
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    fp8: Fp8Spec | None = None,
    expert_parallel: bool = False,
) -> nn.Module:
    """Rank tp.rank's shard on device, uninitialised, each mixer and MLP ending in its all-reduce."""
    model = materialize(shard_on_meta(hf, tp, dtype, fp8, expert_parallel), device)
    _reduce_partial_sums(model, tp)
    return model


def _reduce_partial_sums(model: nn.Module, tp: TPGroup) -> None:

    def reduce(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return tp.all_reduce(out)

    inner: Any = model.model
    for layer in inner.layers:
        for name in ("self_attn", "linear_attn", "mlp"):
            part = getattr(layer, name, None)
            if isinstance(part, nn.Module):
                part.register_forward_hook(reduce)


def shard_weights_bytes(
    hf: Mapping[str, Any],
    world: int,
    dtype: torch.dtype,
    fp8: Fp8Spec | None = None,
    expert_parallel: bool = False,
) -> int:
    """Bytes one rank's shard holds, from the configs alone (meta device), for admission per die."""
    model = shard_on_meta(hf, TPGroup(0, world), dtype, fp8, expert_parallel)
    # parameters() yields a tied parameter once
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_tensor_parallel(hf: Mapping[str, Any], world: int, expert_parallel: bool = False) -> None:
    """Raise UnsupportedModel / ModelConfigError unless this model splits over world ranks."""
    if world < 1:
        raise ModelConfigError(f"tensor-parallel size must be >= 1, got {world}")
    if world > 1:
        shard_hf_config(hf, world, expert_parallel)
