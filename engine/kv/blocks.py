"""The KV block allocator: which fixed-size blocks exist, who holds each, and every slot's block table.

Pure bookkeeping (no tensors), so a property test can run thousands of random histories.
Blocks live in segments of `seg_blocks` consecutive ids, added when the free blocks run out and
removed when all their blocks are free. Free blocks go out lowest id first, so live blocks pack
into the low segments and the high ones empty out, ready to be given back. A block is referenced
once per slot table listing it and once per `hold` (the prefix cache's); with none it is free.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence


class BlockError(RuntimeError):
    """A block or slot was used against the allocator's state (a bug, never a client error)."""


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens."""
    return -(-n_tokens // block_size)


class BlockAllocator:
    def __init__(self, seg_blocks: int, max_segments: int, reserved: int = 0) -> None:
        """reserved: block ids below this are never handed out (the store's sink block)."""
        if seg_blocks < 1 or max_segments < 1 or not 0 <= reserved < seg_blocks:
            raise ValueError(
                f"need seg_blocks >= 1, max_segments >= 1, 0 <= reserved < seg_blocks; got "
                f"{seg_blocks}, {max_segments}, {reserved}"
            )
        self.seg_blocks = seg_blocks
        self.max_segments = max_segments
        self.reserved = reserved
        self._segments: set[int] = set()
        self._free: list[int] = []  # min-heap of free block ids in live segments
        self._refs: dict[int, int] = {}  # block -> references, for blocks in use only
        self._used_in: dict[int, int] = {}  # segment -> blocks in use
        self._tables: dict[int, list[int]] = {}  # slot -> its blocks in position order
        self._in_tables: dict[int, int] = {}  # block -> slot tables listing it (blocks in use only)
        self._held_only = 0  # blocks in use that no slot lists: only holds (the prefix cache) keep them

    # --- figures --------------------------------------------------------------------------
    @property
    def segments(self) -> frozenset[int]:
        return frozenset(self._segments)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return len(self._refs)

    @property
    def held_only_blocks(self) -> int:
        """Blocks kept only by holds, none by a slot: what dropping every hold would free."""
        return self._held_only

    @property
    def total_blocks(self) -> int:
        """Blocks of the live segments that sequences can have (reserved ones excluded)."""
        return len(self._segments) * self.seg_blocks - (self.reserved if 0 in self._segments else 0)

    @property
    def addable_segments(self) -> int:
        return self.max_segments - len(self._segments)

    def table(self, slot: int) -> list[int]:
        """The slot's blocks (a copy); empty for a slot that holds none."""
        return list(self._tables.get(slot, ()))

    def count(self, slot: int) -> int:
        return len(self._tables.get(slot, ()))

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    # --- segments -------------------------------------------------------------------------
    def add_segment(self) -> int:
        """Make the lowest absent segment live; its blocks become free. Returns its index."""
        seg = next((s for s in range(self.max_segments) if s not in self._segments), None)
        if seg is None:
            raise BlockError(f"all {self.max_segments} segments are live")
        self._segments.add(seg)
        self._used_in[seg] = 0
        for b in range(max(seg * self.seg_blocks, self.reserved), (seg + 1) * self.seg_blocks):
            heapq.heappush(self._free, b)
        return seg

    def remove_free_segments(self, keep: int = 0, keep_free: int = 0) -> list[int]:
        """Remove segments none of whose blocks is in use, highest first, keeping `keep` segments
        live and `keep_free` blocks free at least. Returns the removed indices (their memory can go)."""
        empty = sorted((s for s in self._segments if self._used_in[s] == 0), reverse=True)
        removable = max(0, len(self._segments) - keep)
        gone: list[int] = []
        free = len(self._free)
        for seg in empty[:removable]:
            blocks = self.seg_blocks - (self.reserved if seg == 0 else 0)
            if free - blocks < keep_free:
                break
            gone.append(seg)
            free -= blocks
        if gone:
            for s in gone:
                self._segments.remove(s)
                del self._used_in[s]
            dead = set(gone)
            self._free = [b for b in self._free if b // self.seg_blocks not in dead]
            heapq.heapify(self._free)
        return gone

    def compact(self) -> dict[int, int]:
        """Move blocks in use out of the highest segments into free blocks of the lowest, tables and
        references following. Returns the moves (old -> new) for the caller to copy the contents."""
        if not self._refs:
            return {}
        needed = -(-(len(self._refs) + self.reserved) // self.seg_blocks)
        keep = sorted(self._segments)[:needed]
        if not keep:
            return {}
        cutoff = (keep[-1] + 1) * self.seg_blocks
        movers = sorted((b for b in self._refs if b >= cutoff), reverse=True)
        spots = sorted(b for b in self._free if b < cutoff)
        moves = dict(zip(movers, spots, strict=False))
        if not moves:
            return {}
        for src, dst in moves.items():
            self._refs[dst] = self._refs.pop(src)
            self._in_tables[dst] = self._in_tables.pop(src)
            self._used_in[src // self.seg_blocks] -= 1
            self._used_in[dst // self.seg_blocks] += 1
        taken = set(moves.values())
        self._free = [b for b in self._free if b not in taken] + list(moves)
        heapq.heapify(self._free)
        for table in self._tables.values():
            table[:] = [moves.get(b, b) for b in table]
        return moves

    def remove_segment(self, seg: int) -> None:
        """Remove one live segment none of whose blocks is in use."""
        if seg not in self._segments or self._used_in[seg]:
            raise BlockError(f"segment {seg} is not live and free")
        self._segments.remove(seg)
        del self._used_in[seg]
        self._free = [b for b in self._free if b // self.seg_blocks != seg]
        heapq.heapify(self._free)

    # --- blocks ---------------------------------------------------------------------------
    def grow(self, slot: int, n_blocks: int) -> list[int]:
        """Append blocks to the slot's table until it holds n_blocks; returns the new ones.
        Raises BlockError when there are not enough free blocks (callers check `free_blocks`)."""
        table = self._tables.setdefault(slot, [])
        need = n_blocks - len(table)
        if need <= 0:
            return []
        if need > len(self._free):
            raise BlockError(f"slot {slot} needs {need} blocks, {len(self._free)} free")
        new = [heapq.heappop(self._free) for _ in range(need)]
        for b in new:
            self._refs[b] = 1
            self._in_tables[b] = 1
            self._used_in[b // self.seg_blocks] += 1
        table.extend(new)
        return new

    def attach(self, slot: int, blocks: Sequence[int]) -> None:
        """Start the slot's (empty) table with blocks already in use, shared by reference."""
        if self._tables.get(slot):
            raise BlockError(f"slot {slot} already holds blocks")
        self.hold(blocks)
        for b in blocks:
            self._enter(b)
        self._tables[slot] = list(blocks)

    def replace(self, slot: int, index: int, block: int) -> int:
        """Copy on write: put `block` (already referenced by the caller, e.g. from `take`) at
        `index` of the slot's table; the old block, returned, loses the slot's reference."""
        table = self._tables[slot]
        old = table[index]
        table[index] = block
        self._enter(block)
        self._leave(old)
        self.drop([old])
        return old

    def take(self) -> int:
        """One free block, referenced once by the caller (who must `drop` it or `replace` it in)."""
        if not self._free:
            raise BlockError("no free block")
        b = heapq.heappop(self._free)
        self._refs[b] = 1
        self._in_tables[b] = 0
        self._held_only += 1
        self._used_in[b // self.seg_blocks] += 1
        return b

    def release(self, slot: int) -> list[int]:
        """The slot's sequence ended: its table empties. Returns the blocks that became free."""
        table = self._tables.pop(slot, ())
        for b in table:
            self._leave(b)
        return self.drop(table)

    def truncate(self, slot: int, n_blocks: int) -> list[int]:
        """Cut the slot's table to its first n_blocks (a rejected draft's positions); returns the
        blocks that became free."""
        table = self._tables.get(slot)
        if table is None or len(table) <= n_blocks:
            return []
        cut = table[n_blocks:]
        del table[n_blocks:]
        for b in cut:
            self._leave(b)
        return self.drop(cut)

    def hold(self, blocks: Iterable[int]) -> None:
        """One more reference to each block (all must be in use)."""
        for b in blocks:
            if b not in self._refs:
                raise BlockError(f"block {b} is free; only a block in use can be shared")
            self._refs[b] += 1

    def drop(self, blocks: Iterable[int]) -> list[int]:
        """One reference less to each block; returns those that became free."""
        freed = []
        for b in blocks:
            n = self._refs.get(b)
            if n is None:
                raise BlockError(f"block {b} is already free")
            if n > 1:
                self._refs[b] = n - 1
                continue
            del self._refs[b]
            if self._in_tables.pop(b) == 0:
                self._held_only -= 1
            self._used_in[b // self.seg_blocks] -= 1
            heapq.heappush(self._free, b)
            freed.append(b)
        return freed

    def _enter(self, block: int) -> None:
        """A slot's table lists the block once more."""
        n = self._in_tables[block]
        self._in_tables[block] = n + 1
        if n == 0:
            self._held_only -= 1

    def _leave(self, block: int) -> None:
        """A slot's table lists the block once less (its reference is dropped next)."""
        n = self._in_tables[block] - 1
        self._in_tables[block] = n
        if n == 0:
            self._held_only += 1
