"""Prefix checkpoints and parked sequences on the other ranks of a tensor-parallel engine.

Rank 0's `PrefixCache` decides everything; each slot-state copy it makes is recorded as a
`CheckpointOp` in the same journal as the KV stores' changes, and every worker makes the same copy
of its shard, in journal order, before the next forward. One ordered journal matters: a parked
sequence's blocks must be read before a later change in it (a block copy, a compaction) reuses them.
On CUDA the copies run on the step stream, with no host wait: the pinned buffers are torch's cached
host allocations, not handed out again before the copies that used them have run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ballast.models.kv_store import KVStore
from ballast.models.layers.state import LayerState
from torch import Tensor


@dataclass(frozen=True)
class CheckpointOp:
    """One slot-state copy rank 0's prefix cache made. `key` names the checkpoint or parked
    sequence (unique for the engine's life); `store` and `blocks` (park, unpark) say which KV
    store's blocks hold the parked positions."""

    kind: str  # save | restore | park | unpark | drop
    key: int
    slot: int = -1
    store: int = 0
    blocks: tuple[int, ...] = ()


class ShardCheckpoints:
    """A worker's copies of its shard's checkpoints and parked sequences, by rank 0's keys."""

    def __init__(self, states: Sequence[LayerState], stores: Sequence[KVStore], device: torch.device) -> None:
        self._states = list(states)
        self._stores = list(stores)
        self._pin = device.type == "cuda"
        self._held: dict[int, list[Tensor]] = {}

    def apply(self, op: CheckpointOp) -> None:
        if op.kind == "save":
            self._held[op.key] = self._copy_out(self._slot_views(op.slot))
        elif op.kind == "park":
            self._held[op.key] = self._copy_out(self._slot_views(op.slot) + self._block_views(op))
        elif op.kind == "restore":
            self._copy_in(self._held[op.key], self._slot_views(op.slot))
        elif op.kind == "unpark":
            self._copy_in(self._held.pop(op.key), self._slot_views(op.slot) + self._block_views(op))
        elif op.kind == "drop":
            self._held.pop(op.key, None)
        else:
            raise ValueError(f"unknown checkpoint op {op.kind!r}")

    def _slot_views(self, slot: int) -> list[Tensor]:
        return [v for s in self._states for v in s.slot_views(slot)]

    def _block_views(self, op: CheckpointOp) -> list[Tensor]:
        store = self._stores[op.store]
        return [v for b in op.blocks for v in store.block_views(b)]

    def _copy_out(self, views: Sequence[Tensor]) -> list[Tensor]:
        out = []
        for v in views:
            host = torch.empty(v.shape, dtype=v.dtype, pin_memory=self._pin)
            host.copy_(v, non_blocking=self._pin)
            out.append(host)
        return out

    def _copy_in(self, saved: Sequence[Tensor], views: Sequence[Tensor]) -> None:
        if len(saved) != len(views):
            raise ValueError(f"a checkpoint of {len(saved)} tensors restored into {len(views)}")
        for dst, src in zip(views, saved, strict=True):
            dst.copy_(src, non_blocking=self._pin)
