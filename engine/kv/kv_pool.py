"""The KV block pool: the allocator's bookkeeping and the store's memory, kept in step.

Slots take blocks as they grow (`ensure`) and give them back (`release`); the prefix cache holds
blocks by reference (`hold` / `drop`) and a later slot starts from them (`attach`). Segments are
added as the memory layer grants them (`acquire`) and given back whole (`shrink`). Everything runs
on the engine thread between steps, so no block an executing kernel reads is freed or moved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from ballast.engine.kv.blocks import BlockAllocator, blocks_for
from ballast.engine.plan import KVFigures
from ballast.memory.host_book import HostGrant
from ballast.memory.types import MiB
from ballast.models.kv_store import SINK_BLOCK, KVStore
from ballast.models.layers.attention import PagedAttentionBackend
from ballast.models.layers.state import paged_attention

log = logging.getLogger(__name__)

# Grants the bytes of one more segment and returns how to give them back, or None (refused).
Acquire = Callable[[int], Callable[[], None] | None]


def _unlimited(nbytes: int) -> Callable[[], None]:
    return lambda: None


class KVPool:
    def __init__(self, store: KVStore, acquire: Acquire | None = None) -> None:
        self.store = store
        self.layout = store.layout
        self.alloc = BlockAllocator(self.layout.seg_blocks, self.layout.max_segments, reserved=SINK_BLOCK + 1)
        self._acquire = acquire or _unlimited
        self._give_back: dict[int, Callable[[], None]] = {}  # segment -> its grant's release
        self.refused = 0  # segments the memory layer would not grant

    # --- figures --------------------------------------------------------------------------
    def figures(self) -> KVFigures:
        a, lay = self.alloc, self.layout
        return KVFigures(
            lay.block_size,
            lay.block_bytes,
            a.free_blocks,
            a.used_blocks,
            len(a.segments),
            a.addable_segments * lay.seg_blocks,
            self.store.bytes_held,
            a.held_only_blocks,
        )

    @property
    def bytes_held(self) -> int:
        return self.store.bytes_held

    def table(self, slot: int) -> list[int]:
        return self.alloc.table(slot)

    # --- slots ----------------------------------------------------------------------------
    def ensure(self, slot: int, n_tokens: int) -> bool:
        """Grow the slot's table to hold n_tokens positions, adding segments as needed and granted.
        False (nothing changed) when the blocks cannot be had."""
        have = len(self.alloc.table(slot))
        need = blocks_for(n_tokens, self.layout.block_size) - have
        if need <= 0:
            return True
        if need > self.layout.max_blocks_per_seq - have or not self.reserve(need):
            return False
        self.store.set_table(slot, have, self.alloc.grow(slot, have + need))
        return True

    def reserve(self, n_blocks: int) -> bool:
        """Make n_blocks free, adding granted segments; False if the memory layer says no."""
        while self.alloc.free_blocks < n_blocks:
            if not self._add_segment():
                return False
        return True

    def release(self, slot: int) -> None:
        """The slot's sequence ended (or moved out): its blocks lose the slot's reference, and
        its table row points at the sink again."""
        if self.alloc.count(slot):
            self.alloc.release(slot)
            self.store.clear_table(slot)

    def truncate(self, slot: int, n_tokens: int) -> None:
        """Keep only the blocks of the slot's first n_tokens positions (the rest were a rejected
        draft's). The table row past them is never read: a sequence attends to what it was fed."""
        self.alloc.truncate(slot, blocks_for(n_tokens, self.layout.block_size))

    def attach(self, slot: int, blocks: Sequence[int], n_tokens: int) -> bool:
        """Start the (empty) slot on `blocks` (its first n_tokens positions) by reference, copying a
        partly filled last block the slot will write into; False (nothing attached) if none is free."""
        bs = self.layout.block_size
        if len(blocks) != blocks_for(n_tokens, bs):
            raise ValueError(f"{len(blocks)} blocks for {n_tokens} tokens of block size {bs}")
        partial = n_tokens % bs != 0
        if partial and not self.reserve(1):
            return False
        self.alloc.attach(slot, blocks)
        if partial:
            fresh = self.alloc.take()
            self.store.copy_block(blocks[-1], fresh)
            self.alloc.replace(slot, len(blocks) - 1, fresh)
        self.store.set_table(slot, 0, self.alloc.table(slot))
        return True

    # --- holds (prefix cache) ----------------------------------------------------------------
    def hold(self, slot: int, n_tokens: int) -> tuple[int, ...]:
        """One more reference to the blocks holding the slot's first n_tokens positions."""
        blocks = self.alloc.table(slot)[: blocks_for(n_tokens, self.layout.block_size)]
        self.alloc.hold(blocks)
        return tuple(blocks)

    def drop(self, blocks: Sequence[int]) -> None:
        self.alloc.drop(blocks)

    # --- segments -------------------------------------------------------------------------
    def compact(self) -> dict[int, int]:
        """Pack the blocks in use into the lowest segments so `shrink` can give back the rest.
        Returns the moves: holders of block ids outside the tables (the prefix cache) follow them."""
        rows = range(self.layout.table_rows)
        slots_before = {slot: self.alloc.table(slot) for slot in rows if self.alloc.count(slot)}
        moves = self.alloc.compact()
        for src, dst in moves.items():
            self.store.copy_block(src, dst)
        for slot, before in slots_before.items():
            after = self.alloc.table(slot)
            if after != before:
                self.store.set_table(slot, 0, after)
        return moves

    def has_surplus(self, keep_free_blocks: int) -> bool:
        """The free blocks beyond `keep_free_blocks` fill a segment `shrink` could give back."""
        return self.alloc.free_blocks - keep_free_blocks >= self.layout.seg_blocks

    def shrink(self, keep_free_blocks: int = 0) -> int:
        """Give back every segment with no block in use, keeping `keep_free_blocks` free blocks at
        least; returns the bytes released."""
        gone = self.alloc.remove_free_segments(keep_free=keep_free_blocks)
        if not gone:
            return 0
        self.store.release_segments(gone)
        for seg in gone:
            self._give_back.pop(seg)()
        released = len(gone) * self.layout.segment_bytes
        log.info("KV pool: %d segment(s) released, %.1f MiB", len(gone), released / MiB)
        return released

    def _add_segment(self) -> bool:
        if self.alloc.addable_segments == 0:
            return False
        give_back = self._acquire(self.layout.segment_bytes)
        if give_back is None:
            self.refused += 1
            return False
        seg = self.alloc.add_segment()
        try:
            self.store.add_segment(seg)
        except (RuntimeError, MemoryError) as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
            # The grant said yes but the allocator could not deliver (fragmentation, another
            # process): a refusal like any other, never an OOM reaching a request.
            self.alloc.remove_segment(seg)
            give_back()
            self.refused += 1
            log.warning(
                "KV segment of %.1f MiB could not be allocated: %s", self.layout.segment_bytes / MiB, e
            )
            return False
        if isinstance(give_back, HostGrant):
            # The store wrote the segment's pages just now: from the next poll on, the host's
            # figures show them, and the grant stops counting against the snapshots after it.
            give_back.committed()
        self._give_back[seg] = give_back
        return True

    def close(self) -> None:
        for give_back in self._give_back.values():
            give_back()
        self._give_back.clear()
        self.store.close()


class KVManager:
    """A model's KV pools: the main one and, unless that is int8 already, an int8 pool for the
    sequences the ladder starts quantized at WATCH and worse (running ones keep their format).
    Which pool each slot lives in is kept here and in the device table (`int8_slots`)."""

    def __init__(self, main: KVPool, int8: KVPool | None = None) -> None:
        self.main = main
        self.int8 = int8
        self._in_int8: set[int] = set()
        lay = main.layout
        self.int8_slots = torch.zeros(lay.table_rows, dtype=torch.bool, device=main.store.device)

    @property
    def pools(self) -> list[KVPool]:
        return [self.main] if self.int8 is None else [self.main, self.int8]

    @property
    def stores(self) -> list[KVStore]:
        """The pools' stores; a tensor-parallel journal names a store by its index here."""
        return [p.store for p in self.pools]

    def attention(self) -> PagedAttentionBackend:
        """The attention backend over these stores, for the model's states."""
        int8 = self.int8.store if self.int8 is not None else None
        return paged_attention(self.main.store, int8, self.int8_slots if int8 is not None else None)

    def journal_to(self, journal: list[Any]) -> None:
        """Record every store change in `journal` (tensor parallel: the workers replay it)."""
        for i, store in enumerate(self.stores):
            store.journal = journal
            store.journal_index = i

    def pool_of(self, slot: int) -> KVPool:
        return self.int8 if self.int8 is not None and slot in self._in_int8 else self.main

    def in_int8(self, slot: int) -> bool:
        return slot in self._in_int8

    def holds_int8(self, slots: Iterable[int]) -> bool:
        """Whether a sequence of these (a step's) lives in the int8 pool."""
        return bool(self._in_int8) and not self._in_int8.isdisjoint(slots)

    @property
    def int8_list(self) -> list[int]:
        return sorted(self._in_int8)

    def held(self, slot: int) -> int:
        """Blocks the slot's tables hold, in every pool."""
        return sum(p.alloc.count(slot) for p in self.pools)

    def place(self, slots: Sequence[int], int8: Sequence[bool]) -> None:
        """New sequences in these (empty) slots: in the int8 pool where asked and there is one."""
        if self.int8 is not None:
            self.set_int8(self._in_int8 | {s for s, q in zip(slots, int8, strict=False) if q})

    def release(self, slots: Sequence[int]) -> None:
        """The slots' sequences are gone: blocks back to their pools, slots back to the main pool."""
        for slot in slots:
            for pool in self.pools:
                pool.release(slot)
        self.set_int8(self._in_int8.difference(slots))

    def set_int8(self, slots: Iterable[int]) -> None:
        """Exactly these slots' sequences live in the int8 pool (a tensor-parallel worker mirrors
        rank 0's this way); the device table changes only where membership does."""
        now = set(slots)
        for value, changed in ((True, now - self._in_int8), (False, self._in_int8 - now)):
            if changed:
                self.int8_slots[torch.tensor(sorted(changed), device=self.int8_slots.device)] = value
        self._in_int8 = now
