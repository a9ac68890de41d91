"""A bounded pool of recurrent-state checkpoint buffers.

A hybrid model's checkpoint holds the whole non-rollbackable sequence state, hundreds of MiB. A
buffer that size comes straight from mmap() and goes straight back on free, so each fresh one
faults in every page on first write; on CUDA a device-to-host copy into pageable memory that is
not yet resident runs ~140x slower than into resident memory. Handing freed buffers to this pool
keeps their pages mapped and resident, and on CUDA the buffers are pinned (`memory.pinned`:
exactly the bytes asked for, where torch's pinned allocator would round up to a power of two), so
the next checkpoint reuses them at full copy speed. The pool never skips the fill that makes
memory resident: it makes the fill unnecessary by handing back memory that is already resident.

Policy, where every cap degrades to "no pool" (today's behaviour), never to something worse:
- byte cap = fraction x the *effective* (cgroup-aware) host total, read live on every put and
  trim: a 4 GiB pod on a 256 GiB host must not pool 16 GiB. A failed host query (0, negative or
  absurd) means cap 0: every put is declined.
- count cap, and a size floor: a buffer below it is cheap to allocate and is not pooled.
- a full pool displaces only buffers smaller than the incoming one (smallest first), so a pool
  wedged with buffers no later request can use recovers, while a pool of equal or larger buffers
  declines; it never evicts and then declines.
- get() is best fit; the caller's undersized buffer is offered back; a buffer the caller already
  owns that is large enough is a hit (the cheapest kind), not a miss.
- trim(max_idle_s) on idle, and trim(0) then exactly one retry when an allocation fails, so pooled
  bytes are always reclaimable under allocation pressure. The high-water marks survive trim.
- reserve(nbytes, count) fills the pool ahead of need (at load: a fresh pinned buffer costs far more
  than the copy into it, and a burst of checkpoints would pay that inside steps) and keeps that many
  warm: an idle trim leaves them, trim(0) (pressure, a failed allocation) and the byte cap do not.

Frees never wait on the device. Freeing a pinned buffer (cudaHostUnregister) blocks its caller
while device copies into or out of it run (1,071 ms to drop a 1 GiB buffer behind 1 s of GPU work,
H200). So put() takes the buffer's `fence`, an event behind every device copy that may still touch
it; a buffer the pool lets go of (declined, displaced, trimmed) while its fence is pending waits on
a pending-free list, and `free_copied()` (between steps, in every trim, and at shutdown) drops
those whose fence has completed; a pinned buffer dropped is unregistered and unmapped by the pool's
`Unpinner` thread, never by the thread that let it go. Until then its bytes still count as held
(`bytes_held` includes `pending_free_bytes`), against the cap too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from ballast.memory.pinned import Unpinner, pinned

log = logging.getLogger(__name__)

# No host has a petabyte of RAM; a larger "total" is a failed query multiplied out (sysconf()
# returning -1), and must bound the pool to nothing rather than to everything.
_ABSURD_TOTAL_BYTES = 1 << 50

Allocate = Callable[[int, bool], torch.Tensor]


class Fence(Protocol):
    """Completes once every device copy issued before it has run (a `torch.cuda.Event`)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class PoolMisuse(ValueError):
    """A caller broke the pool's contract (a buffer put twice, a view, a wrong dtype): a bug."""


@dataclass(frozen=True)
class PoolStats:
    hits: int
    misses: int
    bytes_held: int  # pooled buffers and those pending free: what the pool holds until really freed
    buffers: int  # pooled (can be handed out)
    high_water_bytes: int  # never reset by trim
    high_water_buffers: int
    evictions: int  # pooled buffers displaced by a larger incoming one
    declines: int  # puts refused (floor, caps, no pool)
    trimmed_bytes: int  # released by trim, cumulative
    cap_bytes: int  # byte cap at the last put or trim
    pin_failures: int
    pinned: bool
    # Let go of but not yet unmapped (part of bytes_held): waiting for their copies to run, or for
    # the unpinner's thread.
    pending_free_bytes: int = 0


@dataclass(eq=False)  # identity: list.remove must find this entry, not compare tensors
class _Entry:
    buf: torch.Tensor
    since: float  # clock() when pooled
    fence: Fence | None = None  # device copies of buf may run until it completes (None: none)

    @property
    def size(self) -> int:
        return self.buf.numel()


class CheckpointPool:
    """Thread-safe pool of 1-D uint8 CPU tensors. get() may return a buffer larger than asked."""

    def __init__(
        self,
        effective_total: Callable[[], int],
        fraction: float,
        max_buffers: int,
        min_buffer_bytes: int,
        *,
        pin: bool | None = None,
        allocate: Allocate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"pool fraction must be in [0, 1], got {fraction}")
        if max_buffers < 0 or min_buffer_bytes < 0:
            raise ValueError(
                f"pool caps must be non-negative (max_buffers={max_buffers}, "
                f"min_buffer_bytes={min_buffer_bytes})"
            )
        self._effective_total = effective_total
        self._fraction = fraction
        self._max_buffers = max_buffers
        self._min_bytes = min_buffer_bytes
        self._pin = torch.cuda.is_available() if pin is None else pin
        # Unpins the pool's buffers off the thread that frees them (`memory.pinned`).
        self.unpinner = Unpinner()
        self._allocate_fn = allocate or self._default_allocate
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._held = 0  # bytes of _entries
        self._pending: list[_Entry] = []  # let go of while their fence was pending (oldest first)
        self._pending_bytes = 0
        self._hits = self._misses = self._evictions = self._declines = 0
        self._trimmed = self._pin_failures = 0
        self._hw_bytes = self._hw_buffers = 0
        self._cap = 0
        self._pinned_ever = False
        self._warm = (0, 0)  # (bytes, count): buffers at least this large an idle trim leaves

    @property
    def pinned(self) -> bool:
        return self._pin

    def _default_allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        return pinned(nbytes, unpinner=self.unpinner) if pin else torch.empty(nbytes, dtype=torch.uint8)

    def cap_bytes(self) -> int:
        """The byte cap now: fraction x effective host total, 0 when the total is not known."""
        total = self._effective_total()
        if total <= 0 or total > _ABSURD_TOTAL_BYTES:
            return 0
        return int(total * self._fraction)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                hits=self._hits,
                misses=self._misses,
                bytes_held=self._held + self._pending_bytes + self.unpinner.pending_bytes,
                buffers=len(self._entries),
                high_water_bytes=self._hw_bytes,
                high_water_buffers=self._hw_buffers,
                evictions=self._evictions,
                declines=self._declines,
                trimmed_bytes=self._trimmed,
                cap_bytes=self._cap,
                pin_failures=self._pin_failures,
                pinned=self._pin,
                pending_free_bytes=self._pending_bytes + self.unpinner.pending_bytes,
            )

    def get(self, nbytes: int, owned: torch.Tensor | None = None) -> torch.Tensor:
        """A buffer of at least nbytes: the caller's own if large enough, else the best-fitting
        pooled one, else a fresh allocation. An undersized `owned` is offered back to the pool.
        A pooled buffer whose fence is pending is handed out too: its fence was recorded on the
        stream that the next owner's copies are ordered after, so they run after the old ones."""
        if nbytes < 1:
            raise ValueError(f"get needs nbytes >= 1, got {nbytes}")
        if owned is not None and owned.numel() >= nbytes:
            with self._lock:
                self._hits += 1
            return owned
        found: torch.Tensor | None = None
        if nbytes >= self._min_bytes:  # below the floor nothing is pooled, so nothing to find
            with self._lock:
                best = min((e for e in self._entries if e.size >= nbytes), key=lambda e: e.size, default=None)
                if best is not None:
                    self._entries.remove(best)
                    self._held -= best.size
                    self._hits += 1
                    found = best.buf
                else:
                    self._misses += 1
        if owned is not None:
            self.put(owned)
        return found if found is not None else self._allocate(nbytes)

    def put(self, buf: torch.Tensor, fence: Fence | None = None) -> bool:
        """Offer a buffer the caller no longer needs. `fence`: an event behind every device copy
        that may still read or write it (None: none can). True if pooled; False if declined, and
        then it is freed as if there were no pool: when the caller's last reference goes, or, while
        its fence is pending, once `free_copied` finds it complete. Never raises on a decline:
        callers reach this from cleanup paths."""
        self._check_buffer(buf)
        size = buf.numel()
        cap = self.cap_bytes()  # outside the lock: the callable may read a snapshot or a file
        with self._lock:
            self._cap = cap
            if any(e.buf.data_ptr() == buf.data_ptr() for e in (*self._entries, *self._pending)):
                raise PoolMisuse("buffer is already pooled: it would be handed to two owners")
            entry = _Entry(buf, self._clock(), fence)
            fits = size >= self._min_bytes and size <= cap and self._max_buffers > 0
            victims = self._plan_displacement(size, cap) if fits else None
            if victims is None:
                self._declines += 1
                self._let_go([entry])
                self._note_high_water()
                return False
            for v in victims:
                self._entries.remove(v)
                self._held -= v.size
            self._let_go(victims)
            self._evictions += len(victims)
            self._entries.append(entry)
            self._held += size
            self._note_high_water()
        return True

    def free_copied(self, wait: bool = False) -> int:
        """Free the buffers let go of whose copies have run (a host query per buffer, no wait);
        returns their bytes. wait: wait for every one's copies first, and until every pinned buffer
        freed is unmapped (at shutdown, and when an allocation failed: then those bytes are worth
        the wait)."""
        if wait:
            with self._lock:
                fences = [e.fence for e in self._pending if e.fence is not None]
            for fence in fences:  # outside the lock: a put from another thread is not held up
                fence.synchronize()
        with self._lock:
            done: list[_Entry] = []
            keep: list[_Entry] = []
            for e in self._pending:
                (done if e.fence is None or e.fence.query() else keep).append(e)
            self._pending = keep
            freed = sum(e.size for e in done)
            self._pending_bytes -= freed
        # Outside the lock: these were the buffers' last references, so their frees start here (a
        # pinned one goes to the unpinner's thread).
        done.clear()
        if wait:
            self.unpinner.wait()
        return freed

    def _let_go(self, entries: list[_Entry]) -> None:
        """Buffers the pool keeps no longer: one a copy may still touch waits on the pending-free
        list; the others are freed when the caller's last reference goes. Caller holds the lock."""
        for e in entries:
            if e.fence is not None and not e.fence.query():
                self._pending.append(e)
                self._pending_bytes += e.size

    def _note_high_water(self) -> None:
        self._hw_bytes = max(self._hw_bytes, self._held + self._pending_bytes + self.unpinner.pending_bytes)
        self._hw_buffers = max(self._hw_buffers, len(self._entries))

    def reserve(self, nbytes: int, count: int) -> int:
        """Allocate buffers of nbytes into the pool until it holds `count` of at least that size
        (as far as its caps allow), and keep that many warm through idle trims. Returns the
        buffers added. An allocation failure ends the filling early; it is not an error."""
        if nbytes < 1 or count < 0:
            raise ValueError(f"reserve needs nbytes >= 1 and count >= 0, got {nbytes}, {count}")
        with self._lock:
            self._warm = (nbytes, count)
        added = 0
        while self._held_of_size(nbytes) < count:
            try:
                buf = self._allocate_once(nbytes)
            except (RuntimeError, MemoryError) as e:
                log.warning("reserving checkpoint buffers stopped after %d: %s", added, e)
                break
            if not self.put(buf):
                break
            added += 1
        return added

    def _held_of_size(self, nbytes: int) -> int:
        with self._lock:
            return sum(1 for e in self._entries if e.size >= nbytes)

    def trim(self, max_idle_s: float) -> int:
        """Release buffers pooled at least max_idle_s ago (trim(0): all of them) except the warm
        reserve, then the oldest until the pool fits the live byte cap. Returns the bytes released
        (freed now, or once their copies have run: see `free_copied`)."""
        if max_idle_s < 0:
            raise ValueError(f"max_idle_s must be >= 0, got {max_idle_s}")
        cap = self.cap_bytes()
        now = self._clock()
        with self._lock:
            self._cap = cap
            keep = [e for e in self._entries if now - e.since < max_idle_s]
            dropped = [e for e in self._entries if now - e.since >= max_idle_s]
            if max_idle_s > 0:  # the warm reserve outlives idleness, never trim(0)
                warm_bytes, warm_count = self._warm
                room = warm_count - sum(1 for e in keep if e.size >= warm_bytes)
                for e in sorted(dropped, key=lambda e: -e.since):
                    if room <= 0:
                        break
                    if e.size >= warm_bytes:
                        dropped.remove(e)
                        keep.append(e)
                        room -= 1
            keep.sort(key=lambda e: e.since)
            while keep and sum(e.size for e in keep) > cap:
                dropped.append(keep.pop(0))
            self._entries = keep
            released = sum(e.size for e in dropped)
            self._held -= released
            self._trimmed += released
            self._let_go(dropped)
        self.free_copied()  # and what was let go of earlier, where its copies have run
        return released

    def _plan_displacement(self, size: int, cap: int) -> list[_Entry] | None:
        """The pooled buffers to evict so `size` fits both caps: smallest first and each smaller
        than the newcomer. [] if it fits as is; None if it cannot fit without evicting an equal or
        larger buffer (then nothing is evicted). Caller holds the lock."""
        held = self._held + self._pending_bytes + self.unpinner.pending_bytes  # pending: still mapped
        count = len(self._entries)
        victims: list[_Entry] = []
        for e in sorted(self._entries, key=lambda e: e.size):
            if held + size <= cap and count < self._max_buffers:
                break
            if e.size >= size:
                return None
            victims.append(e)
            held -= e.size
            count -= 1
        if held + size > cap or count >= self._max_buffers:
            return None
        return victims

    def _check_buffer(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
            raise PoolMisuse(
                f"pool buffers are 1-D uint8 CPU tensors, got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
            )
        if buf._base is not None or buf.storage_offset() != 0:
            raise PoolMisuse("put the buffer get() returned, not a view of it")

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            return self._allocate_once(nbytes)
        except (RuntimeError, MemoryError) as e:
            # Pooled bytes may be exactly what stands between us and this allocation: give them
            # back and retry once, waiting for the copies of buffers pending free (the one wait
            # worth taking: without those bytes the allocation fails). A second failure is real
            # and propagates.
            released = self.trim(0)
            released_later = self.free_copied(wait=True)
            log.warning(
                "checkpoint buffer of %d bytes failed (%s); trimmed %d pooled bytes, freed %d bytes "
                "once their copies had run, retrying once",
                nbytes,
                e,
                released,
                released_later,
            )
            return self._allocate_once(nbytes)

    def _allocate_once(self, nbytes: int) -> torch.Tensor:
        if self._pin:
            try:
                buf = self._checked(self._allocate_fn(nbytes, True), nbytes)
                self._pinned_ever = True
                return buf
            except RuntimeError as e:
                # Pin failure degrades to pageable for this buffer. If pinning never worked (no
                # driver, a locked-memory limit) it will not start working: stop trying.
                with self._lock:
                    self._pin_failures += 1
                    if not self._pinned_ever:
                        self._pin = False
                log.warning(
                    "pinned checkpoint buffer of %d bytes failed (%s); using pageable memory", nbytes, e
                )
        return self._checked(self._allocate_fn(nbytes, False), nbytes)

    @staticmethod
    def _checked(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < nbytes:
            raise PoolMisuse(f"allocate returned {buf.dtype} {tuple(buf.shape)} for {nbytes} bytes")
        return buf
