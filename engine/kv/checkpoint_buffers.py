"""Slot states in one host buffer: where each tensor lies in it, and the journal that tells the other
tensor-parallel ranks to make the same copies of their shards.

Each tensor gets a segment at an aligned offset, so any dtype can be viewed there and CUDA copies
stay on their fast path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from ballast.engine.kv.shard_checkpoints import CheckpointOp
from ballast.memory.pool import CheckpointPool
from ballast.models.layers.state import LayerState
from torch import Tensor

_ALIGN = 64

# Per tensor: (offset, dtype, shape) of the segment holding it.
Segments = tuple[tuple[int, torch.dtype, torch.Size], ...]


def layout(views: Sequence[Sequence[Tensor]]) -> tuple[tuple[Segments, ...], int]:
    """Per layer, the segments of its tensors; and the bytes of the whole buffer."""
    off = 0
    out = []
    for layer_views in views:
        segs = []
        for t in layer_views:
            off = -(-off // _ALIGN) * _ALIGN
            segs.append((off, t.dtype, t.shape))
            off += t.numel() * t.element_size()
        out.append(tuple(segs))
    return tuple(out), off


def segment(buf: Tensor, off: int, dtype: torch.dtype, shape: torch.Size) -> Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return buf[off : off + nbytes].view(dtype).view(shape)


def checkpoint_bytes(states: Sequence[LayerState]) -> int:
    """Bytes of one checkpoint's copy of a slot's recurrent states (0: attention only)."""
    return layout([s.slot_views(0) for s in states])[1] if states else 0


def host_buffer(pool: CheckpointPool | None, nbytes: int, pin: bool) -> Tensor:
    """A 1-D uint8 buffer of at least nbytes (RuntimeError / MemoryError when none can be had: the
    pool has trimmed itself and retried once by then)."""
    if pool is not None:
        return pool.get(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class CheckpointJournal:
    """Under tensor parallel, every copy rank 0 makes of a slot state (`ops`, the sharded runner's
    list; None on one rank), so each other rank copies its shard alike; and the keys naming what
    each save or park holds, unique for the engine's life."""

    def __init__(self) -> None:
        self.ops: list[object] | None = None
        self._next_key = 0

    def record(
        self, kind: str, slot: int, store: int = 0, blocks: Sequence[int] = (), key: int | None = None
    ) -> int:
        """Journal one copy (store: 0 the main KV store, 1 the int8 one); returns the key naming
        what it saves or parks (a new one unless given)."""
        if key is None:
            self._next_key += 1
            key = self._next_key
        if self.ops is not None:
            self.ops.append(CheckpointOp(kind, key, slot, store, tuple(blocks)))
        return key

    def drop(self, key: int) -> None:
        """What `key` names is given back (its buffer, here and on the other ranks)."""
        if self.ops is not None:
            self.ops.append(CheckpointOp("drop", key))
