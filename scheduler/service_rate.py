"""How fast the slots turn over while work waits: the measured service rate behind the queue-wait
bound (`max_queue_wait_s`).

Only the intervals between requests leaving their slots while others were waiting count: that is
the rate at which the queue moves. An interval that spans a quiet spell (no backlog) would make
the server look slow and refuse work it could do, so a spell without backlog breaks the chain.
"""

from __future__ import annotations

from collections import deque


class ServiceRate:
    def __init__(self, window: int = 64, min_samples: int = 16) -> None:
        """window: the intervals the rate averages over; min_samples: intervals needed before
        the rate is trusted (until then no request is refused on an estimate)."""
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("need window >= 1 and 1 <= min_samples <= window")
        self._intervals: deque[float] = deque(maxlen=window)
        self._min = min_samples
        self._last: float | None = None

    def left_slot(self, now: float, backlog: bool) -> None:
        """A request left its slot at `now`; `backlog`: others were waiting for one."""
        if backlog and self._last is not None:
            self._intervals.append(max(0.0, now - self._last))
        self._last = now if backlog else None

    @property
    def per_s(self) -> float | None:
        """Requests per second leaving slots under backlog; None until measured."""
        if len(self._intervals) < self._min:
            return None
        span = sum(self._intervals)
        return len(self._intervals) / span if span > 0 else None

    def wait_s(self, ahead: int) -> float | None:
        """Seconds until a request with `ahead` requests queued before it gets a slot, when every
        slot is busy now; None when the rate is not known yet."""
        rate = self.per_s
        return None if rate is None else (ahead + 1) / rate
