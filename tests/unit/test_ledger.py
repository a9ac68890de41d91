"""The VRAM ledger: ceiling from budget and usable free, typed refusal, idempotent release, threads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.device import DieReading, StaticDeviceReader
from ballast.memory.errors import LedgerFull, MemoryRefused, UnknownDie
from ballast.memory.ledger import VramLedger
from ballast.memory.types import GiB, Level, MiB
from ballast.memory.watch import MemWatch
from memfixtures import level_tree


@pytest.mark.parametrize(
    ("total", "free", "reserve", "fraction", "ceiling"),
    [
        (80 * GiB, 80 * GiB, 10 * GiB, 0.90, 70 * GiB),  # a clean die: the budget binds... until
        (80 * GiB, 70 * GiB, GiB, 0.90, 63 * GiB),  # ...someone else holds VRAM: free x 0.9 binds
        (80 * GiB, 80 * GiB, GiB, 1.0, 79 * GiB),
        (8 * GiB, 6 * GiB, GiB, 0.5, 3 * GiB),
        (GiB, GiB, 2 * GiB, 0.9, 0),  # all reserve: nothing may be leased
    ],
)
def test_ceiling_is_min_of_budget_and_usable_free(
    total: int, free: int, reserve: int, fraction: float, ceiling: int
) -> None:
    ledger = VramLedger(die_reserve_bytes=reserve, usable_fraction=fraction)
    assert ledger.register_die(0, total_bytes=total, free_bytes=free) == ceiling
    assert ledger.ceiling(0) == ceiling
    (budget,) = ledger.dies()
    assert budget.budget_bytes == max(0, total - reserve) and budget.ceiling_bytes == ceiling


def test_refusal_names_die_asked_held_ceiling() -> None:
    ledger = VramLedger(die_reserve_bytes=GiB, usable_fraction=0.9)
    ledger.register_die(1, total_bytes=11 * GiB, free_bytes=10 * GiB)  # ceiling 9 GiB
    weights = ledger.lease(1, 6 * GiB, "weights")
    kv = ledger.lease(1, 3 * GiB, "kv")  # exactly at the ceiling: allowed
    with pytest.raises(LedgerFull) as info:
        ledger.lease(1, 1, "one byte more")
    err = info.value
    assert isinstance(err, MemoryRefused)
    assert (err.die, err.asked, err.held, err.ceiling, err.tag) == (1, 1, 9 * GiB, 9 * GiB, "one byte more")
    assert "die 1" in str(err) and "one byte more" in str(err)
    assert ledger.held(1) == 9 * GiB  # a refused lease holds nothing
    kv.release()
    assert ledger.held(1) == 6 * GiB and ledger.headroom(1) == 3 * GiB
    assert ledger.lease(1, 2 * GiB, "kv-small").nbytes == 2 * GiB
    assert ledger.leases(1) == (("weights", 6 * GiB), ("kv-small", 2 * GiB))
    weights.release()
    assert ledger.held(1) == 2 * GiB


def test_release_is_idempotent_and_with_releases() -> None:
    ledger = VramLedger(die_reserve_bytes=0, usable_fraction=1.0)
    ledger.register_die(0, total_bytes=GiB, free_bytes=GiB)
    lease = ledger.lease(0, 512 * MiB, "a")
    lease.release()
    lease.release()
    assert lease.released and ledger.held(0) == 0
    with ledger.lease(0, GiB, "b") as b:
        assert ledger.held(0) == GiB and not b.released
    assert b.released and ledger.held(0) == 0 and ledger.leases(0) == ()


def test_unknown_die_and_bad_arguments() -> None:
    ledger = VramLedger(die_reserve_bytes=GiB, usable_fraction=0.9)
    with pytest.raises(UnknownDie):
        ledger.lease(3, 1, "x")
    assert ledger.held(3) == 0 and ledger.ceiling(3) == 0
    ledger.register_die(0, total_bytes=4 * GiB, free_bytes=4 * GiB)
    with pytest.raises(ValueError):
        ledger.lease(0, -1, "negative")
    with pytest.raises(ValueError):
        VramLedger(die_reserve_bytes=GiB, usable_fraction=0.0)
    with pytest.raises(ValueError):
        ledger.register_die(0, total_bytes=-1, free_bytes=0)


def test_reregister_keeps_leases_and_moves_ceiling() -> None:
    ledger = VramLedger(die_reserve_bytes=0, usable_fraction=1.0)
    ledger.register_die(0, total_bytes=10 * GiB, free_bytes=10 * GiB)
    lease = ledger.lease(0, 6 * GiB, "weights")
    ledger.register_die(0, total_bytes=10 * GiB, free_bytes=5 * GiB)  # someone else took VRAM
    assert ledger.held(0) == 6 * GiB and ledger.headroom(0) == 0
    with pytest.raises(LedgerFull):
        ledger.lease(0, 1, "more")
    lease.release()
    assert ledger.lease(0, 5 * GiB, "fits again").nbytes == 5 * GiB


def test_threads_never_pass_the_ceiling_and_return_to_idle() -> None:
    ceiling = 1000 * MiB
    ledger = VramLedger(die_reserve_bytes=0, usable_fraction=1.0)
    ledger.register_die(0, total_bytes=ceiling, free_bytes=ceiling)
    over: list[int] = []
    refused = [0] * 8
    barrier = threading.Barrier(9)

    def worker(k: int) -> None:
        barrier.wait()
        for i in range(2000):
            try:
                lease = ledger.lease(0, (7 + (i + k) % 13) * MiB, f"w{k}-{i}")
            except LedgerFull:
                refused[k] += 1
                continue
            if ledger.held(0) > ceiling:
                over.append(ledger.held(0))
            lease.release()
            lease.release()  # a racing double release must not free twice

    def watcher() -> None:
        barrier.wait()
        for _ in range(5000):
            (die,) = ledger.dies()
            if die.held_bytes > ceiling:
                over.append(die.held_bytes)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)] + [
        threading.Thread(target=watcher)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert over == []
    assert ledger.held(0) == 0 and ledger.leases(0) == ()


def test_threads_fill_exactly_to_the_ceiling() -> None:
    ledger = VramLedger(die_reserve_bytes=0, usable_fraction=1.0)
    ledger.register_die(0, total_bytes=100 * MiB, free_bytes=100 * MiB)
    granted: list[int] = []
    lock = threading.Lock()

    def grab() -> None:
        for _ in range(50):
            try:
                ledger.lease(0, MiB, "slice")
            except LedgerFull:
                continue
            with lock:
                granted.append(1)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 100 and ledger.held(0) == 100 * MiB


def test_ledger_totals_flow_into_memwatch_snapshots(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK)
    reader = StaticDeviceReader(
        [DieReading(index=0, name="H200", total_bytes=141 * GiB, free_bytes=140 * GiB)]
    )
    watch = MemWatch(MemoryConfig(root=str(tmp_path)), device_reader=reader)
    ceiling = watch.ledger.register_die(0, total_bytes=141 * GiB, free_bytes=140 * GiB)
    assert ceiling == 126 * GiB  # 140 x 0.90 < 141 - 1
    lease = watch.ledger.lease(0, 30 * GiB, "weights")
    die = watch.poll_now().dies[0]
    assert (die.name, die.ledger_bytes, die.ceiling_bytes, die.budget_bytes) == (
        "H200",
        30 * GiB,
        ceiling,
        140 * GiB,
    )
    lease.release()
    assert watch.poll_now().dies[0].ledger_bytes == 0
