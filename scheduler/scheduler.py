"""The asyncio continuous-batching loop: govern, schedule, execute, apply.

Everything here runs on the event loop thread; the engine runs plans on its own thread and the
only things crossing are a frozen `StepPlan` and a `StepResult`. Per-request state (`Seq`) is
private to this module and changed only here (the field-tested failure mode is a request object
mutated by scheduler, allocator and runner at once). A slot freed by a finished or aborted request
is released in the next plan and reused only after that plan has run.

While every running request decodes, the plan of step N+1 is submitted before step N's tokens are
back (`ballast.scheduler.lookahead`): the engine queues N+1 behind N and the GPU does not wait for
the host between steps. Two plans are then in flight; anything else (a new request, a release, a
ladder change) waits for the step in flight and is planned from its result, as without overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from ballast.engine.interface import EngineLike
from ballast.engine.plan import (
    DecodeToken,
    KVFigures,
    PrefillChunk,
    SlotOutput,
    StepFailed,
    StepPlan,
    StepResult,
)
from ballast.memory.ladder import LadderConfig
from ballast.memory.types import LadderPlan, Level, VerdictKind
from ballast.scheduler.checkpoints import CheckpointOrders
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import (
    REFUSAL_OUTCOMES,
    ContextTooLong,
    EngineFailed,
    EngineStalled,
    Overloaded,
    QueueFull,
    Refused,
    RequestFailed,
    RequestTimeout,
    StepAborted,
    outcome_of,
)
from ballast.scheduler.governor import Governor, GovernorSettings, SnapshotSource, VerdictRecorder
from ballast.scheduler.kv_policy import KVPolicy
from ballast.scheduler.kv_room import Charge, KVRoom
from ballast.scheduler.lookahead import Decoding, next_decodes
from ballast.scheduler.queue import WaitingQueue
from ballast.scheduler.request import (
    FinishReason,
    GenerationRequest,
    Mailbox,
    RequestHandle,
    TokenEvent,
    TokenLogprob,
)
from ballast.scheduler.sequence import Phase, Seq
from ballast.scheduler.service_rate import QueueWaitBound, ServiceRate
from ballast.scheduler.slots import SlotTable
from ballast.scheduler.watchdog import StepWatchdog, shape_of

log = logging.getLogger(__name__)
# Admission verdicts are operator events: one record per decision, with the request's id (the
# server's JSON log format puts the extra fields at the top level).
verdict_log = logging.getLogger("ballast.events.request")

OUTCOMES = ("stop", "length", "abort", *REFUSAL_OUTCOMES)


# Tokens per prefill chunk of a request that scores its prompt: the model returns a row of
# logits (vocabulary-sized, float32) for every one of them.
PROMPT_LOGPROBS_CHUNK = 256
# A prompt whose chunk fails for want of memory is retried with half the chunk, down to this;
# a chunk this small failing is not the prompt's size but the server's state: it is refused.
MIN_RETRY_CHUNK = 16
# While a step runs, the loop wakes this often to enforce queue deadlines and the watchdog.
STEP_TICK_S = 0.05


@dataclass(frozen=True)
class _InFlight:
    plan: StepPlan
    result: Future[StepResult]
    sent_at: float  # monotonic seconds

    @property
    def shape(self) -> int:
        return shape_of(sum(len(p.token_ids) for p in self.plan.prefills))


class Scheduler:
    def __init__(
        self,
        engine: EngineLike,
        config: SchedulerConfig,
        *,
        memwatch: SnapshotSource | None = None,
        admission_metrics: VerdictRecorder | None = None,
        on_idle: Callable[[], None] | None = None,
        on_unsound: Callable[[str, str], None] | None = None,
    ) -> None:
        """memwatch: the snapshot source (None: no memory governance beyond the window).
        admission_metrics: counts every verdict. Admission reads where the engine's memory lives
        and its KV format from the engine itself. on_idle: runs when the scheduler goes idle and every
        idle_tick_s while it stays idle (pool trim). on_unsound: called once with a code
        ("engine_stalled", "engine_failed") and the reason when the engine stalled or failed (the
        server then reports unsound and exits)."""
        self._engine = engine
        self._cfg = config
        self._on_idle = on_idle
        self._on_unsound = on_unsound
        self._max_slots = min(config.max_num_seqs, engine.num_slots)
        self._context_window = config.window_for(engine.max_model_len)
        settings = GovernorSettings(
            LadderConfig(self._max_slots, self._context_window),
            config.ladder_disable,
            config.psi_full_reject_pct,
            config.retry_after_s,
            engine.gpu_die,
            engine.quantized_kv,
            config.stale_snapshot_s,
        )
        self._gov = Governor(settings, engine.cost_model, memwatch, admission_metrics)
        self._eos = engine.tokenizer.eos_token_ids
        self._slots = SlotTable(engine.num_slots)
        self._queue: WaitingQueue[Seq] = WaitingQueue(config.max_queue)
        self._running: list[Seq] = []  # admission order: the FCFS order of prefill chunks
        self._by_slot: dict[int, Seq] = {}
        # The max_slots the engine applies now; unknown until the first plan states it (another
        # scheduler may have driven this engine, with another limit).
        self._engine_slots = 0
        self._checkpoints = CheckpointOrders(
            engine.checkpoint_interval,
            engine.match_prefix,
            lambda: self._gov.ladder.shed_prefix_cache,
            engine.recurrent_state,
        )
        # The pools after the last step, and the decisions made from them under the ladder.
        self._kv = KVPolicy(self._gov, KVRoom(engine.kv_figures(), engine.kv_figures(int8=True)))
        self._unpark: list[tuple[int, ...]] = []  # for the next plan
        # Slots the plan submitted ahead feeds the token of the step being applied (from the device),
        # and final checkpoints that wait for that plan: its slot will have consumed one more token.
        self._fed_ahead: frozenset[int] = frozenset()
        self._saves_after_ahead: dict[int, tuple[int, ...]] = {}
        self.preemptions = 0
        self.reused_tokens = 0
        # Every token a request was handed, counted as it is handed: a live counter (/metrics
        # reads it while long answers stream) whose share for each request is that request's
        # completion_tokens, however it ended.
        self.generated_tokens = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.failure: EngineFailed | None = None
        self.stalled: EngineStalled | None = None  # a step outlived the watchdog's deadline
        self._watchdog = StepWatchdog(config.step_watchdog_s)
        self._last_done = 0.0  # when the last step returned (a queued step starts then)
        self.service = ServiceRate()  # slots turning over under backlog: the queue-wait estimate
        self._wait_bound = QueueWaitBound(config.max_queue_wait_s, config.retry_after_s, self.service)
        self.step_failures = 0  # steps the engine failed and recovered from
        self.last_step_failure: str | None = None  # its code: out_of_memory or step_error
        self.steps = 0
        self._outcomes = dict.fromkeys(OUTCOMES, 0)

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._gov.refresh()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ballast-scheduler")

    async def stop(self) -> None:
        """Abort everything queued or running, send the engine the last releases, end the loop."""
        if self._task is None or self._closing:
            return
        self._end_all("abort")
        self._wake.set()
        await self._task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._closing

    @property
    def healthy(self) -> bool:
        """False once an engine step failed or stalled (the process should report unhealthy and exit)."""
        return self.failure is None and self.stalled is None

    @property
    def unsound_reason(self) -> str | None:
        if self.stalled is not None:
            return str(self.stalled)
        return str(self.failure) if self.failure is not None else None

    # --- intake ---------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ContextTooLong, Overloaded or QueueFull at once. Call from the
        event loop thread."""
        try:
            if self.failure is not None:
                raise EngineFailed(self.failure.cause)
            if self.stalled is not None:
                raise self.stalled
            if not self.running:
                raise Overloaded(self._cfg.retry_after_s, "the scheduler is not running")
            if len(req.prompt_ids) + req.max_tokens > self._context_window:
                raise ContextTooLong(len(req.prompt_ids), req.max_tokens, self._context_window)
            self._gov.check_submit()
            if self._queue.full:
                raise QueueFull(self._cfg.retry_after_s, self._queue.max_size)
            if (
                late := self._wait_bound.late(len(self._queue), 0.0, self._slots.has_free(self.slot_limit))
            ) is not None:
                raise late
        except Refused as refusal:
            self._outcomes[outcome_of(refusal)] += 1
            raise
        now = time.monotonic()
        deadline = req.deadline_s
        if deadline is None and self._cfg.request_timeout_s > 0:
            deadline = now + self._cfg.request_timeout_s
        detok = self._engine.new_detokenizer(req.prompt_ids, req.stop)
        seq = Seq(req, Mailbox(self._cfg.mailbox_events), now, deadline, detok, max_tokens=req.max_tokens)
        # While a REJECT holds the queue, a request no wait would serve learns it now, not after it.
        if self._gov.holding and (unservable := self._unservable(seq)) is not None:
            self._outcomes[outcome_of(unservable)] += 1
            raise unservable
        self._queue.push(seq)
        self._wake.set()
        return RequestHandle(req, seq.mailbox, lambda: self._abort(seq))

    def _abort(self, seq: Seq) -> None:
        if seq.phase is not Phase.FINISHED:
            self._finish(seq, "abort")
            self._wake.set()  # an idle loop must still send the slot's release

    # --- the loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            ahead: _InFlight | None = None
            while not self._closing or self._slots.draining or ahead is not None:
                self._govern()
                step = ahead or self._send(self._schedule())
                if step is None:
                    await self._wait_for_work()
                    continue
                ahead = self._send(self._lookahead(step.plan))
                self._fed_ahead = frozenset(d.slot for d in ahead.plan.decodes) if ahead else frozenset()
                if not await self._complete(step):
                    return  # the engine stalled: no plan sent now would ever run
        except asyncio.CancelledError:
            # Cancelled without stop() (the event loop is going away): readers still get an end.
            self._end_all("abort")
            raise
        except Exception as exc:
            # The engine (or a step's bookkeeping) is unsound: every request gets an error event,
            # `healthy` turns false, and the cause is logged and kept in `failure`.
            log.exception("scheduler loop stopped: engine step failed")
            self._fail(exc)

    def _send(self, plan: StepPlan | None) -> _InFlight | None:
        """Hand a plan to the engine (`submit` takes requests, this sends steps); None: nothing to run."""
        if plan is None or (plan.empty and plan.max_slots is None):  # a ladder change alone is sent
            return None
        return _InFlight(plan, self._engine.submit(plan), time.monotonic())

    async def _complete(self, step: _InFlight) -> bool:
        """Wait for a step and apply it; False when it outlived the watchdog (everything ended)."""
        waiting = asyncio.wrap_future(step.result)
        while not await self._step_done(waiting, step):
            if self._stall_check(step):
                return False
            self._govern()  # deadlines and the queue-wait bound hold while a step runs
        try:
            result = waiting.result()
        except StepFailed as failed:
            self._step_failed(step.plan, failed)
            return True
        self._apply(step.plan, result)
        return True

    async def _step_done(self, waiting: asyncio.Future[StepResult], step: _InFlight) -> bool:
        """Wait up to one tick for the step; on its return, time it for the watchdog."""
        done, _ = await asyncio.wait({waiting}, timeout=STEP_TICK_S)
        if not done:
            return False
        now = time.monotonic()
        self._watchdog.completed(step.shape, now - max(step.sent_at, self._last_done))
        self._last_done = now
        return True

    def _stall_check(self, step: _InFlight) -> bool:
        """End everything when the step has run past the watchdog's deadline (a step queued
        behind another runs from that one's end)."""
        if not self._watchdog.enabled:
            return False
        deadline = self._watchdog.deadline_s(step.shape)
        ran = time.monotonic() - max(step.sent_at, self._last_done)
        if ran < deadline:
            return False
        self.stalled = EngineStalled(self._cfg.retry_after_s, ran, deadline)
        log.critical("engine stalled: a step has not returned after %.1f s (deadline %.1f s)", ran, deadline)
        self._end_all("error", self.stalled)
        self._report_unsound("engine_stalled", str(self.stalled))
        return True

    def _report_unsound(self, code: str, reason: str) -> None:
        if self._on_unsound is not None:
            self._on_unsound(code, reason)

    def _lookahead(self, plan: StepPlan) -> StepPlan | None:
        """The plan after `plan`, built before its tokens are back, where nothing but decoding is
        going on: no queue, no release or checkpoint to send, the ladder at rest."""
        if (
            not (self._cfg.overlap and self._engine.decodes_ahead)
            or self._closing
            or self._queue
            or self._unpark
            or self._slots.releases_pending
            or self._gov.ladder.level is not Level.OK
            or self._engine_slots_wanted != self._engine_slots
        ):
            return None
        running = {
            seq.slot: Decoding(len(seq.output), seq.max_tokens, seq.req.params)
            for seq in self._running
            if seq.slot is not None
        }
        return next_decodes(plan, running, self._engine.max_model_len)

    def _govern(self) -> None:
        """Memory first: refresh the ladder plan and pressure; end requests past their deadline;
        at CRITICAL refuse everything still waiting (in-flight requests are never killed)."""
        self._gov.refresh()
        now = time.monotonic()
        for seq in [*self._queue, *self._running]:
            if seq.deadline is not None and now >= seq.deadline:
                self._finish(seq, "error", RequestTimeout(seq.deadline - seq.submitted_at, len(seq.output)))
        self._refuse_late(now)
        if self._gov.pressure_level >= Level.CRITICAL:
            for seq in list(self._queue):
                if not seq.preempted:  # an admitted request waits for its blocks, never fails
                    self._finish(seq, "error", self._gov.overloaded("queued request refused"))

    def _schedule(self) -> StepPlan:
        """Decodes first (one token each), then prefill chunks of the oldest admitted requests,
        then new admissions from the queue head while token budget and slots remain."""
        decodes = tuple(  # each feeds its last sampled token, at the position after what it consumed
            DecodeToken(seq.slot, seq.output[-1], seq.consumed_tokens)
            for seq in self._running
            if seq.phase is Phase.DECODING and seq.slot is not None
        )
        per_step = self._cfg.max_num_batched_tokens or max(
            self._engine.prefill_chunk_tokens, self._cfg.max_num_seqs
        )
        budget = min(per_step - len(decodes), self._engine.prefill_chunk_tokens)
        unfinished = [s for s in self._running if s.phase is Phase.PREFILLING and s.prefilled < len(s.feed)]
        admitted = () if self._closing else iter(self._admit_head, None)
        to_prefill = itertools.chain(unfinished, admitted)
        prefills: list[PrefillChunk] = []
        while budget > 0 and (seq := next(to_prefill, None)) is not None:  # admits a head only here
            prefills.append(self._next_chunk(seq, budget))
            budget -= len(prefills[-1].token_ids)
        sampling = {row.slot: self._by_slot[row.slot].req.params for row in (*decodes, *prefills)}
        shed, saves, restores = self._checkpoints.take_orders()
        release = self._slots.take_releases()
        upcoming = itertools.islice(self._queue, self.slot_limit)
        shrink, keep = self._kv.shrink(bool(release), self._charges(), upcoming)
        return StepPlan(
            prefills=tuple(prefills),
            decodes=decodes,
            sampling=sampling,
            release=release,
            restores=restores,
            saves=saves,
            max_slots=self._engine_slot_change(),
            shed_prefix_cache=shed,
            shrink_kv=shrink,
            kv_keep=keep,
            unpark=self._take_unpark(),
        )

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        self.steps += 1
        self.reused_tokens += result.reused_tokens
        self._slots.released(plan.release)
        for d in plan.decodes:  # this plan fed their last token: the slot holds what they consumed
            consumed = self._saves_after_ahead.pop(d.slot, None)
            if consumed is not None and d.slot not in result.preempted:
                self._checkpoints.queue_final_save(d.slot, consumed)
        self._kv.room.update(result)
        for slot in result.preempted:
            self._requeue(slot)
        self._record_prompt_logprobs(result)
        self._deliver_tokens(plan, result)
        for seq in self._running:  # what the step's KV figures count for each running request
            seq.kv_held = seq.consumed_tokens

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        """Keep the prompt positions the step scored on their request, for its FinishEvent."""
        for scored in result.prompt_logprobs:
            if (owner := self._by_slot.get(scored.slot)) is not None:
                tops = scored.top or ((),) * len(scored.logprobs)
                for pos, (lp, top) in enumerate(zip(scored.logprobs, tops, strict=True), scored.first_pos):
                    owner.prompt_logprobs[pos] = TokenLogprob(owner.req.prompt_ids[pos], lp, top)

    def _deliver_tokens(self, plan: StepPlan, result: StepResult) -> None:
        """Hand each request the token the step sampled for it."""
        outputs = {out.slot: out for out in result.outputs}
        for slot in [d.slot for d in plan.decodes] + [p.slot for p in plan.prefills if p.sample]:
            seq = self._by_slot.get(slot)
            if seq is None:  # ended while the step ran (aborted, timed out) or preempted by it
                continue
            if slot not in outputs:
                raise RuntimeError(
                    f"engine returned no token for slot {slot} of request {seq.req.request_id}"
                )
            try:
                self._on_token(seq, outputs[slot])
            except Exception as exc:  # its detokenizer failed: this request's error, not the engine's
                log.exception("request %s: output handling failed", seq.req.request_id)
                self._finish(seq, "error", RequestFailed(exc))

    def _step_failed(self, plan: StepPlan, failed: StepFailed) -> None:
        """The engine failed the step and recovered: it dropped the sequences of `failed.slots`
        and applied the plan's releases. Everything not in the step, queued or running, goes on. A
        preemption in the failed step never reached us: the engine dropped what it parked, and the
        preempted request is among the failed ones.

        A step that failed for want of memory is a pressure signal (the governor steps the level
        up), and its requests go back to the queue to run again from their prompt: a prompt whose
        chunk was in the step with half the chunk, the others (decodes beside it) as they were, so
        one prompt too big for the memory left costs only itself. A prompt whose chunk was already
        MIN_RETRY_CHUNK, a decode whose decode-only step failed a second time, and every request
        of a step that failed otherwise (a bug hit by this batch) end with a retryable error."""
        self.step_failures += 1
        # A code, never the exception's text (it can name tensors, shapes, paths): the log has it.
        self.last_step_failure = "out_of_memory" if failed.memory else "step_error"
        self._slots.released(plan.release)
        for d in plan.decodes:  # the step that would have fed their last token did not run
            self._saves_after_ahead.pop(d.slot, None)
        if failed.memory:
            self._gov.step_failed_on_memory()
        chunks = {p.slot: len(p.token_ids) for p in plan.prefills}
        # Latest admitted first: each goes to the queue's front, so they keep their order there.
        for seq in reversed([s for s in self._running if s.slot in failed.slots]):
            assert seq.slot is not None
            if failed.memory and _retries(seq, chunks.get(seq.slot), bool(chunks)):
                self._requeue(seq.slot, preemption=False)
            else:
                self._finish(seq, "error", StepAborted(self._cfg.retry_after_s, str(failed), len(seq.output)))

    def _unservable(self, seq: Seq) -> Overloaded | None:
        """The refusal for a request that would not be admitted even once every running request
        has ended (its memory verdict against the pool's idle room is REJECT), else None."""
        asked = seq.req.max_tokens - len(seq.resumed)
        int8 = self._kv.in_int8(seq, len(seq.feed) + asked, self._charges())
        verdict = self._gov.verdict(len(seq.feed), asked, self._kv.room.room_when_idle(int8), int8)
        if verdict.kind is not VerdictKind.REJECT:
            return None
        return self._gov.overloaded(verdict.reason or "admission refused")

    def _refuse_unservable(self) -> None:
        """After a REJECT holds the queue, every queued request that no wait here would serve is
        refused at once, on the same snapshot. Left to wait, they would be refused one per memory
        poll as the hold lifts and falls again (measured on an H200 under a co-tenant's squeeze:
        503s after 12.3 s p50, 16.1 s p99). Those that fit once running work ends wait, within the
        queue-wait bound."""
        for seq in list(self._queue):
            if not seq.preempted and (refusal := self._unservable(seq)) is not None:
                _log_verdict(seq, "reject", 0, refusal.reason)
                self._finish(seq, "error", refusal)

    def _refuse_late(self, now: float) -> None:
        """The queue-wait bound for requests already queued: one that has waited max_queue_wait_s,
        or that the measured service rate says cannot start before then (a burst that arrived
        before the rate was known), is refused now rather than at its deadline. A preempted
        request is running work and is never refused."""
        slot_free = self._slots.has_free(self.slot_limit)
        ahead = 0
        for seq in list(self._queue):
            late = None if seq.preempted else self._wait_bound.late(ahead, now - seq.submitted_at, slot_free)
            if late is None:
                ahead += 1
            else:
                self._finish(seq, "error", late)

    # --- pieces ---------------------------------------------------------------------------
    def _admit_head(self) -> Seq | None:
        """Give the queue head a slot if memory and the ladder allow; FCFS: never skip the head."""
        while (seq := self._queue.head()) is not None:
            if (
                self._gov.holding
                or not self._slots.has_free(self.slot_limit)
                or len(self._running) >= self.slot_limit
            ):
                return None
            asked = seq.req.max_tokens - len(seq.resumed)
            running = self._charges()
            int8 = self._kv.in_int8(seq, len(seq.feed) + asked, running)
            busy = bool(self._running) or self._slots.draining
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
                self._finish(seq, "error", refusal)
                self._refuse_unservable()
                continue
            _log_verdict(
                seq, admission.verdict.kind.value, admission.verdict.fit_tokens, admission.verdict.reason
            )
            slot = self._slots.acquire(self.slot_limit)
            assert slot is not None  # has_free said so, and nothing ran in between
            self._queue.pop_head()
            seq.slot, seq.phase, seq.int8_kv = slot, Phase.PREFILLING, int8
            seq.max_tokens = admission.max_tokens + len(seq.resumed)
            seq.capped = seq.capped or admission.capped
            self._running.append(seq)
            self._by_slot[slot] = seq
            return seq
        return None

    def _next_chunk(self, seq: Seq, budget: int) -> PrefillChunk:
        """The seq's next prefill chunk, at most `budget` tokens (its first one restores the longest
        cached prefix)."""
        assert seq.slot is not None
        prompt = seq.feed
        # The prefix cache holds main-pool blocks: int8 sequences neither save nor restore; nor do
        # requests that score their prompt (every position's logits are needed).
        scoring = seq.req.prompt_logprobs is not None
        cached = not seq.int8_kv and not scoring
        if scoring:  # the model returns logits for every token of the chunk: keep those rows few
            budget = min(budget, PROMPT_LOGPROBS_CHUNK)
        if seq.chunk_cap:  # a chunk of it failed for want of memory: smaller ones now
            budget = min(budget, seq.chunk_cap)
        if seq.preempted and seq.prefilled == 0 and (n := self._engine.match_parked(prompt)) > 0:
            self._checkpoints.queue_resume(seq.slot, prompt[:n])  # parked when preempted: no recompute
            seq.prefilled = n
        elif cached and seq.prefilled == 0 and (n := self._checkpoints.queue_restore(seq.slot, prompt)) > 0:
            seq.prefilled = n
            if not seq.resumed:
                seq.cached = n
        end = min(len(prompt), seq.prefilled + budget)
        if cached:
            end = self._checkpoints.end_chunk_at_checkpoint(seq.slot, prompt, seq.prefilled, end, seq.cached)
        chunk = PrefillChunk(
            seq.slot,
            prompt[seq.prefilled : end],
            seq.prefilled,
            sample=end == len(prompt),
            int8_kv=bool(seq.int8_kv),
            logprob_targets=seq.req.prompt_ids[seq.prefilled + 1 : end + 1] if scoring else (),
            top_logprobs=seq.req.prompt_logprobs or 0,
        )
        seq.prefilled = end
        return chunk

    def _requeue(self, slot: int, preemption: bool = True) -> None:
        """The engine preempted the sequence in slot (its blocks are gone), or dropped it in a
        step that failed for want of memory (`preemption` False): the request goes back to the
        queue head and, when blocks are free again, prefills prompt + what it generated and goes
        on. Its client sees no gap but the wait; like a preempted one, it is never refused while
        it waits."""
        seq = self._by_slot.pop(slot, None)
        if seq is None:  # it finished while the step ran; its release is already on its way
            return
        self._running.remove(seq)
        self._slots.retire(slot)
        self.preemptions += preemption
        seq.slot, seq.phase, seq.prefilled, seq.kv_held = None, Phase.WAITING, 0, 0
        seq.resumed, seq.preempted = tuple(seq.output), True
        self._queue.push_front(seq)

    def _charges(self) -> list[Charge]:
        return [Charge(s.total_tokens, s.kv_held, bool(s.int8_kv)) for s in self._running]

    def _take_unpark(self) -> tuple[tuple[int, ...], ...]:
        out, self._unpark = tuple(self._unpark), []
        return out

    def _on_token(self, seq: Seq, out: SlotOutput) -> None:
        seq.phase = Phase.DECODING
        seq.output.append(out.token_id)
        self.generated_tokens += 1
        logprobs = None
        if seq.req.params.logprobs is not None and out.logprob is not None:
            logprobs = (TokenLogprob(out.token_id, out.logprob, out.top_logprobs),)
        if out.token_id in self._eos:
            # The EOS token is counted in usage, so its event (no text) comes before the finish:
            # a client scoring by logprobs sees every generated token, and the server sees that the
            # answer ended by EOS rather than by a stop string.
            seq.mailbox.put(TokenEvent("", (out.token_id,), logprobs))
            self._finish(seq, "stop")
            return
        text = seq.detok.add(out.token_id)
        seq.mailbox.put(TokenEvent(text, (out.token_id,), logprobs))
        if seq.detok.stopped:
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.max_tokens or out.at_capacity:
            self._finish(seq, "length")

    def _finish(self, seq: Seq, reason: FinishReason, error: Refused | None = None) -> None:
        """End a request wherever it is: out of the queue or its slot, final text, FinishEvent."""
        if seq.phase is Phase.FINISHED:
            return
        if seq.phase is Phase.WAITING:
            self._queue.remove(seq)
            if seq.preempted:  # whatever the engine parked for it would never be resumed
                self._unpark.append(seq.feed)
        else:
            self._leave_slot(seq, completed=reason in ("stop", "length"))
        seq.phase = Phase.FINISHED
        if reason in ("stop", "length") and not seq.detok.stopped:
            try:
                tail = seq.detok.flush()
            except Exception as exc:  # the reader must still get its FinishEvent
                log.exception("request %s: flushing its text failed", seq.req.request_id)
                reason, error, tail = "error", RequestFailed(exc), ""
            if tail:
                seq.mailbox.put(TokenEvent(tail, ()))
        seq.mailbox.put(seq.finish_event(reason, error))
        self._outcomes[reason if error is None else outcome_of(error)] += 1

    def _leave_slot(self, seq: Seq, completed: bool) -> None:
        """Take a running request out of its slot, released in the next plan. One that completed
        while decoding first orders a checkpoint of what its slot consumed (int8 sequences do not:
        the prefix cache holds main-pool blocks)."""
        self._running.remove(seq)
        self.service.left_slot(time.monotonic(), backlog=bool(self._queue))
        if seq.slot is None:
            return
        if completed and seq.phase is Phase.DECODING and not seq.int8_kv and self._checkpoints.active:
            ahead = seq.slot in self._fed_ahead
            answer = tuple(seq.output) if ahead else tuple(seq.output[:-1])
            if not seq.req.resent_as_text or self._comes_back(seq.output, answer):
                if ahead:  # the plan in flight feeds it output[-1]: saved once that plan has run
                    self._saves_after_ahead[seq.slot] = seq.req.prompt_ids + answer
                else:  # saved before the release: the slot has consumed prompt + output[:-1]
                    self._checkpoints.queue_final_save(seq.slot, seq.req.prompt_ids + answer)
        del self._by_slot[seq.slot]
        self._slots.retire(seq.slot)

    def _comes_back(self, output: Sequence[int], saved: tuple[int, ...]) -> bool:
        """Whether a next turn that resends this answer as text starts with the `saved` part of it:
        the tokens of its text begin with them (end-of-sequence tokens aside, which the chat
        template writes back). Measured on an H200 (`bench/gpu_prefix.py`, random weights, whose
        answers seldom tokenize back): every finished turn saved a 150 MB checkpoint no later
        turn could use, and the budget's LRU evicted the prompt-end ones that next turns do use
        (4 restores of 258 saves)."""
        tok = self._engine.tokenizer
        eos = tok.eos_token_ids
        answer = [t for t in output if t not in eos]
        part = list(saved)
        while part and part[-1] in eos:
            part.pop()
        return tok.encode(tok.decode(answer), add_special_tokens=False)[: len(part)] == part

    def _fail(self, exc: Exception) -> None:
        self.failure = EngineFailed(exc)
        self._end_all("error", self.failure)
        self._report_unsound("engine_failed", str(self.failure))

    def _end_all(self, reason: FinishReason, error: Refused | None = None) -> None:
        """Close to new work and end every request, queued or running."""
        self._closing = True
        for seq in [*self._queue, *self._running]:
            self._finish(seq, reason, error)

    async def _wait_for_work(self) -> None:
        """Sleep on the wake event. While idle, run the idle hook (trim the checkpoint pool) on
        entering idleness and again every idle_tick_s, so buffers that age past the pool's idle
        limit during a long quiet spell are still given back; while the queue is held by
        pressure, re-read memory every hold_poll_s instead. Never a busy loop."""
        self._wake.clear()
        if self.idle:
            self._run_idle_hook()
            timeout = self._cfg.idle_tick_s if self._on_idle is not None else None
        else:
            timeout = self._cfg.hold_poll_s
        # A timeout is a tick, not an error: go round, re-read the snapshot, maybe trim again.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _run_idle_hook(self) -> None:
        if self._on_idle is None:
            return
        try:
            self._on_idle()
        except Exception:
            # Trimming a cache is housekeeping: its failure must not stop serving, but it is
            # logged, never dropped.
            log.exception("on_idle callback failed")

    @property
    def _engine_slots_wanted(self) -> int:
        """The slot limit the engine should apply now: the ladder's, never below a held slot."""
        return max(self.slot_limit, self._slots.highest_held)

    def _engine_slot_change(self) -> int | None:
        """The slot limit the next plan carries, when it changes."""
        want = self._engine_slots_wanted
        if want == self._engine_slots:
            return None
        self._engine_slots = want
        return want

    # --- figures (read-only) --------------------------------------------------------------
    @property
    def kv_pools(self) -> list[tuple[str, KVFigures]]:
        """The KV pools' figures after the last step, by name."""
        return self._kv.room.pools()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_slots(self) -> int:
        return self._slots.busy

    @property
    def slot_limit(self) -> int:
        return min(self._max_slots, self._gov.ladder.max_slots)

    @property
    def pressure_level(self) -> Level:
        return self._gov.pressure_level

    @property
    def ladder(self) -> LadderPlan:
        """The degradation ladder's plan the scheduler applies now (not a step: see StepPlan)."""
        return self._gov.ladder

    @property
    def fault_level(self) -> Level:
        """The level steps failing for want of memory have raised, read now (OK once calm)."""
        return self._gov.fault_level

    @property
    def failing_steps(self) -> str | None:
        """Why new work should go elsewhere while steps keep failing for want of memory (the level
        they raised is TIGHT or worse); None when they are calm."""
        if self._gov.fault_level < Level.TIGHT:
            return None
        return self._gov.fault_reason

    @property
    def memory_stale(self) -> str | None:
        """Why the memory snapshot counts as unknown now (MemWatch stopped publishing); else None."""
        return self._gov.stale_reason()

    @property
    def idle(self) -> bool:
        return not self._queue and not self._running and self._slots.idle

    @property
    def outcomes(self) -> dict[str, int]:
        return dict(self._outcomes)


def _retries(seq: Seq, chunk: int | None, step_had_prompt: bool) -> bool:
    """Whether a request of a step that failed for want of memory runs again (see `_step_failed`);
    a prompt's chunk that failed halves its next ones."""
    if chunk is not None:  # its prompt chunk was in the step: the likely cause
        if chunk <= MIN_RETRY_CHUNK:
            return False
        seq.chunk_cap = max(MIN_RETRY_CHUNK, chunk // 2)
        return True
    if step_had_prompt:  # a decode beside the prompt that failed: not its fault
        return True
    seq.memory_strikes += 1  # a decode-only step failed: once may be a co-tenant's spike
    return seq.memory_strikes < 2


def _log_verdict(seq: Seq, verdict: str, fit_tokens: int, reason: str) -> None:
    rid = seq.req.request_id
    verdict_log.info(
        "request %s admission: %s%s",
        rid,
        verdict,
        f" ({reason})" if reason else "",
        extra={
            "event": "verdict",
            "request_id": rid,
            "verdict": verdict,
            "fit_tokens": fit_tokens,
            "reason": reason,
            "resumed": seq.preempted,
        },
    )
