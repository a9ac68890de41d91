"""The KV block pool: allocator bookkeeping under random histories, segments that grow and are
given back (real pages on the CPU), sharing with copy on write, and refusals from the memory layer."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from ballast.engine.kv.blocks import BlockAllocator, BlockError, blocks_for
from ballast.engine.kv.kv_pool import KVPool
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import KVStore, plan_layout
from ballast.models.layers.state import PagedKV
from test_state import read_kv

CPU = torch.device("cpu")


def small_pool(slots: int = 6, max_len: int = 256, segment_bytes: int = 1, acquire=None) -> KVPool:  # type: ignore[no-untyped-def]
    layout = plan_layout(2, 2, 8, torch.float32, False, slots, max_len, CPU, segment_bytes=segment_bytes)
    store = KVStore(layout, CPU)
    return KVPool(store, acquire) if acquire is not None else KVPool(store)


def check_invariants(alloc: BlockAllocator, tables: dict[int, list[int]], holds: Counter[int]) -> None:
    """Every block in use is referenced exactly by the tables listing it and the holds on it;
    nothing free is referenced; free + used = every block of the live segments."""
    want: Counter[int] = Counter(holds)
    for slot, table in tables.items():
        assert alloc.table(slot) == table
        want.update(table)
    assert {b: alloc.refs(b) for b in want} == dict(want)
    assert alloc.used_blocks == len(want)
    listed = {b for t in tables.values() for b in t}
    assert alloc.held_only_blocks == len(set(want) - listed)  # what dropping the holds would free
    assert alloc.free_blocks + alloc.used_blocks == alloc.total_blocks
    live = {b for s in alloc.segments for b in range(s * alloc.seg_blocks, (s + 1) * alloc.seg_blocks)}
    assert set(want) <= live


def test_random_histories_never_hold_a_block_twice_and_end_idle() -> None:
    """1,000 random admit / grow / share / preempt / resume / release / compact / shrink operations."""
    rng = random.Random(0)
    pool = small_pool(slots=6, max_len=256, segment_bytes=1)  # 1 block per segment: segments churn
    alloc, bs = pool.alloc, pool.layout.block_size
    lengths: dict[int, int] = {}  # slot -> tokens its table covers
    tables: dict[int, list[int]] = {}
    held: list[tuple[int, ...]] = []  # blocks the "prefix cache" holds, with their token counts
    held_tokens: list[int] = []
    swapped: list[int] = []  # lengths of preempted sequences, to resume
    for _ in range(1000):
        op = rng.choice(
            [
                "admit",
                "grow",
                "grow",
                "share",
                "hold",
                "drop",
                "preempt",
                "resume",
                "release",
                "shrink",
                "compact",
            ]
        )
        free_slots = [s for s in range(6) if s not in lengths]
        if op in ("admit", "resume") and free_slots:
            slot = free_slots[0]
            n = swapped.pop() if op == "resume" and swapped else rng.randrange(1, 200)
            if pool.ensure(slot, n):
                lengths[slot] = n
        elif op == "grow" and lengths:
            slot = rng.choice(list(lengths))
            n = min(256, lengths[slot] + rng.randrange(1, 70))
            if pool.ensure(slot, n):
                lengths[slot] = n
        elif op == "share" and held and free_slots:
            i = rng.randrange(len(held))
            slot = free_slots[0]
            if pool.attach(slot, held[i], held_tokens[i]):
                lengths[slot] = held_tokens[i]
        elif op == "hold" and lengths:
            slot = rng.choice(list(lengths))
            n = rng.randrange(1, lengths[slot] + 1)
            held.append(pool.hold(slot, n))
            held_tokens.append(n)
        elif op == "drop" and held:
            i = rng.randrange(len(held))
            pool.drop(held.pop(i))
            held_tokens.pop(i)
        elif op in ("preempt", "release") and lengths:
            slot = rng.choice(list(lengths))
            if op == "preempt":
                swapped.append(lengths[slot])
            pool.release(slot)
            del lengths[slot]
        elif op == "shrink":
            pool.shrink()
        elif op == "compact":
            moves = pool.compact()
            held = [tuple(moves.get(b, b) for b in h) for h in held]
            assert not moves or max(moves.values()) < min(moves)  # blocks only move down
        tables = {s: alloc.table(s) for s in lengths}
        assert all(len(t) == blocks_for(lengths[s], bs) for s, t in tables.items())
        check_invariants(alloc, tables, Counter(b for h in held for b in h))
    for slot in list(lengths):
        pool.release(slot)
    for h in held:
        pool.drop(h)
    assert alloc.used_blocks == 0
    pool.shrink()
    assert alloc.segments == frozenset() and pool.bytes_held == 0


def test_allocator_refuses_misuse() -> None:
    alloc = BlockAllocator(seg_blocks=2, max_segments=1)
    with pytest.raises(BlockError):
        alloc.grow(0, 1)  # no segment yet
    alloc.add_segment()
    with pytest.raises(BlockError):
        alloc.add_segment()  # the limit
    alloc.grow(0, 2)
    with pytest.raises(BlockError):
        alloc.grow(1, 1)
    with pytest.raises(BlockError):
        alloc.drop([5])
    assert alloc.release(0) == [0, 1]
    with pytest.raises(BlockError):
        alloc.hold([0])  # free blocks cannot be shared


def test_blocks_are_taken_low_first_so_high_segments_empty_out() -> None:
    alloc = BlockAllocator(seg_blocks=2, max_segments=3)
    for _ in range(3):
        alloc.add_segment()
    alloc.grow(0, 2)  # blocks 0, 1
    alloc.grow(1, 3)  # blocks 2, 3, 4
    alloc.release(0)
    alloc.grow(2, 1)  # the lowest free block again
    assert alloc.table(2) == [0]
    assert alloc.remove_free_segments() == []  # every segment has a block in use
    alloc.release(1)
    assert alloc.remove_free_segments(keep=2) == [2]  # highest first, two kept
    assert alloc.remove_free_segments() == [1] and alloc.segments == {0}


def test_segments_grow_on_demand_and_give_pages_back() -> None:
    """The CPU store commits a segment's pages when they are written and returns them on shrink."""
    pool = small_pool(slots=2, max_len=4096, segment_bytes=64 << 10)
    seg_blocks = pool.layout.seg_blocks
    assert pool.bytes_held == 0 and pool.alloc.segments == frozenset()
    assert pool.ensure(0, seg_blocks * pool.layout.block_size + 1)  # one token into a second segment
    assert pool.alloc.segments == {0, 1} and pool.bytes_held == 2 * pool.layout.segment_bytes
    kv = PagedKV(pool.store, 0)
    n = 40
    batch = ForwardBatch.build([(0, list(range(n)), 0)], CPU)
    kv.write(batch, torch.ones(n, 2, 8), torch.ones(n, 2, 8))
    assert read_kv(kv, batch)[0].sum() == n * 2 * 8
    pool.release(0)
    assert pool.shrink() == 2 * pool.layout.segment_bytes and pool.bytes_held == 0
    # Pages given back read as zeros when the segment comes again.
    assert pool.ensure(1, n)
    host = pool.store.host
    assert host is not None and host.kv[0, pool.table(1)[0]].abs().sum() == 0


def test_attach_shares_full_blocks_and_copies_a_partial_last_one() -> None:
    pool = small_pool()
    bs = pool.layout.block_size
    kv = PagedKV(pool.store, 1)
    n = 2 * bs + 5
    assert pool.ensure(0, n)
    src = ForwardBatch.build([(0, list(range(n)), 0)], CPU)
    keys = torch.randn(n, 2, 8)
    kv.write(src, keys, keys)
    shared = pool.hold(0, n)
    assert pool.attach(3, shared, n)
    mine = pool.table(3)
    assert mine[:2] == list(shared[:2]) and mine[2] != shared[2]  # the partial block was copied
    assert pool.alloc.refs(shared[0]) == 3 and pool.alloc.refs(shared[2]) == 2
    # Slot 3 continues its copy; slot 0's positions are untouched.
    kv.write(ForwardBatch.build([(3, [1], n)], CPU), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    assert torch.equal(read_kv(kv, ForwardBatch.build([(3, [0] * n, 0)], CPU))[0][0], keys)
    assert torch.equal(read_kv(kv, ForwardBatch.build([(0, [0] * n, 0)], CPU))[0][0], keys)


def test_a_refused_grant_leaves_the_pool_as_it_was() -> None:
    granted: list[int] = []

    def acquire(nbytes: int):  # type: ignore[no-untyped-def]
        if len(granted) >= 2:
            return None
        granted.append(nbytes)
        return lambda: granted.pop()

    pool = small_pool(slots=4, max_len=1024, segment_bytes=1, acquire=acquire)
    bs = pool.layout.block_size
    assert pool.layout.seg_blocks == 2  # two grants: blocks 1, 2, 3 (block 0 is the sink)
    assert pool.ensure(0, 3 * bs)
    assert pool.table(0) == [1, 2, 3]
    assert not pool.ensure(1, 1) and pool.refused == 1
    assert pool.table(1) == [] and pool.alloc.used_blocks == 3
    pool.release(0)
    pool.shrink()
    assert granted == []  # every grant given back with its segment


def test_compaction_packs_blocks_down_keeps_contents_and_gives_segments_back() -> None:
    """Blocks scattered over the high segments (their neighbours' sequences ended) move into the
    low ones with their contents, tables follow, and the emptied segments go back."""
    pool = small_pool(slots=6, max_len=256, segment_bytes=1)  # 2 blocks per segment (1 + the sink in seg 0)
    bs = pool.layout.block_size
    for slot in range(4):
        assert pool.ensure(slot, 2 * bs)
    kv = PagedKV(pool.store, 0)
    batch = ForwardBatch.build([(3, list(range(2 * bs)), 0)], CPU)
    keys = torch.randn(2 * bs, 2, 8)
    kv.write(batch, keys, keys)
    for slot in range(3):
        pool.release(slot)
    before = pool.table(3)  # slot 3's blocks sit in the highest segments
    moves = pool.compact()
    assert moves and set(moves) == set(before) and pool.table(3) == [moves[b] for b in before]
    assert int(pool.store.block_table[3, 0]) == pool.table(3)[0]
    assert torch.equal(read_kv(kv, batch)[0][0], keys)
    assert pool.shrink() > 0 and len(pool.alloc.segments) == 2  # the sink's segment and one more


def test_capacity_line_counts_tokens_sequences_and_slot_states() -> None:
    from ballast.engine.kv.kv_budget import capacity_line
    from ballast.memory.types import CostModel, GiB, MiB

    cost = CostModel(
        kv_bytes_per_token=128 * 1024,
        state_bytes_per_slot=0,
        activation_bytes_per_prefill_token=0,
        quantized_kv_bytes_per_token=66 * 1024,
        kv_block_tokens=32,
    )
    line = capacity_line(cost, 3 * MiB, 16 * GiB, False, 64, 8192)
    assert (
        "131,072 tokens" in line and "16 of 64 sequences at max_model_len 8192" in line and "64 at 1k" in line
    )
    assert "3.0 MiB" in line
    assert "254,200 tokens" in capacity_line(cost, 0, 16 * GiB, True, 64, 8192)  # int8: 66 KiB a token


def test_shrink_keeps_the_free_blocks_asked_for_and_gives_back_the_rest() -> None:
    """The ladder at TIGHT keeps the free blocks queued requests are about to take: only whole
    segments beyond them go back, and a pool with no such segment is left alone."""
    pool = small_pool(slots=2, max_len=4096, segment_bytes=64 << 10)
    seg, bs = pool.layout.seg_blocks, pool.layout.block_size
    assert pool.ensure(0, 5 * seg * bs)  # five segments' worth of blocks (the sink takes one more)
    pool.release(0)
    free = pool.alloc.free_blocks
    assert len(pool.alloc.segments) == 6 and free == 6 * seg - 1
    keep = 2 * seg + 1  # one block more than two segments: three stay
    assert pool.has_surplus(keep) and not pool.has_surplus(free - seg + 1)
    assert pool.shrink(keep_free_blocks=keep) == 3 * pool.layout.segment_bytes
    assert len(pool.alloc.segments) == 3 and pool.alloc.free_blocks >= keep
    assert not pool.has_surplus(keep) and pool.shrink(keep_free_blocks=keep) == 0
    assert pool.shrink() == 3 * pool.layout.segment_bytes and pool.alloc.segments == frozenset()
