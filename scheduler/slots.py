"""The slot table: the one owner of the engine's slots on the scheduler side.

A slot is FREE, BUSY (a request holds it) or DRAINING (its request ended; the release travels in
the next StepPlan). A draining slot becomes free only after the plan that carried its release
has run, so a slot is never handed to a new request while the engine may still hold the old
one's state; reuse therefore always starts from a clean slot.
"""

from __future__ import annotations

import enum


class SlotState(enum.Enum):
    FREE = "free"
    BUSY = "busy"
    DRAINING = "draining"


class SlotError(RuntimeError):
    """A slot was used against its state (a scheduler bug, never a client error)."""


class SlotTable:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("slot table needs at least one slot")
        self._state = [SlotState.FREE] * capacity
        self._in_release: set[int] = set()  # draining slots whose release is in a plan in flight

    @property
    def capacity(self) -> int:
        return len(self._state)

    def acquire(self, limit: int) -> int | None:
        """The lowest free slot below `limit`, now busy; None if there is none. Lowest-first keeps
        live slots packed at the bottom so a lowered ceiling is reached as requests finish."""
        for slot in range(min(limit, self.capacity)):
            if self._state[slot] is SlotState.FREE:
                self._state[slot] = SlotState.BUSY
                return slot
        return None

    def has_free(self, limit: int) -> bool:
        return any(st is SlotState.FREE for st in self._state[: max(0, limit)])

    def retire(self, slot: int) -> None:
        """The request in `slot` ended: release it in the next plan."""
        self._expect(slot, SlotState.BUSY)
        self._state[slot] = SlotState.DRAINING

    def take_releases(self) -> tuple[int, ...]:
        """Draining slots not yet sent to the engine; they go into the plan being built."""
        out = self._unsent_releases()
        self._in_release.update(out)
        return out

    def released(self, slots: tuple[int, ...]) -> None:
        """The plan carrying these releases has run: the slots are free again."""
        for slot in slots:
            self._expect(slot, SlotState.DRAINING)
            self._in_release.discard(slot)
            self._state[slot] = SlotState.FREE

    def _unsent_releases(self) -> tuple[int, ...]:
        return tuple(
            s for s, st in enumerate(self._state) if st is SlotState.DRAINING and s not in self._in_release
        )

    def _expect(self, slot: int, state: SlotState) -> None:
        actual = self._state[slot] if 0 <= slot < self.capacity else None
        if actual is not state:
            found = "out of range" if actual is None else actual.value
            raise SlotError(f"slot {slot} is {found}, expected {state.value}")

    # Figures (read-only).
    @property
    def busy(self) -> int:
        return self._state.count(SlotState.BUSY)

    @property
    def draining(self) -> int:
        return self._state.count(SlotState.DRAINING)

    @property
    def releases_pending(self) -> bool:
        """Draining slots whose release is in no plan yet."""
        return bool(self._unsent_releases())

    @property
    def free(self) -> int:
        return self._state.count(SlotState.FREE)

    @property
    def highest_held(self) -> int:
        """1 + the highest slot not free (0 if all free): the engine may not shrink below it."""
        for slot in range(self.capacity - 1, -1, -1):
            if self._state[slot] is not SlotState.FREE:
                return slot + 1
        return 0

    @property
    def idle(self) -> bool:
        return self.free == self.capacity
