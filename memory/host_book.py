"""The host book: host bytes we committed (or are about to) that a snapshot does not show yet.

The host budget is read from the OS (MemAvailable, the cgroup's usage) once a poll, so bytes we
take between two polls are invisible to it. Worse, memory mapped MAP_NORESERVE commits nothing
until written: a budget that forgets its grants when the next snapshot arrives grants the same
bytes again on every poll while RSS stays flat, and the pages written later are then covered by
no budget at all (in a memory cgroup the end is the OOM killer, not a refusal).

So every grant is an entry here, counted against every snapshot taken before it was committed:

- `take()` books bytes before they are allocated (pending: counted against every snapshot);
- the holder calls `committed()` once the pages exist (written, or pinned): the entry is stamped
  with the poll epoch it was committed in;
- each poll calls `begin_read()` just before it reads the OS figures, which bumps the epoch: a
  snapshot read at epoch e already shows every entry stamped <= e, and no other;
- `release()` forgets an entry (its pages went back to the OS, or never came).

A snapshot's unseen bytes are therefore exact, and need no timing assumption: an entry counts
until a read that began after its pages existed. Entries a snapshot shows are kept a while (old
snapshots are still read, e.g. by the scheduler between two refreshes) and then dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

# Committed entries are forgotten this many polls after the epoch they were committed in: a
# snapshot older than that (16 s at the default 250 ms poll) counts as stale anyway.
KEEP_EPOCHS = 64


@dataclass(eq=False)  # entries are told apart by identity: two of one size are two bookings
class _Entry:
    nbytes: int
    epoch: int | None = None  # the epoch its pages were committed in; None: not yet


class HostGrant:
    """One booking in the book: `committed()` once its pages exist, `release()` when they are gone
    (idempotent). Calling the grant releases it, so it serves as an Acquire's give-back."""

    def __init__(self, book: HostBook, entry: _Entry) -> None:
        self._book = book
        self._entry = entry

    @property
    def nbytes(self) -> int:
        return self._entry.nbytes

    def committed(self) -> None:
        self._book._stamp(self._entry)

    def release(self) -> None:
        self._book._forget(self._entry)

    def __call__(self) -> None:
        self.release()


class HostBook:
    """Thread-safe; one per MemWatch. Its lock is re-entrant: a taker's `room` reads the book again
    under it (MemWatch.exact), and no other taker can book between that read and the booking."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._epoch = 0
        self._entries: list[_Entry] = []

    def take(self, nbytes: int, room: Callable[[], int]) -> HostGrant | None:
        """Book nbytes if they fit in `room()`, the host budget left beside what the book holds
        (read inside the book's lock, so two takers cannot both see the same room). None, with
        nothing booked, when they do not fit."""
        if nbytes < 0:
            raise ValueError(f"host grant of {nbytes} bytes")
        with self._lock:
            if nbytes > room():
                return None
            entry = _Entry(nbytes)
            self._entries.append(entry)
            return HostGrant(self, entry)

    def spent(self, nbytes: int) -> None:
        """Bytes already committed outside any grant (a pinned buffer just filled): counted
        against every snapshot read before now, and gone from the book once a poll shows them."""
        with self._lock:
            self._entries.append(_Entry(nbytes, self._epoch))

    def unseen(self, epoch: int) -> int:
        """Bytes booked that a snapshot read at `epoch` does not show."""
        with self._lock:
            return self._unseen_locked(epoch)

    @property
    def epoch(self) -> int:
        return self._epoch

    def begin_read(self) -> int:
        """A poll is about to read the OS figures: returns the epoch its snapshot is read at."""
        with self._lock:
            epoch = self._epoch
            self._epoch += 1
            floor = epoch - KEEP_EPOCHS
            self._entries = [e for e in self._entries if e.epoch is None or e.epoch > floor]
            return epoch

    def _unseen_locked(self, epoch: int) -> int:
        return sum(e.nbytes for e in self._entries if e.epoch is None or e.epoch > epoch)

    def _stamp(self, entry: _Entry) -> None:
        with self._lock:
            if entry.epoch is None:
                entry.epoch = self._epoch

    def _forget(self, entry: _Entry) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if e is not entry]
