"""How fast the engine serves, measured: the figures the queue-wait estimate projects with, and
the prompt budget beside decodes (`prompt_budget.py`) sizes steps by.

A queued request may wait for a slot, for KV blocks that running requests will give back, or for
the prefill of the prompts ahead of it. Each of those waits is a number of engine steps, so what is
measured is the steps themselves: seconds of a decode step by batch size, seconds per prefill
token; and how much of its `max_tokens` a request really uses (most chats stop at EOS long before),
so that a running request's end is projected from what requests like it did, not from its cap.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from collections.abc import Callable

from ballast.scheduler.watchdog import shape_of

# Each cost is the mean of the middle half of its last WINDOW samples. Steps vary a lot: a step
# sent ahead of the one before is timed from that one's end, so a batch's steps alternate between
# ~1 ms and ~100 ms (the pair's sum is right); and one step of a process the OS put aside took 3.4 s
# among 100 ms ones on a shared 2-core box, which a running mean (weight 0.25) carried into a 39 s
# projected wait and a 429 for four chats. The middle half drops such spikes, averages the
# alternation, and follows a real change (a bigger batch, a longer context) within 3/4 of a window.
WINDOW = 12
# Steps with fewer prompt tokens than this do not measure a prompt token's cost: their difference
# from a decode step's is mostly noise.
MIN_MEASURED_TOKENS = 16


class _Recent:
    """The last WINDOW samples of one cost; their interquartile mean. Until one is measured, the
    least of the first steps (a first step is never quicker than a warm one: it errs long)."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._first = math.inf

    def add(self, x: float, first: bool = False) -> None:
        if first:
            self._first = min(self._first, x)
        else:
            self._samples.append(x)

    @property
    def value(self) -> float:
        if not self._samples:
            return self._first
        ordered = sorted(self._samples)
        cut = len(ordered) // 4
        middle = ordered[cut : len(ordered) - cut]
        return sum(middle) / len(middle)


# A request's use of its max_tokens is projected at this quantile of the recent ones: a request
# projected to end too early lets work in that would wait past the bound, and such a request is
# refused late, which is what the estimate is for avoiding.
LENGTH_QUANTILE = 0.9


class StepCosts:
    """Seconds of a decode step by rows in it, and of a prefill token; None until a step is
    measured. The first step of each size class is not counted among the samples: it may have
    compiled kernels or touched pages for the first time (a cold 1,300-token prefill on a CPU
    measured 20x a warm one). It stands in for a cost no warm step has measured yet, and goes when
    one has: left out, a server whose warm-up prefilled once (one first step) knew no prefill cost,
    queued a burst of 24 requests on 2 slots and refused 22 at the end of the bound (2.4 s) instead
    of at arrival. On a CPU the first 400-token prefill after start-up measured as a warm one
    (1.92 against 1.64-1.86 s: the load's short forwards took the first-call costs), and a GPU's
    start-up warm-up runs every size class before /ready.

    Before a kind is measured, the step in flight bounds it from below: run `e` s over `n` tokens
    (rows and prompt tokens), a step of m tokens takes at least e x min(m, n) / n (a step's time
    grows from a base >= 0 with its tokens; a decode row costs no less than a prompt token). With
    no projection before the first step came back, the CPU burst's warm phase queued 6 requests
    and refused each at its bound's end (2 s); the floor refuses them as it passes the bound."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._seen: set[int] = set()  # size classes (shape_of) whose first step has run
        self._decode: dict[int, _Recent] = {}  # decode rows -> seconds of a decode-only step
        self._rows: list[int] = []  # the keys of _decode, sorted
        self._prefill_token: _Recent | None = None
        self._clock = clock
        # (decode rows, prompt tokens, busy since) of the step in flight
        self._flight: tuple[int, int, float] | None = None

    def sent(self, decode_rows: int, prefill_tokens: int, since: float) -> None:
        """The step the loop now waits for, busy on the engine since `since` (the clock's)."""
        busy = decode_rows + prefill_tokens > 0
        self._flight = (decode_rows, prefill_tokens, since) if busy else None

    def _floor(self, tokens: int) -> float | None:
        """The least a step of `tokens` tokens takes, from the step in flight; None without one."""
        if self._flight is None:
            return None
        rows, prompt, since = self._flight
        return max(0.0, self._clock() - since) * min(tokens, rows + prompt) / (rows + prompt)

    def in_flight_s(self) -> float:
        """What the step in flight is projected still to take: nothing queued starts before it
        ends (0 without one, or past its projection)."""
        if self._flight is None:
            return 0.0
        rows, prompt, since = self._flight
        whole = self.prefill_s(prompt, rows) if prompt else (self.decode_s(rows) or 0.0)
        return max(0.0, whole - (self._clock() - since))

    def stepped(self, seconds: float, decode_rows: int, prefill_tokens: int) -> None:
        """A step of `decode_rows` decodes and `prefill_tokens` prompt tokens took `seconds`."""
        self._flight = None
        shape = shape_of(prefill_tokens)
        first = shape not in self._seen
        self._seen.add(shape)
        if seconds <= 0 or not math.isfinite(seconds):
            return
        if prefill_tokens == 0:
            if decode_rows > 0:
                if decode_rows not in self._decode:
                    bisect.insort(self._rows, decode_rows)
                    self._decode[decode_rows] = _Recent()
                self._decode[decode_rows].add(seconds, first)
            return
        if prefill_tokens < MIN_MEASURED_TOKENS:
            return
        # What a step costs beyond its prompt tokens (a row's head and sampling, the launches, the
        # loop) is a decode step's: counted per token, it made short prompts look 30x dearer.
        base = self._measured_decode_s(max(1, decode_rows)) or 0.0
        if self._prefill_token is None:
            self._prefill_token = _Recent()
        self._prefill_token.add(max(0.0, seconds - base) / prefill_tokens, first)

    @property
    def known(self) -> bool:
        """Whether there is anything to project with: a measured step, or one in flight."""
        return bool(self._rows) or self._prefill_token is not None or self._flight is not None

    @property
    def prefill_token_s(self) -> float:
        return self._prefill_token.value if self._prefill_token is not None else 0.0

    def prefill_s(self, tokens: int, decode_rows: int) -> float:
        """A step of `tokens` prompt tokens beside `decode_rows` rows (a decode step's base too)."""
        if self._prefill_token is None and (lower := self._floor(tokens + decode_rows)) is not None:
            return lower
        return tokens * self.prefill_token_s + (self.decode_s(max(1, decode_rows)) or 0.0)

    def decode_s(self, rows: int) -> float | None:
        """A decode step of `rows` rows: measured (see `_measured_decode_s`), else the least the
        step in flight says it takes; None with neither."""
        measured = self._measured_decode_s(rows)
        return measured if measured is not None else self._floor(max(1, rows))

    def _measured_decode_s(self, rows: int) -> float | None:
        """A decode step of `rows` rows: measured, else between the nearest measured batch sizes;
        above the largest, along the slope of the two largest (a CPU step grows with its rows, a
        GPU step barely does), or in proportion to rows with one size measured (the pessimistic
        reading, until a second size is)."""
        known = self._rows
        if not known:
            return None
        rows = max(1, rows)
        if rows in self._decode:
            return self._decode[rows].value
        i = bisect.bisect_left(known, rows)
        if i == 0:
            return self._decode[known[0]].value
        if i == len(known):
            top = known[-1]
            t_top = self._decode[top].value
            if len(known) == 1:
                return t_top * rows / top
            below = known[-2]
            slope = max(0.0, (t_top - self._decode[below].value) / (top - below))
            return t_top + slope * (rows - top)
        lo, hi = known[i - 1], known[i]
        t_lo, t_hi = self._decode[lo].value, self._decode[hi].value
        return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)


class LengthShare:
    """How much of their max_tokens finished requests used (EOS ends most before their cap)."""

    def __init__(self, window: int = 64, min_samples: int = 8) -> None:
        self._shares: deque[float] = deque(maxlen=window)
        self._min = min_samples

    def finished(self, generated: int, max_tokens: int) -> None:
        if max_tokens > 0:
            self._shares.append(min(1.0, generated / max_tokens))

    @property
    def share(self) -> float:
        """The LENGTH_QUANTILE share of recent requests; 1.0 (the whole cap) until measured."""
        if len(self._shares) < self._min:
            return 1.0
        ordered = sorted(self._shares)
        return ordered[min(len(ordered) - 1, math.ceil(LENGTH_QUANTILE * len(ordered)) - 1)]

    def remaining(self, generated: int, max_tokens: int) -> int:
        """Tokens a request with `generated` of `max_tokens` is projected still to take; past the
        usual share, the rest of its cap (it is one of the long ones)."""
        expected = math.ceil(self.share * max_tokens)
        return max(1, expected - generated) if generated < expected else max(1, max_tokens - generated)


# The factor a projected wait is read with stays in this range: read at 0.7 (ARRIVAL_SHARE), a
# request queued on arrival still has its wait projected, as built, within the bound itself.
WAIT_FACTOR_RANGE = (0.7, 2.0)
# Its error is measured on waits projected at this share of the bound or more (half the arrival
# share of 0.7, near where admission decides), and at least 1 s.
MEASURED_SHARE = 0.35


class WaitAccuracy:
    """The median ratio of queued requests' real waits for a first token to the waits projected as
    each was queued (the last `window`, of waits projected near the decision; 1 until `min_samples` are):
    what a new request's projection is read times. It models steps, not the engine's every choice,
    and where it errs long it refuses what would run (an H100 squeeze, s31: refusals at arrival
    projected at 23.3 s, each 8.7 s or more past the first token of the last request served ahead
    of it, the bound 30 s). Its error is not one ratio along a queue: in the same squeeze (s32)
    waits projected at 1-10 s came 2.0-2.8x their projection and those at 15-21 s 0.81-0.96x, so
    only waits projected near where admission decides count (MEASURED_SHARE of `bound_s`)."""

    def __init__(self, bound_s: float, window: int = 32, min_samples: int = 8) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._min, self._least = min_samples, max(1.0, bound_s * MEASURED_SHARE)

    def first_token(self, projected_s: float, waited_s: float) -> None:
        if projected_s >= self._least:
            self._ratios.append(waited_s / projected_s)

    @property
    def factor(self) -> float:
        if len(self._ratios) < self._min:
            return 1.0
        return min(WAIT_FACTOR_RANGE[1], max(WAIT_FACTOR_RANGE[0], statistics.median(self._ratios)))
