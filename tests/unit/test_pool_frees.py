"""Freeing checkpoint buffers never waits on the device: a pinned buffer the pool lets go of is
unregistered and unmapped by the pool's unpinner thread, and its bytes count as held until it is
unmapped. This box has no CUDA driver, so the registration is `test_pool.Driver` (it records what
CUDA would be asked to page-lock, and here its unregister can be held, as a busy device holds the
real one); the mapping and the threads are real. On the CPU there are no copies in flight (no
fence), so a pageable buffer is freed at once. The wait behind a real copy is
tests/gpu/test_pinned_frees_cuda.py."""

from __future__ import annotations

import threading
import weakref

import torch
from ballast.memory.pinned import HostRegistration, pinned
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import KiB, MiB
from test_pool import Driver, mapped


class HeldDriver(Driver):
    """A driver whose unregister blocks until `release` is set, as a busy device's does."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def registration(self) -> HostRegistration:
        return HostRegistration(self.register, self.held_unregister)

    def held_unregister(self, address: int) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30), "the test never let the unregister finish"
        self.unregister(address)


def test_a_pinned_buffer_let_go_is_unpinned_off_the_callers_thread_and_held_until_unmapped() -> None:
    driver = HeldDriver()
    nbytes = 3 * MiB + 123
    pool = CheckpointPool(
        lambda: 100 * MiB,
        0.5,
        4,
        KiB,
        pin=True,
        allocate=lambda n, pin: pinned(n, driver.registration(), pool.unpinner),
    )
    assert pool.reserve(nbytes, 1) == 1
    b = pool.get(nbytes)
    address = b.data_ptr()
    assert pool.put(b)
    del b  # the pool holds the only reference now

    assert pool.trim(0) == nbytes  # returns while the unregister is held: it runs elsewhere
    assert driver.entered.wait(30)
    assert driver.threads == ["ballast-unpin"]
    assert driver.registered == {address: nbytes} and mapped(address)
    s = pool.stats()
    assert (s.buffers, s.bytes_held, s.pending_free_bytes) == (0, nbytes, nbytes)
    # Still held, so it still counts against the cap: a buffer that fits only without it is declined.
    small = pinned(48 * MiB, driver.registration(), pool.unpinner)
    assert not pool.put(small)

    driver.release.set()
    del small
    assert pool.free_copied(wait=True) == 0  # nothing was waiting on a copy; this waits for the unpinner
    s = pool.stats()
    assert (s.bytes_held, s.pending_free_bytes) == (0, 0)
    assert driver.registered == {} and not mapped(address)
    assert driver.log == ["register", "register", "unregister", "unregister"]  # each unpinned once


def test_a_pageable_buffer_with_no_copy_in_flight_is_freed_at_once() -> None:
    pool = CheckpointPool(lambda: 100 * MiB, 0.5, 1, KiB, pin=False)
    kept, other = torch.empty(MiB, dtype=torch.uint8), torch.empty(2 * MiB, dtype=torch.uint8)
    gone = weakref.ref(kept)
    assert pool.put(kept)
    del kept
    assert pool.put(other)  # displaces the smaller one: nothing can be copying it, so it is freed now
    assert gone() is None
    s = pool.stats()
    assert (s.buffers, s.bytes_held, s.pending_free_bytes, s.evictions) == (1, 2 * MiB, 0, 1)
    del other
    assert pool.trim(0) == 2 * MiB and pool.stats().bytes_held == 0
