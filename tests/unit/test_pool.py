"""Checkpoint buffer pool: caps, decline/eviction rules, trim, allocation-failure retry, threads."""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch
from ballast.memory.pinned import HostRegistration, pinned
from ballast.memory.pool import CheckpointPool, PoolMisuse
from ballast.memory.types import KiB, MiB


class Clock:
    """A clock the test advances by hand, so idle trimming is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(
    total: int = 100 * MiB, fraction: float = 0.5, max_buffers: int = 4, floor: int = 16 * KiB, **kw: object
) -> CheckpointPool:
    return CheckpointPool(lambda: total, fraction, max_buffers, floor, pin=False, **kw)  # type: ignore[arg-type]


def buf(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def sizes_held(pool: CheckpointPool, floor: int = 16 * KiB) -> list[int]:
    """Drain the pool through get() to see what it holds (largest first), then put it all back."""
    got = []
    for _ in range(pool.stats().buffers):
        got.append(pool.get(floor))
    assert pool.stats().buffers == 0
    sizes = sorted((b.numel() for b in got), reverse=True)
    for b in got:
        assert pool.put(b)
    return sizes


def test_best_fit_hit_and_miss_counts() -> None:
    pool = make_pool()
    small, mid, big = buf(64 * KiB), buf(256 * KiB), buf(MiB)
    for b in (small, mid, big):
        assert pool.put(b)
    got = pool.get(100 * KiB)
    assert got.data_ptr() == mid.data_ptr()  # the smallest buffer that is large enough
    fresh = pool.get(2 * MiB)  # nothing that large is pooled
    assert fresh.numel() == 2 * MiB
    s = pool.stats()
    assert (s.hits, s.misses, s.buffers, s.bytes_held) == (1, 1, 2, 64 * KiB + MiB)


def test_owned_buffer_large_enough_is_a_hit() -> None:
    pool = make_pool()
    mine = buf(MiB)
    assert pool.get(MiB, owned=mine) is mine
    s = pool.stats()
    assert (s.hits, s.misses, s.buffers) == (1, 0, 0)


def test_undersized_owned_buffer_is_offered_back() -> None:
    pool = make_pool()
    pooled = buf(MiB)
    pool.put(pooled)
    mine = buf(64 * KiB)
    got = pool.get(512 * KiB, owned=mine)
    assert got.data_ptr() == pooled.data_ptr()
    assert sizes_held(pool) == [64 * KiB]  # the caller's small buffer took its place


def test_size_floor_declines_small_buffers() -> None:
    pool = make_pool(floor=MiB)
    assert not pool.put(buf(MiB - 1))
    assert pool.put(buf(MiB))
    pool.get(KiB)  # below the floor: not pool traffic
    s = pool.stats()
    assert (s.buffers, s.declines, s.hits, s.misses) == (1, 1, 0, 0)


def test_full_pool_displaces_only_smaller_buffers() -> None:
    pool = make_pool(max_buffers=3)
    for n in (100 * KiB, 200 * KiB, 300 * KiB):
        assert pool.put(buf(n))
    assert not pool.put(buf(100 * KiB)), "an equal-sized buffer must not displace"
    assert sizes_held(pool) == [300 * KiB, 200 * KiB, 100 * KiB]
    assert pool.put(buf(400 * KiB))
    assert sizes_held(pool) == [400 * KiB, 300 * KiB, 200 * KiB]  # the smallest went
    assert pool.stats().evictions == 1


def test_byte_cap_displaces_several_smaller_or_declines_untouched() -> None:
    pool = make_pool(total=2 * MiB, fraction=0.5, max_buffers=10)  # cap 1 MiB
    assert pool.stats().cap_bytes == 0 and pool.cap_bytes() == MiB
    for _ in range(4):
        assert pool.put(buf(200 * KiB))
    assert pool.put(buf(600 * KiB))  # needs two 200 KiB buffers gone
    assert sizes_held(pool) == [600 * KiB, 200 * KiB, 200 * KiB]
    # 500 KiB would need the 600 KiB buffer gone too: declined, and nothing evicted on the way.
    before = pool.stats()
    assert not pool.put(buf(500 * KiB))
    after = pool.stats()
    assert (after.buffers, after.bytes_held, after.evictions) == (
        before.buffers,
        before.bytes_held,
        before.evictions,
    )
    assert not pool.put(buf(MiB + 1)), "a buffer over the whole cap is declined"


@pytest.mark.parametrize("total", [0, -1, 1 << 60])
def test_failed_host_query_means_no_pool(total: int) -> None:
    pool = make_pool(total=total)
    assert pool.cap_bytes() == 0
    assert not pool.put(buf(MiB))
    assert pool.stats().buffers == 0


def test_cap_tracks_the_live_effective_total() -> None:
    total = [100 * MiB]
    pool = CheckpointPool(lambda: total[0], 0.1, 8, KiB, pin=False)
    for _ in range(4):
        assert pool.put(buf(2 * MiB))
    total[0] = 40 * MiB  # the cgroup limit came down: cap 4 MiB
    assert not pool.put(buf(2 * MiB))
    assert pool.trim(3600.0) == 4 * MiB  # nothing idle, but the pool must fit the new cap
    assert pool.stats().bytes_held == 4 * MiB


def test_trim_by_idle_age_and_high_water_survives() -> None:
    clock = Clock()
    pool = make_pool(clock=clock)
    pool.put(buf(MiB))
    clock.now += 10
    pool.put(buf(2 * MiB))
    clock.now += 10
    assert pool.trim(15.0) == MiB  # only the one pooled 20 s ago
    assert sizes_held(pool) == [2 * MiB]
    assert pool.trim(0) == 2 * MiB
    s = pool.stats()
    assert (s.buffers, s.bytes_held, s.high_water_bytes, s.high_water_buffers, s.trimmed_bytes) == (
        0,
        0,
        3 * MiB,
        2,
        3 * MiB,
    )


def test_allocation_failure_trims_then_retries_once() -> None:
    calls: list[int] = []

    def allocate(n: int, pin: bool) -> torch.Tensor:
        calls.append(n)
        if len(calls) == 1:
            raise RuntimeError("simulated out of memory")
        return torch.empty(n, dtype=torch.uint8, pin_memory=pin)

    pool = make_pool(allocate=allocate)
    pool.put(buf(MiB))
    got = pool.get(4 * MiB)
    assert got.numel() == 4 * MiB and calls == [4 * MiB, 4 * MiB]
    s = pool.stats()
    assert (s.buffers, s.trimmed_bytes) == (0, MiB)


def test_allocation_failing_twice_propagates() -> None:
    calls: list[int] = []

    def allocate(n: int, pin: bool) -> torch.Tensor:
        calls.append(n)
        raise RuntimeError("simulated out of memory")

    pool = make_pool(allocate=allocate)
    with pytest.raises(RuntimeError, match="simulated"):
        pool.get(MiB)
    assert len(calls) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a box without a pinned allocator")
def test_pin_failure_degrades_to_pageable() -> None:
    pool = CheckpointPool(lambda: 100 * MiB, 0.5, 4, KiB, pin=True)
    got = pool.get(3 * MiB)  # torch raises: no pinned allocator without an accelerator
    assert got.numel() == 3 * MiB and not got.is_pinned()
    s = pool.stats()
    assert (s.pin_failures, s.pinned) == (1, False)


def test_pinned_buffers_are_the_size_asked_and_later_pin_failure_is_per_buffer() -> None:
    calls: list[tuple[int, bool]] = []

    def allocate(n: int, pin: bool) -> torch.Tensor:
        calls.append((n, pin))
        if pin and len(calls) > 1:
            raise RuntimeError("pinned allocation failed")
        return torch.empty(n, dtype=torch.uint8)

    pool = CheckpointPool(lambda: 100 * MiB, 0.5, 4, KiB, pin=True, allocate=allocate)
    assert pool.get(3 * MiB).numel() == 3 * MiB
    assert pool.get(3 * MiB).numel() == 3 * MiB
    assert calls == [(3 * MiB, True), (3 * MiB, True), (3 * MiB, False)]
    assert pool.pinned, "pinning worked once, so one failure must not turn it off"


class Driver:
    """Records what a CUDA driver would be asked to page-lock (this box has none)."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.registered: dict[int, int] = {}
        self.log: list[str] = []

    def registration(self) -> HostRegistration:
        return HostRegistration(self.register, self.unregister)

    def register(self, address: int, nbytes: int) -> int:
        self.log.append("register")
        if self.error == 0:
            self.registered[address] = nbytes
        return self.error

    def unregister(self, address: int) -> None:
        assert mapped(address), "unregistered after its pages were unmapped"
        self.log.append("unregister")
        del self.registered[address]


def mapped(address: int) -> bool:
    """Whether the page at `address` is mapped in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_a_pinned_buffer_is_exactly_its_size_and_unpinned_then_unmapped_when_its_last_view_goes() -> None:
    """torch's pinned allocator would round 73.7 MiB up to 128 MiB; this maps and registers the
    bytes asked for, and the registration ends before the mapping when nothing views it."""
    driver = Driver()
    nbytes = 3 * MiB + 123
    buf = pinned(nbytes, driver.registration())
    address = buf.data_ptr()
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
    assert driver.registered == {address: nbytes} and mapped(address)
    buf.fill_(7)
    view = buf[100:200]
    del buf
    gc.collect()
    assert driver.registered == {address: nbytes}  # a view still holds it
    assert int(view.sum()) == 700
    del view
    gc.collect()
    assert driver.registered == {} and driver.log == ["register", "unregister"]
    assert not mapped(address)


def test_a_failed_registration_unmaps_and_the_pool_falls_back_to_pageable() -> None:
    driver = Driver(error=2)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pinned(MiB, driver.registration())
    assert driver.registered == {}
    pool = CheckpointPool(
        lambda: 100 * MiB,
        0.5,
        4,
        KiB,
        pin=True,
        allocate=lambda n, pin: (
            pinned(n, driver.registration()) if pin else torch.empty(n, dtype=torch.uint8)
        ),
    )
    got = pool.get(2 * MiB)
    assert got.numel() == 2 * MiB and (pool.stats().pin_failures, pool.pinned) == (1, False)


def test_misuse_is_a_typed_error() -> None:
    pool = make_pool()
    b = buf(MiB)
    pool.put(b)
    with pytest.raises(PoolMisuse):
        pool.put(b)
    with pytest.raises(PoolMisuse):
        pool.put(buf(2 * MiB)[:MiB])
    with pytest.raises(PoolMisuse):
        pool.put(torch.empty(MiB, dtype=torch.float32))


def test_caps_hold_and_no_buffer_has_two_owners_under_threads() -> None:
    cap_total, max_buffers = 8 * MiB, 6
    pool = CheckpointPool(lambda: cap_total, 0.125, max_buffers, 4 * KiB, pin=False)  # cap 1 MiB
    owners: dict[int, int] = {}
    owners_lock = threading.Lock()
    errors: list[str] = []
    stop = threading.Event()

    def worker(wid: int) -> None:
        try:
            work(wid)
        except Exception as e:  # recorded and failed below: a thread's exception must not vanish
            errors.append(f"worker {wid}: {e!r}")

    def work(wid: int) -> None:
        rng = random.Random(wid)
        held: torch.Tensor | None = None
        for i in range(300):
            n = rng.choice((4, 16, 64, 128, 256)) * KiB
            b = pool.get(n, owned=held if rng.random() < 0.3 else None)
            with owners_lock:
                if owners.get(b.data_ptr(), wid) != wid:
                    errors.append(f"buffer {b.data_ptr():#x} owned by {owners[b.data_ptr()]} and {wid}")
                owners[b.data_ptr()] = wid
            tag = (wid * 31 + i) % 251
            b[0] = b[n // 2] = b[n - 1] = tag
            threading.Event().wait(0)  # yield so others run while we hold the buffer
            if not (b[0] == b[n // 2] == b[n - 1] == tag):
                errors.append(f"worker {wid}: tag overwritten, buffer shared")
            if held is not None and held.data_ptr() != b.data_ptr():
                with owners_lock:
                    owners.pop(held.data_ptr(), None)  # offered back to the pool by get()
            with owners_lock:
                owners.pop(b.data_ptr(), None)
            pool.put(b)
            held = None
        del held

    def trimmer() -> None:
        while not stop.is_set():
            pool.trim(0)
            s = pool.stats()
            if s.bytes_held > cap_total // 8 or s.buffers > max_buffers:
                errors.append(f"caps broken: {s}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    trim_thread = threading.Thread(target=trimmer)
    trim_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    trim_thread.join()
    assert not errors, errors[:5]
    s = pool.stats()
    assert s.high_water_bytes <= MiB and s.high_water_buffers <= max_buffers
    assert s.hits + s.misses > 0


def test_reserve_fills_ahead_within_the_caps_and_idle_trims_keep_it_warm() -> None:
    clock = Clock()
    pool = make_pool(total=100 * MiB, fraction=0.1, max_buffers=3, clock=clock)  # cap 10 MiB
    pool.put(buf(64 * KiB))  # a small buffer the third reserved one displaces (count cap)
    assert pool.reserve(3 * MiB, 5) == 3  # the caps stop it at three (9 MiB)
    assert sizes_held(pool) == [3 * MiB] * 3
    before = pool.stats()
    got = pool.get(3 * MiB)
    s = pool.stats()
    assert (s.hits - before.hits, s.misses - before.misses) == (1, 0)  # a save finds its buffer there
    pool.put(buf(MiB))  # an ordinary buffer, not part of the reserve
    clock.now += 100
    assert pool.trim(30.0) == MiB  # idle: the ordinary one goes, the two reserved stay
    assert sizes_held(pool) == [3 * MiB] * 2
    assert pool.put(got) and pool.trim(0) == 9 * MiB  # pressure takes the reserve too
    assert pool.reserve(3 * MiB, 2) == 2 and pool.reserve(3 * MiB, 2) == 0  # refills only what lacks
