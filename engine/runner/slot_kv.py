"""The engine's KV policy between steps (engine thread): what each slot has been fed, and the
blocks a step needs before its forward. Blocks that cannot be had are found by evicting
prefix-cache entries first, then by preempting sequences youngest first (new prefills, then the
last admitted decodes): on CUDA a preempted sequence is parked in pinned host buffers so it
resumes without a recompute; on the CPU, or when the host is short too, it is recomputed.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence

from ballast.engine.kv.kv_pool import KVPool
from ballast.engine.kv.prefix_cache import PrefixCache
from ballast.engine.plan import KVKeep, StepPlan
from ballast.engine.runner.model_runner import ModelRunner
from ballast.memory.watch import MemWatch
from ballast.models.base import Rows

log = logging.getLogger(__name__)


class SlotKV:
    def __init__(
        self, runner: ModelRunner, cache: PrefixCache, watch: MemWatch | None, ranks: int = 1
    ) -> None:
        """ranks: tensor-parallel ranks; each parks its own shard of a sequence in host memory
        (the cache's journal tells the others), so parking needs that many shares of the host."""
        self._runner = runner
        self._ranks = ranks
        self._cache = cache
        self._watch = watch
        self._kv = runner.kv_manager
        self._fed: dict[int, array[int]] = {}  # slot -> the tokens its sequence has been fed (to park it)
        self.preemptions = 0  # sequences moved out for want of blocks
        self.parked = 0  # of which parked in host buffers (the rest are recomputed)
        self._parked_in_step: list[tuple[int, ...]] = []  # parked by the step running now

    def begin_step(self) -> None:
        self._parked_in_step = []

    def take_parked_in_step(self) -> list[tuple[int, ...]]:
        """What the current step parked: a step that fails drops these, as its scheduler never
        learns of the preemption and will not resume them."""
        out, self._parked_in_step = self._parked_in_step, []
        return out

    def pool_of(self, slot: int) -> KVPool:
        assert self._kv is not None
        return self._kv.pool_of(slot)

    def in_int8(self, slot: int) -> bool:
        return self._kv is not None and self._kv.in_int8(slot)

    def start(self, slots: Sequence[int], int8: Sequence[bool] = ()) -> None:
        """New sequences start in these slots: whatever they held goes back (`KVManager.place`)."""
        if self._kv is None:
            return
        self.drop(slots)
        self._kv.place(slots, int8)

    def restored(self, slot: int, prefix: Sequence[int]) -> None:
        self._fed[slot] = array("q", prefix)

    def fed_at(self, slot: int, pos: int, token: int) -> None:
        """The token at `pos`, fed from the device by a step launched before it was known, is now
        known on the host: it replaces the placeholder recorded there."""
        fed = self._fed.get(slot)
        if fed is not None and pos < len(fed):
            fed[pos] = token

    def truncate(self, slot: int, n_tokens: int) -> None:
        """The slot's sequence holds only its first n_tokens positions (a draft was cut): what it
        was fed, and its blocks, end there."""
        fed = self._fed.get(slot)
        if fed is not None:
            del fed[n_tokens:]
        if self._kv is not None:
            self._kv.pool_of(slot).truncate(slot, n_tokens)

    def drop(self, slots: Sequence[int]) -> None:
        """The slots' sequences are gone: blocks back to their pools, slots back to the main pool."""
        for slot in slots:
            self._fed.pop(slot, None)
        if self._kv is not None:
            self._kv.release(slots)

    def shrink(self, keep: KVKeep = KVKeep()) -> None:
        """Give memory back (the ladder at TIGHT and worse): compact, then return the empty
        segments beyond `keep`'s free blocks. A pool with no whole segment to spare is left alone."""
        if self._kv is None:
            return
        for pool in self._kv.pools:
            keep_free = keep.main if pool is self._kv.main else keep.int8
            if not pool.has_surplus(keep_free):
                continue
            moves = pool.compact()
            if pool is self._kv.main:
                self._cache.follow_moves(moves)  # the cache holds main-pool blocks by id
            pool.shrink(keep_free_blocks=keep_free)

    def take_blocks(self, plan: StepPlan, seqs: Rows) -> frozenset[int]:
        """Grow every sequence's table to cover this step's positions, evicting cache and then
        preempting where blocks cannot be had. Returns the preempted slots (the step skips them)."""
        if self._kv is None:
            return frozenset()
        kv = self._kv.main
        need = {slot: start + len(tokens) for slot, tokens, start in seqs}
        short = [slot for slot, n in need.items() if not self.pool_of(slot).ensure(slot, n)]
        if short:  # cached prefixes go before any running sequence: free blocks for all of them
            self._cache.evict_for_blocks(
                sum(_lacking(kv, s, need[s]) for s in short if self.pool_of(s) is kv)
            )
        victims = [p.slot for p in reversed(plan.prefills)] + [d.slot for d in reversed(plan.decodes)]
        preempted: set[int] = set()
        while short := [s for s in short if s not in preempted and not self.pool_of(s).ensure(s, need[s])]:
            pool = self.pool_of(short[0])  # blocks freed in another pool would not help it
            victim = next(v for v in victims if v not in preempted and self.pool_of(v) is pool)
            preempted.add(victim)
            self._park(victim)
            self.drop([victim])
            self._runner.sampler.reset([victim])
        for slot, tokens, _ in seqs:  # what each slot has been fed once this step runs
            if slot not in preempted:
                self._fed.setdefault(slot, array("q")).extend(tokens)
        if preempted:
            self.preemptions += len(preempted)
            log.warning(
                "KV blocks short: preempted slots %s (they resume when blocks are free)", sorted(preempted)
            )
        return frozenset(preempted)

    def _park(self, slot: int) -> None:
        """Move a preempted sequence from the GPU to pinned host buffers. On the CPU its blocks are
        host memory already (moving them frees nothing), so it is recomputed, as when the host is short."""
        fed = self._fed.get(slot)
        pool = self.pool_of(slot)
        if not fed or pool.store.device.type != "cuda":
            return
        slots = max(1, self._runner.num_slots)
        need = len(pool.table(slot)) * pool.layout.block_bytes + self._runner.fixed_bytes // slots
        need *= self._ranks
        # Pinned pages cannot be reclaimed: each park is booked in the host book before the next
        # is weighed, so N victims of one step (or of steps between two polls) never pin N times
        # the room one snapshot showed.
        grant = None
        if self._watch is not None:
            watch = self._watch
            grant = watch.host_book.take(need, lambda: watch.exact().host_budget_bytes)
            if grant is None:
                return
        if self._cache.parked.park(slot, fed, pool):
            self.parked += 1
            self._parked_in_step.append(tuple(fed))
            if grant is not None:
                grant.committed()  # filled: the host shows it from the next poll on
        elif grant is not None:
            grant.release()


def _lacking(kv: KVPool, slot: int, n_tokens: int) -> int:
    """Blocks the slot's table lacks to hold n_tokens: the free blocks it needs (not what the free
    blocks lack: with some free but too few, that evicts nothing and preempts a sequence beside
    evictable cached blocks)."""
    return max(0, -(-n_tokens // kv.layout.block_size) - len(kv.table(slot)))
