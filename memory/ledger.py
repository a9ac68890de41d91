"""The VRAM ledger: our own named leases per GPU ("die"), refused before the driver would OOM.

Each die has a ceiling = min(budget, usable free at load x vram_usable_fraction), budget = total -
die reserve. Why the free-at-load term: a ceiling taken from the nominal total sits
above what the driver can really hand out when something else (another process, the display,
the CUDA context itself) holds VRAM, so the ledger would grant a lease the driver then fails as
an OOM — a cliff. Clamping to measured free x 0.90 makes the ledger refuse first, cleanly and
retryably: the cliff becomes a plateau. It does not make more fit; it changes how "too much" fails.

Register a die before anything of ours is on it (free "at load" must not count our own weights).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ballast.memory.errors import LedgerFull, UnknownDie


@dataclass(frozen=True)
class DieBudget:
    """Ledger figures for one die."""

    die: int
    total_bytes: int
    budget_bytes: int  # total - die reserve
    ceiling_bytes: int  # what leases may add up to
    held_bytes: int
    leases: int


class Lease:
    """Bytes of one die held under a tag until `release()` (idempotent) or the end of a `with`."""

    def __init__(self, ledger: VramLedger, die: int, nbytes: int, tag: str) -> None:
        self.die = die
        self.nbytes = nbytes
        self.tag = tag
        self._ledger = ledger
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self._ledger._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"Lease(die={self.die}, nbytes={self.nbytes}, tag={self.tag!r}, {state})"


class _Die:
    def __init__(self, total: int, budget: int, ceiling: int) -> None:
        self.total = total
        self.budget = budget
        self.ceiling = ceiling
        self.held = 0
        self.leases: set[Lease] = set()


class VramLedger:
    """Thread-safe per-die lease book. Only the ledger changes its totals."""

    def __init__(self, die_reserve_bytes: int, usable_fraction: float) -> None:
        if die_reserve_bytes < 0 or not 0.0 < usable_fraction <= 1.0:
            raise ValueError(
                f"die reserve {die_reserve_bytes} must be >= 0 and usable fraction {usable_fraction} in (0, "
                "1]"
            )
        self.die_reserve_bytes = die_reserve_bytes
        self.usable_fraction = usable_fraction
        self._lock = threading.Lock()
        self._dies: dict[int, _Die] = {}

    def register_die(self, die: int, total_bytes: int, free_bytes: int) -> int:
        """Set a die's ceiling from its total and the free VRAM measured now; returns the ceiling.

        Registering again (after re-measuring) moves the ceiling and keeps the leases; a ceiling
        that ends up below what is held refuses new leases until enough are released.
        """
        if die < 0 or total_bytes < 0 or free_bytes < 0:
            raise ValueError(f"die {die}: total {total_bytes} and free {free_bytes} must be >= 0")
        budget = max(0, total_bytes - self.die_reserve_bytes)
        ceiling = min(budget, int(free_bytes * self.usable_fraction))
        with self._lock:
            entry = self._dies.get(die)
            if entry is None:
                self._dies[die] = _Die(total_bytes, budget, ceiling)
            else:
                entry.total, entry.budget, entry.ceiling = total_bytes, budget, ceiling
        return ceiling

    def lease(self, die: int, nbytes: int, tag: str) -> Lease:
        """Hold `nbytes` on `die`, or raise `LedgerFull` if the ceiling would be passed."""
        if nbytes < 0:
            raise ValueError(f"lease {tag!r}: nbytes {nbytes} must be >= 0")
        with self._lock:
            entry = self._entry(die)
            if entry.held + nbytes > entry.ceiling:
                raise LedgerFull(die=die, asked=nbytes, held=entry.held, ceiling=entry.ceiling, tag=tag)
            lease = Lease(self, die, nbytes, tag)
            entry.held += nbytes
            entry.leases.add(lease)
            return lease

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            entry = self._dies[lease.die]
            entry.held -= lease.nbytes
            entry.leases.discard(lease)

    def _entry(self, die: int) -> _Die:
        entry = self._dies.get(die)
        if entry is None:
            raise UnknownDie(die)
        return entry

    def held(self, die: int) -> int:
        """Bytes leased on `die` (0 for a die never registered)."""
        with self._lock:
            entry = self._dies.get(die)
            return entry.held if entry else 0

    def ceiling(self, die: int) -> int:
        """The die's ceiling (0 for a die never registered: nothing may be leased there)."""
        with self._lock:
            entry = self._dies.get(die)
            return entry.ceiling if entry else 0

    def headroom(self, die: int) -> int:
        """Bytes a new lease on `die` may still take."""
        with self._lock:
            entry = self._entry(die)
            return max(0, entry.ceiling - entry.held)

    def dies(self) -> tuple[DieBudget, ...]:
        """Per-die totals, consistent with each other (one lock hold), ordered by die."""
        with self._lock:
            return tuple(
                DieBudget(
                    die=d,
                    total_bytes=e.total,
                    budget_bytes=e.budget,
                    ceiling_bytes=e.ceiling,
                    held_bytes=e.held,
                    leases=len(e.leases),
                )
                for d, e in sorted(self._dies.items())
            )

    def leases(self, die: int) -> tuple[tuple[str, int], ...]:
        """(tag, bytes) of every lease held on `die`, largest first: what an operator asks for
        when the ledger is full."""
        with self._lock:
            entry = self._dies.get(die)
            held = list(entry.leases) if entry else []
        return tuple(sorted(((lease.tag, lease.nbytes) for lease in held), key=lambda t: -t[1]))
