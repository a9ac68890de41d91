"""Who gets in, and when: the checks on arrival, the queue's governance while requests wait
(deadlines, the queue-wait bound, refusals), and the admission of the queue head into a slot.
"""

from __future__ import annotations

import logging
import time

from ballast.engine.interface import EngineLike
from ballast.memory.ladder import LadderConfig
from ballast.memory.types import Level, VerdictKind
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import ContextTooLong, Overloaded, QueueFull, RequestTimeout
from ballast.scheduler.governor import Governor
from ballast.scheduler.kv_policy import KVPolicy
from ballast.scheduler.request import GenerationRequest, Mailbox
from ballast.scheduler.roster import Roster
from ballast.scheduler.sequence import Seq
from ballast.scheduler.service_rate import QueueWaitBound

# Admission verdicts are operator events: one record per decision, with the request's id (the
# server's JSON log format puts the extra fields at the top level).
verdict_log = logging.getLogger("ballast.events.request")


class AdmissionGate:
    def __init__(
        self,
        roster: Roster,
        gov: Governor,
        kv: KVPolicy,
        config: SchedulerConfig,
        limits: LadderConfig,
        engine: EngineLike,
    ) -> None:
        """limits: the operator's slots (within the engine's) and the context a request may use."""
        self._engine = engine
        self._roster = roster
        self._gov = gov
        self._kv = kv
        self._cfg = config
        self._max_slots = limits.max_slots
        self.context_window = limits.context_window
        self._wait_bound = QueueWaitBound(config.max_queue_wait_s, config.retry_after_s, roster.service)

    @property
    def slot_limit(self) -> int:
        return min(self._max_slots, self._gov.ladder.max_slots)

    # --- on arrival ---------------------------------------------------------------------------
    def accept(self, req: GenerationRequest) -> Seq:
        """Queue a request; raises ContextTooLong, Overloaded, QueueFull or QueueWaitTooLong at once."""
        roster = self._roster
        if len(req.prompt_ids) + req.max_tokens > self.context_window:
            raise ContextTooLong(len(req.prompt_ids), req.max_tokens, self.context_window)
        self._gov.check_submit()
        if len(roster.queue) >= self._cfg.max_queue:
            raise QueueFull(self._cfg.retry_after_s, self._cfg.max_queue)
        slot_free = roster.slots.has_free(self.slot_limit)
        if (late := self._wait_bound.late(len(roster.queue), 0.0, slot_free)) is not None:
            raise late
        now = time.monotonic()
        deadline = req.deadline_s
        if deadline is None and self._cfg.request_timeout_s > 0:
            deadline = now + self._cfg.request_timeout_s
        detok = self._engine.new_detokenizer(req.prompt_ids, req.stop)
        seq = Seq(req, Mailbox(self._cfg.mailbox_events), now, deadline, detok, max_tokens=req.max_tokens)
        # While a REJECT holds the queue, a request no wait would serve learns it now, not after it.
        if self._gov.holding and (unservable := self._unservable(seq)) is not None:
            raise unservable
        roster.queue.append(seq)
        return seq

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
        """The queue-wait bound for queued requests: one that has waited max_queue_wait_s, or that
        the measured rate says cannot start before then (a burst that came before the rate was
        known), is refused now, not at its deadline; a preempted one (running work) never is."""
        slot_free = self._roster.slots.has_free(self.slot_limit)
        ahead = 0
        for seq in list(self._roster.queue):
            late = None if seq.preempted else self._wait_bound.late(ahead, now - seq.submitted_at, slot_free)
            if late is None:
                ahead += 1
            else:
                self._roster.finish(seq, "error", late)

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
