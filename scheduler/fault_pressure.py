"""Steps that fail for want of memory, as a pressure level the governor adds to the snapshot's.

An out-of-memory error inside a step is a memory signal the snapshot may not show (a co-tenant
took the VRAM the activations need between two polls, or fragmentation): each one raises the
level one rung above the worst of it and the snapshot's, so the ladder shrinks the work (WATCH
sheds the prefix cache, TIGHT halves the slots and the prefill window, CRITICAL leaves one
slot; from TIGHT on new work is refused at once and /ready takes the server out of the load
balancer's rotation). The
level steps down one rung per `calm_s` without such a failure: a refused client told to retry
after `calm_s` finds the server one rung calmer, and when the failures stop it is back at OK after
three of them.
"""

from __future__ import annotations

from ballast.memory.types import Level


class FaultPressure:
    def __init__(self, calm_s: float) -> None:
        self._calm_s = calm_s
        self._level = Level.OK
        self._at = 0.0  # when the level was last raised (monotonic seconds)
        self.memory_failures = 0

    def failed(self, now: float, snapshot_level: Level) -> None:
        """A step failed for want of memory at `now`."""
        self.memory_failures += 1
        base = max(self.level(now), snapshot_level)
        self._level = Level(min(Level.CRITICAL, base + 1))
        self._at = now

    def level(self, now: float) -> Level:
        if self._level is Level.OK:
            return Level.OK
        if self._calm_s <= 0:
            return Level.OK
        calmed = int((now - self._at) / self._calm_s)
        return Level(max(Level.OK, self._level - calmed))

    def reason(self, now: float) -> str | None:
        """Why the level is raised, or None at OK."""
        level = self.level(now)
        if level is Level.OK:
            return None
        return f"steps failing for want of memory ({self.memory_failures} so far): {level.name}"
