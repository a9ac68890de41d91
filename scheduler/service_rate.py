"""How fast the slots turn over while work waits: the service rate behind `max_queue_wait_s`.

Only intervals between requests leaving slots while others waited count: one spanning a quiet spell
would make the server look slow and refuse work it could do, so a spell without backlog breaks the
chain.
"""

from __future__ import annotations

from collections import deque

from ballast.scheduler.errors import QueueWaitTooLong

# A request is refused on the estimate only when it overshoots the bound by this factor: the rate
# is measured, not known (requests ahead may leave, steps speed up once a burst's connections are
# parsed), and a false refusal costs a client a retry elsewhere. The bound itself is enforced
# exactly on the time a request has really waited.
ESTIMATE_MARGIN = 1.25


class ServiceRate:
    def __init__(self, window: int = 64, min_samples: int = 16) -> None:
        """min_samples: intervals needed before the rate is trusted (and a request refused on it)."""
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
        """Seconds until a request with `ahead` queued before it gets a slot, all slots busy now."""
        rate = self.per_s
        return None if rate is None else (ahead + 1) / rate


class QueueWaitBound:
    """`max_queue_wait_s` applied: whether a queued request should be refused now rather than wait."""

    def __init__(self, bound_s: float, retry_after_s: float, rate: ServiceRate) -> None:
        self.bound_s = bound_s
        self.retry_after_s = retry_after_s
        self.rate = rate

    def late(self, ahead: int, waited: float, slot_free: bool) -> QueueWaitTooLong | None:
        """The refusal, or None to let it wait (with a slot free it starts next step)."""
        bound = self.bound_s
        if bound <= 0:
            return None
        still = 0.0 if slot_free else self.rate.wait_s(ahead) or 0.0
        if waited < bound and waited + still <= bound * ESTIMATE_MARGIN:
            return None
        # Come back when the queue should have shrunk enough to fit the bound again.
        retry = min(bound, max(self.retry_after_s, waited + still - bound))
        return QueueWaitTooLong(retry, waited + still, bound, estimated=waited < bound)
