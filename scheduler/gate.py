"""Who gets in, and when: the checks on arrival, the queue's governance while requests wait
(deadlines, the queue-wait bound, refusals), and the admission of the queue head into a slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ballast.engine.interface import EngineLike
from ballast.memory.ladder import LadderConfig
from ballast.memory.types import Level, VerdictKind
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import (
    ContextTooLong,
    Overloaded,
    QueueFull,
    QueueWaitTooLong,
    Refused,
    RequestTimeout,
)
from ballast.scheduler.governor import Governor
from ballast.scheduler.kv_policy import KVPolicy
from ballast.scheduler.request import GenerationRequest, Mailbox
from ballast.scheduler.roster import Roster
from ballast.scheduler.sequence import Phase, Seq
from ballast.scheduler.service_rate import StepCosts
from ballast.scheduler.wait_projection import Demand, Placement, WaitProjection
from ballast.scheduler.wait_ready import WaitReadiness

# Admission verdicts are operator events: one record per decision, with the request's id (the
# server's JSON log format puts the extra fields at the top level).
verdict_log = logging.getLogger("ballast.events.request")

# A request is queued on arrival only when its first token is projected within this share of the
# bound; once queued it is refused only when the projection passes the whole bound. The gap is the
# hysteresis between two readings of an estimate that moves with every step: a request let in at
# 29 s must not be refused a step later at 30.1 s.
ARRIVAL_SHARE = 0.7


class AdmissionGate:
    def __init__(
        self,
        roster: Roster,
        gov: Governor,
        kv: KVPolicy,
        config: SchedulerConfig,
        limits: LadderConfig,
        engine: EngineLike,
        costs: StepCosts,
    ) -> None:
        """limits: the operator's slots (within the engine's) and the context a request may use.
        costs: the steps' measured costs, which the queue-wait estimate projects with."""
        self._engine = engine
        self._roster = roster
        self._gov = gov
        self._kv = kv
        self._cfg = config
        self._max_slots = limits.max_slots
        self.context_window = limits.context_window
        self._costs = costs
        # The queue played forward: built when needed, extended by each request queued, dropped
        # when a step or an admission changes what it was built on.
        self._projection: WaitProjection | None = None
        self._fits: Callable[[int, int, bool, int], bool] = kv.fits_after([])  # the projection's room
        self.readiness = WaitReadiness(config.max_queue_wait_s, self._inputs)  # /ready from the wait
        self._probe: tuple[int, int] | None = None  # (prompt, max_tokens) of the last request queued

    @property
    def slot_limit(self) -> int:
        return min(self._max_slots, self._gov.ladder.max_slots)

    # --- on arrival ---------------------------------------------------------------------------
    def refuse_early(self) -> None:
        """Before a request's prompt is built: the refusals no prompt changes, as `accept` would
        raise them (CRITICAL pressure, a full queue, a memory hold not even a one-token prompt
        passes, a wait past the bound for the least request). A ~1k-token chat's template and
        tokens take the event loop milliseconds; under a co-tenant's squeeze (s26, H100, the 8B)
        189 refusals of under 100 ms at the server took 1.3 s p50 / 2.0 s p99 at the client."""
        try:
            self._gov.check_submit()
            if len(self._roster.queue) >= self._cfg.max_queue:
                raise QueueFull(self._cfg.retry_after_s, self._cfg.max_queue)
            if self._gov.holding:
                verdicts = [
                    self._gov.verdict(1, 1, self._kv.room.room_when_idle(q), q) for q in (False, True)
                ]
                if all(v.kind is VerdictKind.REJECT for v in verdicts):  # in either KV format
                    raise self._gov.overloaded(verdicts[0].reason or "admission refused")
            if (late := self._late_for_any()) is not None:
                raise late
        except Refused as refusal:
            self._roster.count(refusal)
            raise

    def _late_for_any(self) -> QueueWaitTooLong | None:
        """`_late_on_arrival`'s refusal of the least request (one prompt token, one asked), else
        None. Any request it refuses: none starts sooner or has its first token sooner, and one
        behind more than the step in flight is never spared as `unblamed`."""
        bound = self._cfg.max_queue_wait_s
        projection = self._current_projection() if bound > 0 else None
        if projection is None:
            return None
        for q in (False, True):  # in either KV format
            placed = projection.place(
                Demand(1, 1, self._kv.blocks(2, q)), lambda g, q=q: self._fits(1, 1, q, g)
            )
            projection.undo(placed)
            placed = placed.read(self._roster.accuracy.factor)
            if placed.at_once or placed.first_token_s <= bound * ARRIVAL_SHARE:
                return None
        self.readiness.refused(placed.first_token_s, placed.waits_for, time.monotonic())
        return self._late(placed, 0.0, estimated=True, share=ARRIVAL_SHARE)

    def accept(self, req: GenerationRequest) -> Seq:
        """Queue a request; raises ContextTooLong, Overloaded, QueueFull or QueueWaitTooLong at once."""
        roster = self._roster
        if len(req.prompt_ids) + req.max_tokens > self.context_window:
            raise ContextTooLong(len(req.prompt_ids), req.max_tokens, self.context_window)
        self._gov.check_submit()
        if len(roster.queue) >= self._cfg.max_queue:
            raise QueueFull(self._cfg.retry_after_s, self._cfg.max_queue)
        now = time.monotonic()
        deadline = req.deadline_s
        if deadline is None and self._cfg.request_timeout_s > 0:
            deadline = now + self._cfg.request_timeout_s
        detok = self._engine.new_detokenizer(req.prompt_ids, req.stop)
        seq = Seq(req, Mailbox(self._cfg.mailbox_events), now, deadline, detok, max_tokens=req.max_tokens)
        # While a REJECT holds the queue, a request no wait would serve learns it now, not after it.
        if self._gov.holding and (unservable := self._unservable(seq)) is not None:
            raise unservable
        if (late := self._late_on_arrival(seq)) is not None:
            raise late
        roster.queue.append(seq)
        return seq

    def _late_on_arrival(self, seq: Seq) -> QueueWaitTooLong | None:
        """The refusal of a request whose first token is projected past the bound (its share
        ARRIVAL_SHARE of it), else None: it is queued, and counts in the projection from now on."""
        bound = self._cfg.max_queue_wait_s
        if bound <= 0:
            return None
        projection = self._current_projection()
        if projection is None:  # the steps are not measured yet: the bound holds as waited
            return None
        raw = self._place(projection, seq)
        placed = raw.read(self._roster.accuracy.factor)  # its admission reads the measured error
        share = bound * ARRIVAL_SHARE
        # A prompt whose own prefill alone passes the share, behind nothing but the step in flight,
        # is queued if its first token meets the bound itself (on an idle server it is served).
        long_next = placed.unblamed(share) and placed.first_token_s <= bound
        if placed.first_token_s <= share or long_next or placed.unblamed(bound):
            self._probe = (len(seq.feed), seq.req.max_tokens)
            seq.projected_wait_s = raw.first_token_s
            return None
        projection.undo(raw)
        self.readiness.refused(placed.first_token_s, placed.waits_for, time.monotonic())
        return self._late(placed, 0.0, estimated=True, share=ARRIVAL_SHARE)

    def _inputs(self) -> str:
        """What the projection stands on, as the log says it when /ready turns for the wait."""
        rows, costs, kv = len(self._roster.running), self._costs, self._kv.room.main
        free = kv.free_blocks if kv is not None else 0
        return (
            f"{rows} running, {len(self._roster.queue)} queued, {free} free KV blocks, a decode step of "
            f"{1e3 * (costs.decode_s(rows) or 0.0):.1f} ms at {max(1, rows)} rows, "
            f"{1e6 * costs.prefill_token_s:.1f} us a prompt token, read x{self._roster.accuracy.factor:.2f}"
        )

    def _current_projection(self) -> WaitProjection | None:
        """The projection with the queue placed in it, rebuilt since a step or an admission."""
        if self._projection is None:
            self._projection = self._project()
            for queued in self._roster.queue if self._projection is not None else ():
                self._place(self._projection, queued)
        return self._projection

    def forget_projection(self) -> None:
        """What the projection was built on changed (a step came back): build it again when needed."""
        self._projection = None

    def _project(self) -> WaitProjection | None:
        """The running requests as the projection starts from; None until the steps are measured."""
        if not self._costs.known:
            return None
        roster = self._roster
        lengths = roster.lengths
        running = [
            Demand(
                len(s.feed) - s.prefilled if s.phase is Phase.PREFILLING else 0,
                lengths.remaining(len(s.output), s.max_tokens),
                self._kv.blocks(s.total_tokens, bool(s.int8_kv)),
            )
            for s in roster.running
        ]
        self._fits = self._kv.fits_after(roster.charges())
        free = max(0, self.slot_limit - len(roster.running))
        return WaitProjection(self._costs, free, running)

    def _place(self, projection: WaitProjection, seq: Seq) -> Placement:
        asked = seq.req.max_tokens - len(seq.resumed)
        int8 = bool(seq.int8_kv)
        n_feed = len(seq.feed)
        remaining = self._roster.lengths.remaining(len(seq.output), seq.req.max_tokens)
        demand = Demand(n_feed, remaining, self._kv.blocks(n_feed + asked, int8))
        fits = self._fits
        return projection.place(demand, lambda gain: fits(n_feed, asked, int8, gain))

    def _late(
        self, placed: Placement | None, waited: float, estimated: bool, share: float = 1.0
    ) -> QueueWaitTooLong:
        """The refusal, told to come back when the queue should have shrunk to fit the bound
        (`share` of it: the part a new request's projection is held to)."""
        bound = self._cfg.max_queue_wait_s
        wait = waited + (placed.first_token_s if placed is not None else 0.0)
        retry = min(bound, max(self._cfg.retry_after_s, wait - bound))
        waits_for = placed.waits_for if placed is not None else "a slot"
        return QueueWaitTooLong(retry, wait, bound, estimated, waits_for, share)

    # --- while requests wait ------------------------------------------------------------------
    def govern(self) -> None:
        """Memory first: refresh the ladder plan and pressure; end requests past their deadline;
        at CRITICAL refuse everything still waiting (in-flight requests are never killed)."""
        self._gov.refresh()
        roster = self._roster
        now = time.monotonic()
        for seq in [*roster.queue, *roster.running]:
            if seq.deadline is not None and now >= seq.deadline:
                roster.finish(seq, "error", RequestTimeout(seq.deadline - seq.submitted_at, len(seq.output)))
        self._refuse_late(now)
        if self._gov.pressure_level >= Level.CRITICAL:
            for seq in list(roster.queue):
                if not seq.preempted:  # an admitted request waits for its blocks, never fails
                    roster.finish(seq, "error", self._gov.overloaded("queued request refused"))

    def _refuse_late(self, now: float) -> None:
        """The queue-wait bound re-read for queued requests: one that has waited max_queue_wait_s,
        or whose first token the projection now puts past it (it fell behind), is refused now, not
        at the bound's end; a preempted one (running work) never is. FCFS: a refusal gives what it
        would have taken to those behind it, never to anyone ahead. The projection is read as it
        is, not times its measured error: a factor that moved under a standing queue turned
        requests let in into refusals after seconds (an H100 squeeze, s32: 8 of 136, at 1-5 s)."""
        bound = self._cfg.max_queue_wait_s
        if bound <= 0:
            return
        projection = self._projection = self._project()
        for seq in list(self._roster.queue):
            placed = self._place(projection, seq) if projection is not None else None
            waited = now - seq.submitted_at
            if seq.preempted or (
                waited < bound
                and (placed is None or placed.unblamed(bound) or waited + placed.first_token_s <= bound)
            ):
                continue
            if placed is not None and projection is not None:
                projection.undo(placed)
            refusal = self._late(placed, waited, estimated=waited < bound)
            self.readiness.refused(refusal.wait_s, refusal.waits_for, now)
            self._roster.finish(seq, "error", refusal)
        self.readiness.update(self._probe_placement(projection), now)

    def _probe_placement(self, projection: WaitProjection | None) -> Placement | None:
        """Where a request like the last one queued would start if it came now (taken back), read
        times the measured error as its admission would read it."""
        if projection is None or self._probe is None:
            return None
        n_feed, asked = self._probe
        remaining = self._roster.lengths.remaining(0, asked)
        fits = self._fits
        placed = projection.place(
            Demand(n_feed, remaining, self._kv.blocks(n_feed + asked, False)),
            lambda gain: fits(n_feed, asked, False, gain),
        )
        projection.undo(placed)
        return placed.read(self._roster.accuracy.factor)

    def _unservable(self, seq: Seq) -> Overloaded | None:
        """The refusal for a request not admitted even once all running ones end, else None."""
        asked = seq.req.max_tokens - len(seq.resumed)
        int8 = self._kv.in_int8(seq, len(seq.feed) + asked, self._roster.charges())
        verdict = self._gov.verdict(len(seq.feed), asked, self._kv.room.room_when_idle(int8), int8)
        if verdict.kind is not VerdictKind.REJECT:
            return None
        return self._gov.overloaded(verdict.reason or "admission refused")

    def _refuse_unservable(self) -> None:
        """After a REJECT holds the queue, refuse every queued request no wait would serve, on the
        same snapshot. Left to wait they are refused one per memory poll as the hold lifts and
        falls (on an H200 under a co-tenant's squeeze: 503s after 12.3 s p50, 16.1 s p99)."""
        for seq in list(self._roster.queue):
            if not seq.preempted and (refusal := self._unservable(seq)) is not None:
                _log_verdict(seq, "reject", 0, refusal.reason)
                self._roster.finish(seq, "error", refusal)

    # --- into a slot ----------------------------------------------------------------------------
    def admit_head(self) -> Seq | None:
        """Give the queue head a slot if memory and the ladder allow; FCFS: never skip the head."""
        roster = self._roster
        while roster.queue:
            seq = roster.queue[0]
            if (
                self._gov.holding
                or not roster.slots.has_free(self.slot_limit)
                or len(roster.running) >= self.slot_limit
            ):
                return None
            asked = seq.req.max_tokens - len(seq.resumed)
            running = roster.charges()
            int8 = self._kv.in_int8(seq, len(seq.feed) + asked, running)
            busy = bool(roster.running) or bool(roster.slots.draining)
            if self._kv.waits_for_blocks(len(seq.feed), asked, int8, running, busy) or (
                seq.preempted and not self._kv.resumable(len(seq.feed) + 1, int8, running)
            ):
                return None
            try:
                admission = self._gov.admit(
                    len(seq.feed), asked, self._kv.room.room(int8, running), quantized=int8
                )
            except Overloaded as refusal:  # the governor has raised the pressure level
                if seq.preempted:  # a preempted request is never failed: it waits for blocks
                    return None
                _log_verdict(seq, "reject", 0, refusal.reason)
                roster.finish(seq, "error", refusal)
                self._refuse_unservable()
                continue
            _log_verdict(
                seq, admission.verdict.kind.value, admission.verdict.fit_tokens, admission.verdict.reason
            )
            roster.place(seq, self.slot_limit)
            self._projection = None  # it left the queue for a slot
            seq.int8_kv = int8
            seq.max_tokens = admission.max_tokens + len(seq.resumed)
            seq.capped = seq.capped or admission.capped
            return seq
        return None


def _log_verdict(seq: Seq, verdict: str, fit_tokens: int, reason: str) -> None:
    rid = seq.req.request_id
    fields = {"request_id": rid, "verdict": verdict, "fit_tokens": fit_tokens, "reason": reason}
    extra = {"event": "verdict", **fields, "resumed": seq.preempted}
    verdict_log.info(
        "request %s admission: %s%s", rid, verdict, f" ({reason})" if reason else "", extra=extra
    )
