"""When each queued request would get its first token: the FCFS queue played forward on the
measured step costs.

A request starts when three things are true at once: a slot is free, its KV blocks fit (the room
now, plus the blocks running requests give back as they end, less what the requests started ahead
of it take), and the prefill of every prompt ahead of it is done. It waits for the one that held
the queue longest. Counting slots alone (the first estimate) took a free slot for a start while
the head waited for blocks: every request behind it waited out the whole bound and was refused
then (a 2 GiB CPU container: 37 refusals after 30.1 s each).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ballast.scheduler.service_rate import StepCosts

# Given the blocks that came back by then (net of what requests started ahead took), whether the
# request's blocks fit: the admission verdict itself, read on the shifted room.
Fits = Callable[[int], bool]
# What `place` changed: clock, slots, blocks, rows, prefill end, blame, ends popped, end pushed.
Undo = tuple[float, int, int, int, float, tuple[float, ...], tuple[tuple[float, int], ...], tuple[float, int]]


@dataclass(frozen=True)
class Demand:
    """A request as the projection sees it."""

    feed: int  # prompt tokens still to prefill
    remaining: int  # tokens it is projected still to generate
    blocks: int  # KV blocks its whole window takes


@dataclass(frozen=True)
class Placement:
    """Seconds from now to a request's start (its prefill may begin) and to its first token;
    `at_once`: nothing but the step in flight stood in its way."""

    start_s: float
    first_token_s: float
    at_once: bool
    waits_for: str  # "nothing", "a slot", "KV blocks" or "prefill compute": what held it longest
    _undo: Undo = field(repr=False, compare=False)

    def read(self, factor: float) -> Placement:
        """The placement with its seconds times `factor` (the projection's measured error, as a
        new request's admission reads it); taken back with the projection's `undo` as itself."""
        return replace(self, start_s=self.start_s * factor, first_token_s=self.first_token_s * factor)

    def unblamed(self, limit_s: float) -> bool:
        """Nothing but the step in flight is ahead of it and its own prefill alone passes
        `limit_s` (the bound): no wait is to blame and none would help (served, as when idle)."""
        return self.at_once and self.first_token_s - self.start_s > limit_s


class WaitProjection:
    def __init__(self, costs: StepCosts, free_slots: int, running: Sequence[Demand]) -> None:
        """costs: measured, or bounded by a step in flight (`costs.known`). running: the requests
        in slots, in admission order, their prompt tokens in the step in flight counted as done;
        nothing starts before that step ends. Taken as over at once, it let a request that came
        while two 440-token prompts were prefilled (2.8 s) in at 1.7 s projected: served at 4.3 s."""
        self._costs = costs
        self._origin = costs.in_flight_s()  # when the step in flight ends
        self._t = self._origin  # the last placed request's start: FCFS, none behind it starts earlier
        self._free = free_slots
        self._gain = 0  # blocks back from ends, less blocks taken by starts, so far
        self._active = len(running)
        self._ends: list[tuple[float, int]] = []  # heap of (seconds to a request's end, its blocks)
        self._prefill_at = self._origin  # when the prompts ahead have all been prefilled
        self._blame = dict.fromkeys(("a slot", "KV blocks", "prefill compute"), 0.0)  # seconds held, by cause
        step = self._decode_step_s()
        for d in running:  # prompts still prefilling go first, in admission order
            first = self._prefill_at = self._prefill_at + self._prefill_s(d.feed)
            self._ends.append((first + d.remaining * step, d.blocks))
        heapq.heapify(self._ends)

    def _decode_step_s(self) -> float:
        return self._costs.decode_s(max(1, self._active)) or 0.0

    def _prefill_s(self, tokens: int) -> float:
        """A prompt's prefill: its tokens, and the step that carries it (its rows and the head),
        which the per-token cost is measured net of (without it a burst of short prompts came
        out 30% quicker than it ran)."""
        return self._costs.prefill_s(tokens, self._active) if tokens else 0.0

    def place(self, demand: Demand, fits: Fits) -> Placement:
        """Where `demand` starts behind everything placed so far; it counts for those placed after."""
        undo = (self._t, self._free, self._gain, self._active, self._prefill_at, tuple(self._blame.values()))
        popped: list[tuple[float, int]] = []
        while self._free < 1 or not fits(self._gain):
            if not self._ends:
                break  # nothing more comes back: admission decides with what there is
            cause = "a slot" if self._free < 1 else "KV blocks"
            end = heapq.heappop(self._ends)
            popped.append(end)
            self._blame[cause] += max(0.0, end[0] - self._t)
            self._t = max(self._t, end[0])
            self._free, self._gain, self._active = self._free + 1, self._gain + end[1], self._active - 1
        start = max(self._t, self._prefill_at)
        self._blame["prefill compute"] += start - self._t  # the prompts ahead
        waits_for = max(self._blame, key=self._blame.__getitem__)  # what held the queue longest, or
        if not self._blame[waits_for]:  # nothing but the step in flight, if any
            waits_for = "prefill compute" if 0 < start <= self._origin else "nothing"
        self._t = start
        first = self._prefill_at = start + self._prefill_s(demand.feed)
        self._free, self._gain, self._active = self._free - 1, self._gain - demand.blocks, self._active + 1
        own = (first + demand.remaining * self._decode_step_s(), demand.blocks)
        heapq.heappush(self._ends, own)
        return Placement(start, first, start <= self._origin, waits_for, (*undo, tuple(popped), own))

    def undo(self, placement: Placement) -> None:
        """Take back the last `place` (a request refused instead of queued)."""
        t, free, gain, active, prefill_at, blame, popped, own = placement._undo
        self._blame = dict(zip(self._blame, blame, strict=True))
        self._ends.remove(own)
        self._ends.extend(popped)
        heapq.heapify(self._ends)
        self._t, self._free, self._gain, self._active, self._prefill_at = t, free, gain, active, prefill_at
