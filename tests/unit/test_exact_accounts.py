"""Admission reads our own accounts now, not a poll's copy of them (issue 31, item 2).

The VRAM ledger is exact; a snapshot of it is up to one poll old, while the KV pool's spare
blocks come from the last step. A segment leased after the poll is in both: as ledger headroom
(the snapshot does not show the lease) and as spare blocks (the step does). The governor here is
fed by a real MemWatch over a fixture /proc tree and a die whose figures the test states.
"""

from __future__ import annotations

from pathlib import Path

from ballast.memory.config import MemoryConfig
from ballast.memory.device import DieReading, StaticDeviceReader
from ballast.memory.ladder import LadderConfig
from ballast.memory.types import CostModel, GiB, Level, MiB, PoolRoom, VerdictKind
from ballast.memory.watch import MemWatch
from ballast.scheduler.governor import Governor, GovernorSettings
from memfixtures import level_tree

# One MiB of KV a token, in blocks of one: a request's token count is its MiB.
COST = CostModel(
    kv_bytes_per_token=MiB,
    state_bytes_per_slot=0,
    activation_bytes_per_prefill_token=0,
    state_preallocated=True,
)


def test_admission_with_a_segment_leased_after_the_poll(tmp_path: Path) -> None:
    mem = MemoryConfig(root=str(tmp_path), die_reserve_bytes=GiB, vram_usable_fraction=0.9)
    level_tree(tmp_path, Level.OK, config=mem)
    watch = MemWatch(mem, StaticDeviceReader([DieReading(0, "GPU", total_bytes=2 * GiB, free_bytes=2 * GiB)]))
    assert watch.ledger.register_die(0, 2 * GiB, 2 * GiB) == GiB  # the ceiling: 1,024 MiB
    watch.poll_now()
    gov = Governor(GovernorSettings(LadderConfig(8, 4096), False, 15.0, 1.0, gpu_die=0), COST, watch)
    gov.refresh()
    segment = watch.ledger.lease(0, 512 * MiB, "kv-segment")  # the pool grew after the poll...
    pool = PoolRoom(free_bytes=512 * MiB)  # ...and the step after it reports the segment's blocks free
    verdict = gov.verdict(10, 1400, pool)
    assert (verdict.kind, verdict.fit_tokens) == (VerdictKind.CAP, 1024)  # not ADMIT 1410
    segment.release()
    assert gov.verdict(10, 1400, pool).fit_tokens == 1410  # the segment given back: room for all of it


def test_cpu_admission_counts_grants_the_host_does_not_show_yet(tmp_path: Path) -> None:
    mem = MemoryConfig(root=str(tmp_path), host_reserve_bytes=GiB)
    level_tree(tmp_path, Level.OK, config=mem)
    watch = MemWatch(mem, StaticDeviceReader())
    watch.poll_now()
    gov = Governor(GovernorSettings(LadderConfig(8, 1 << 20), False, 15.0, 1.0, gpu_die=None), COST, watch)
    gov.refresh()
    budget = watch.read().host_budget_bytes
    grant = watch.host_book.take(budget - 100 * MiB, lambda: watch.exact().host_budget_bytes)
    assert grant is not None  # a segment booked since the poll: the host's figures do not show it
    verdict = gov.verdict(10, 1000, PoolRoom(free_bytes=0, addable_bytes=1 << 40))
    assert (verdict.kind, verdict.fit_tokens) == (VerdictKind.CAP, 100)
    grant.release()
