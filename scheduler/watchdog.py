"""The step watchdog: how long the step in flight may take before the engine counts as stalled.

A step that never returns (a kernel spinning, a deadlocked collective, a driver hang) would
otherwise hold every request forever while the probes stay green. The deadline is derived from
measured step times: max(floor, STEP_P99_FACTOR x the p99 of recent steps). The first step of a
prefill size not seen before may compile kernels (Triton, torch.compile) and gets NEW_SHAPE_FACTOR
x the floor instead. A step's time runs from when it could start (its submission, or the previous
step's end when it was queued behind one) to its result.
"""

from __future__ import annotations

from collections import deque

# A step 20x slower than the p99 of its recent peers is not slow, it is stuck.
STEP_P99_FACTOR = 20.0
# A never-seen prefill size may compile its kernels first (fla's kernels from a cold Triton cache
# took minutes on an H200); ten floors cover that without waiting forever.
NEW_SHAPE_FACTOR = 10.0
_WINDOW = 512  # recent step times the p99 is taken over
_RECOMPUTE_EVERY = 32  # steps between p99 updates (a sort of the window)


def shape_of(prefill_tokens: int) -> int:
    """The bucket a step's prefill size falls in (0: decode tokens only): the next power of two,
    as kernels are tuned and graphs captured by size classes."""
    return 0 if prefill_tokens <= 0 else 1 << (prefill_tokens - 1).bit_length()


class StepWatchdog:
    """floor_s: the least deadline (0 = no watchdog)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._times: deque[float] = deque(maxlen=_WINDOW)
        self._p99 = 0.0
        self._since_recompute = 0
        self._seen: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.floor_s > 0

    def deadline_s(self, shape: int) -> float:
        """How long a step of `shape` (see `shape_of`) may run."""
        if shape not in self._seen:
            return self.floor_s * NEW_SHAPE_FACTOR
        return max(self.floor_s, STEP_P99_FACTOR * self._p99)

    def completed(self, shape: int, seconds: float) -> None:
        """A step of `shape` returned after `seconds`."""
        self._seen.add(shape)
        self._times.append(seconds)
        self._since_recompute += 1
        if self._since_recompute >= _RECOMPUTE_EVERY or len(self._times) < _RECOMPUTE_EVERY:
            self._since_recompute = 0
            ordered = sorted(self._times)
            self._p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    @property
    def p99_s(self) -> float:
        return self._p99
