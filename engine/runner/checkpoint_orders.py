"""The engine's side of a plan's checkpoint orders (`CheckpointExecutor`), and the cache they go
to (`build_cache`): one `PrefixCache` holds the prefix checkpoints (when prefix caching is on) and
the sequences parked by preemption (always)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import psutil
import torch
from ballast.engine.config import EngineConfig, PrefixCacheConfig, auto_interval
from ballast.engine.kv.checkpoint_buffers import checkpoint_bytes
from ballast.engine.kv.parked import CheckpointMissing
from ballast.engine.kv.prefix_cache import PrefixCache
from ballast.engine.plan import PlanError, StepPlan
from ballast.engine.runner.model_runner import ModelRunner
from ballast.engine.runner.slot_kv import SlotKV
from ballast.memory.errors import LedgerFull
from ballast.memory.ledger import Lease, VramLedger
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import CostModel
from ballast.memory.watch import MemWatch
from ballast.models.layers.state import LayerState

log = logging.getLogger(__name__)

# checkpoint copies a save burst may stage on the device at once (see staging_bytes)
STAGED_CHECKPOINTS = 8


def build_cache(
    cfg: PrefixCacheConfig,
    runner: ModelRunner,
    cost: CostModel,
    watch: MemWatch | None,
    pool: CheckpointPool | None,
    config: EngineConfig,
    leases: list[Lease],
) -> PrefixCache:
    """leases: the engine's; the device staging of the checkpoint copies joins them."""
    ranks = config.tensor_parallel_size

    def budget() -> int:
        # Live, like the pool's cap: a cgroup limit that shrinks shrinks the cache's next save.
        total = (
            watch.read().host.effective_total_bytes if watch is not None else psutil.virtual_memory().total
        )
        cap = int(total * cfg.fraction)
        cap = min(cap, cfg.max_bytes) if cfg.max_bytes else cap
        # Under tensor parallel every rank keeps its shard of each checkpoint in host memory too:
        # the cache counts rank 0's, so its share of the budget is 1 / ranks.
        return cap // ranks

    interval = cfg.checkpoint_interval or auto_interval(cost.state_bytes_per_slot, cost.kv_bytes_per_token)
    staging = 0
    if cfg.enabled:  # saves are the only copies staged
        ledger = watch.ledger if watch is not None else None
        staging = staging_bytes(
            runner.device, runner.states, ledger, leases, min(STAGED_CHECKPOINTS, config.max_num_seqs)
        )
    cache = PrefixCache(runner.states, runner.kv, budget, interval, pool, runner.device, staging)
    if runner.journal is not None:
        cache.journal.ops = runner.journal  # the workers copy their shards of each checkpoint
    if cfg.enabled:
        # Every running sequence may save at its prompt's end and its answer's end before the
        # cache is full and evictions hand buffers back: that many ready from load on.
        cache.prewarm(2 * config.max_num_seqs)
    return cache


def staging_bytes(
    device: torch.device,
    states: Sequence[LayerState],
    ledger: VramLedger | None,
    leases: list[Lease],
    checkpoints: int,
) -> int:
    """Device memory for checkpoint copies in flight (`StateCopies`), leased from the ledger
    (appended to `leases`): room for `checkpoints` of them, else for one, else none.

    A save without staging room copies from the slot itself, and the whole next step waits for
    that transfer over PCIe; new conversations end their prompts together (32 first turns of the
    6.2B hybrid on an H200 with room for three: 1.44x the TTFT p50 of the cache off)."""
    one = checkpoint_bytes(states)
    if device.type != "cuda" or one == 0:
        return 0  # CPU copies are synchronous; attention-only checkpoints copy no state
    if ledger is None:
        return checkpoints * one
    die = device.index if device.index is not None else torch.cuda.current_device()
    for count in (checkpoints, 1):
        try:
            leases.append(ledger.lease(die, count * one, "checkpoint-staging"))
        except LedgerFull:
            continue
        return count * one
    log.warning("no VRAM to stage checkpoint copies: a save's slot waits for its transfer to the host")
    return 0


class CheckpointExecutor:
    """Carries out the checkpoint orders of each plan on the engine thread (the scheduler's
    `CheckpointPlanner` decides which): state copies between slots and the cache's buffers."""

    def __init__(
        self,
        cache: PrefixCache,
        prefix_cache: PrefixCache | None,
        pool: CheckpointPool | None,
        slot_kv: SlotKV,
        runner: ModelRunner,
        check_slots: Callable[[Sequence[int]], None],
        max_model_len: int,
    ) -> None:
        """prefix_cache: `cache` itself when prefix caching is on, else None (parking only);
        check_slots raises PlanError for slots out of range."""
        self._cache = cache
        self._prefix = prefix_cache
        self._pool = pool
        self._slot_kv = slot_kv
        self._runner = runner
        self._check_slots = check_slots
        self._max_model_len = max_model_len

    def shed(self, plan: StepPlan) -> None:
        """The ladder's first rung (WATCH): cached state goes back before anything else shrinks.
        Parked sequences stay: they are running work, not cache (only those the plan unparks go)."""
        for tokens in plan.unpark:
            self._cache.parked.unpark(tokens)
        if self._prefix is None:
            if plan.saves:
                raise PlanError("checkpoint saves sent to an engine whose prefix cache is off")
        elif plan.shed_prefix_cache:
            if plan.saves:
                raise PlanError("a plan that sheds the prefix cache cannot also save checkpoints")
            self._prefix.shed()
            if self._pool is not None:
                # Under pressure no checkpoint is saved, so pooled buffers would only wait for the
                # idle trim: give them back to the OS now (on CUDA this also frees pinned pages).
                self._pool.trim(0)

    def restore(self, plan: StepPlan) -> tuple[int, frozenset[int]]:
        """Start each restore's slot from its parked sequence or checkpoint, before any forward.
        Returns the prompt tokens restored from checkpoints, and the slots the step skips like
        preempted ones: a parked sequence that found no blocks (it stays parked), or a checkpoint
        gone. A gone checkpoint is normal: step N's saves or block needs can evict what step N+1,
        planned while N ran, restores; failing the step instead once took 29 sequences with it."""
        cache, slot_kv, sampler = self._cache, self._slot_kv, self._runner.sampler
        starts = {p.slot: p.start_pos for p in plan.prefills}
        reused = 0
        failed: set[int] = set()
        for r in plan.restores:
            self._check_slots([r.slot])
            if starts.get(r.slot) != len(r.prefix):
                raise PlanError(
                    f"slot {r.slot}: a restore of {len(r.prefix)} tokens needs a prefill chunk starting there"
                )
            home = cache.parked.pool_of(r.prefix)
            # A new sequence: what the slot held goes; it lives where its blocks are (a parked one
            # in the pool it was parked from, a checkpoint's in the main pool).
            slot_kv.start([r.slot], [home is not None and home is self._runner.kv_int8])
            try:
                n = cache.restore(r.slot, r.prefix)
            except CheckpointMissing as e:
                log.info("%s: evicted since the plan was made; the request prefills again", e)
                slot_kv.drop([r.slot])
                failed.add(r.slot)
                continue
            if home is None:
                reused += n
            slot_kv.restored(r.slot, r.prefix)
            # The restored prefix counts for the repetition penalty as if it had been prefilled.
            sampler.reset([r.slot])
            sampler.observe_prompt(r.slot, r.prefix)
        return reused, frozenset(failed)

    def save(self, plan: StepPlan, skip: frozenset[int]) -> None:
        """After the forward: each save's slot has consumed exactly its prefix (saves of slots in
        `skip` are not made here: released slots saved before their release, preempted ones not)."""
        if self._prefix is None:
            return
        self._check_slots([s.slot for s in plan.saves])
        int8 = [s.slot for s in plan.saves if self._slot_kv.in_int8(s.slot)]
        if int8:
            raise PlanError(f"slots {int8} hold int8 KV outside the prefix cache's pool: no checkpoint there")
        longest = self._max_model_len
        for s in plan.saves:
            if s.slot in skip:
                continue
            if not 0 < len(s.prefix) <= longest:
                raise PlanError(
                    f"slot {s.slot}: a checkpoint of {len(s.prefix)} tokens is outside 1..{longest}"
                )
            self._prefix.save(s.slot, s.prefix)
