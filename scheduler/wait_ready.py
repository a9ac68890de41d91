"""/ready from the queue wait: a replica where a new request would wait near the bound says so
before it starts refusing, so a gateway routes elsewhere instead of finding out by 429s.

Hysteresis, so a gateway probing every second does not see it flap with every step: not ready once
a new request is projected past NOT_READY_SHARE of the bound (below the ARRIVAL_SHARE at which one
is refused, so the probe turns first), ready again only at READY_SHARE and no sooner than HOLD_S
after it turned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ballast.scheduler.wait_projection import Placement

log = logging.getLogger(__name__)

NOT_READY_SHARE = 0.5
READY_SHARE = 0.25
HOLD_S = 2.0


class WaitReadiness:
    def __init__(self, bound_s: float, inputs: Callable[[], str] = str) -> None:
        """inputs: what the projection stands on now, for the log line of each turn to not ready."""
        self._bound, self._inputs = bound_s, inputs
        self.reason: str | None = None  # why a gateway should not route here now; None: it may
        self._since = 0.0

    def update(self, probe: Placement | None, now: float) -> None:
        """probe: where a request like the recent ones would start if it came now (None: unknown)."""
        bound = self._bound
        if bound <= 0:
            return
        # behind nothing but the step in flight, its wait is that step's end (its own prefill is none)
        wait = None if probe is None else probe.start_s if probe.at_once else probe.first_token_s
        if self.reason is None:
            if wait is not None and probe is not None and wait > bound * NOT_READY_SHARE:
                self._turn(wait, probe.waits_for, now)
        elif (wait is None or wait <= bound * READY_SHARE) and now - self._since >= HOLD_S:
            self.reason = None

    def refused(self, wait_s: float, waits_for: str, now: float) -> None:
        """A request was refused for its wait: not ready, whatever the probe said."""
        if self._bound > 0:
            self._turn(wait_s, waits_for, now)

    def _turn(self, wait_s: float, waits_for: str, now: float) -> None:
        if self.reason is None:
            log.info(
                "not ready for the queue wait: %.1f s for %s, projected on %s",
                wait_s,
                waits_for,
                self._inputs(),
            )
        self.reason = (
            f"queue wait: a new request would wait {wait_s:.1f} s for {waits_for} "
            f"(max queue wait {self._bound:g} s)"
        )
        self._since = now
