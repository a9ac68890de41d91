"""The step watchdog: how long the step in flight may take before the engine counts as stalled.

A step that never returns (a spinning kernel, a deadlocked collective) would hold every request
forever while the probes stay green. The deadline per size class of the step's prefill (a 2k
prefill and a decode differ a hundredfold) is max(floor, STEP_P99_FACTOR x the class's recent
p99). A class's first step may compile kernels: it gets NEW_SHAPE_FACTOR x the floor and is not
timed. A step's time runs from when it could start (the scheduler's: its sending, or the return
of the step before), the time `StepCosts` measures.
"""

from __future__ import annotations

import time
from collections import deque

# A step 20x slower than the p99 of its recent peers is not slow, it is stuck.
STEP_P99_FACTOR = 20.0
# A never-seen prefill size may compile its kernels first (fla's kernels from a cold Triton cache
# took minutes on an H200); ten floors cover that without waiting forever.
NEW_SHAPE_FACTOR = 10.0
_WINDOW = 256  # recent step times of a class the p99 is taken over
_RECOMPUTE_EVERY = 32  # steps of a class between p99 updates (a sort of its window)


def shape_of(prefill_tokens: int) -> int:
    """The class a step's prefill size falls in (0: decode tokens only): the next power of two,
    as kernels are tuned and graphs captured by size classes."""
    return 0 if prefill_tokens <= 0 else 1 << (prefill_tokens - 1).bit_length()


class _Times:
    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=_WINDOW)
        self.p99 = 0.0
        self.since = 0

    def add(self, seconds: float) -> None:
        self.times.append(seconds)
        self.since += 1
        if self.since >= _RECOMPUTE_EVERY or len(self.times) < _RECOMPUTE_EVERY:
            self.since = 0
            ordered = sorted(self.times)
            self.p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class StepWatchdog:
    """floor_s: the least deadline (0 = no watchdog)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._classes: dict[int, _Times] = {}

    @property
    def enabled(self) -> bool:
        return self.floor_s > 0

    def deadline_s(self, shape: int) -> float:
        """How long a step of `shape` (see `shape_of`) may run."""
        seen = self._classes.get(shape)
        if seen is None:
            return self.floor_s * NEW_SHAPE_FACTOR
        return max(self.floor_s, STEP_P99_FACTOR * seen.p99)

    def completed(self, shape: int, seconds: float) -> None:
        seen = self._classes.get(shape)
        if seen is None:  # its first step: compiling, maybe; known from now on, not yet timed
            self._classes[shape] = _Times()
        else:
            seen.add(seconds)

    def overdue(self, shape: int, since: float) -> tuple[float, float] | None:
        """(seconds it has run, its deadline) for a step in flight since `since` (monotonic
        seconds) past its deadline; else None."""
        if not self.enabled:
            return None
        deadline = self.deadline_s(shape)
        ran = time.monotonic() - since
        return (ran, deadline) if ran >= deadline else None
