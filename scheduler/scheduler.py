"""The asyncio continuous-batching loop: govern, plan, execute, apply.

Runs on the event loop thread; only a frozen `StepPlan` and a `StepResult` cross to the engine's
thread. The gate owns who gets in, the planner what the next step runs, the roster where each
request is. While every running request decodes, two plans are in flight (`StepPlanner.lookahead`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from ballast.engine.interface import EngineLike
from ballast.engine.plan import KVFigures, StepFailed, StepPlan, StepResult
from ballast.engine.spec.governor import DraftStats
from ballast.memory.ladder import LadderConfig
from ballast.memory.types import LadderPlan, Level
from ballast.scheduler.checkpoints import CheckpointPlanner, TurnSaves
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import EngineFailed, EngineStalled, Overloaded, Refused
from ballast.scheduler.gate import AdmissionGate
from ballast.scheduler.governor import Governor, GovernorSettings, SnapshotSource, VerdictRecorder
from ballast.scheduler.kv_policy import KVPolicy, KVRoom
from ballast.scheduler.planner import StepPlanner
from ballast.scheduler.prompt_budget import PromptBudget
from ballast.scheduler.request import FinishReason, GenerationRequest, RequestHandle
from ballast.scheduler.roster import Roster
from ballast.scheduler.sequence import Phase, Seq
from ballast.scheduler.service_rate import LengthShare, StepCosts, WaitAccuracy
from ballast.scheduler.watchdog import StepWatchdog, shape_of

log = logging.getLogger(__name__)

# While a step runs, the loop wakes this often to enforce queue deadlines and the watchdog.
STEP_TICK_S = 0.05
_NONE: frozenset[int] = frozenset()


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
        """memwatch: None for no memory governance beyond the window. on_idle: runs on going idle
        and every idle_tick_s while idle (pool trim). on_unsound: called once with a code
        ("engine_stalled", "engine_failed") and the reason (the server then exits)."""
        self._engine = engine
        self._cfg = config
        self._on_idle = on_idle
        self._on_unsound = on_unsound
        max_slots = min(config.max_num_seqs, engine.num_slots)
        limits = LadderConfig(max_slots, config.window_for(engine.max_model_len))  # the plan at OK
        settings = GovernorSettings(
            limits,
            config.ladder_disable,
            config.psi_full_reject_pct,
            config.retry_after_s,
            engine.gpu_die,
            engine.quantized_kv,
            config.stale_snapshot_s,
        )
        self._gov = gov = Governor(settings, engine.cost_model, memwatch, admission_metrics)
        checkpoints = CheckpointPlanner(
            engine.checkpoint_interval,
            engine.match_prefix,
            lambda: gov.ladder.shed_prefix_cache,
            engine.recurrent_state,
        )
        self._turns = TurnSaves(checkpoints, engine.tokenizer)
        # What the queue-wait estimate projects with: step costs, max_tokens used, its own error
        self.step_costs = StepCosts()
        eos = engine.tokenizer.eos_token_ids
        lengths, accuracy = LengthShare(), WaitAccuracy(config.max_queue_wait_s)
        self._roster = roster = Roster(engine.num_slots, self._turns, lengths, accuracy, eos)
        # The pools after the last step, and the decisions made from them under the ladder.
        rooms = KVRoom(engine.kv_figures(), engine.kv_figures(int8=True), config.kv_keep_s)
        self._kv = KVPolicy(gov, rooms)
        self._gate = AdmissionGate(roster, gov, self._kv, config, limits, engine, self.step_costs)
        self.prompt_budget = PromptBudget(config.max_itl_ms / 1e3, self.step_costs)
        self._planner = StepPlanner(
            engine, config, roster, self._gate, gov, checkpoints, self._kv, self.prompt_budget
        )
        self.reused_tokens = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.failure: EngineFailed | None = None
        self.stalled: EngineStalled | None = None  # a step outlived the watchdog's deadline
        self._watchdog = StepWatchdog(config.step_watchdog_s)
        self.step_failures = 0  # steps the engine failed and recovered from
        self.last_step_failure: str | None = None  # its code: out_of_memory or step_error
        self.steps = 0
        self._returned_at = 0.0  # monotonic seconds the last step came back

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
        return None if (error := self.stalled or self.failure) is None else str(error)

    # --- figures: what the server, /metrics and the dashboard read (live views, never copies) ---
    @property
    def kv_pools(self) -> list[tuple[str, KVFigures]]:
        """After the last step, by name."""
        return self._kv.room.pools()

    @property
    def queue_depth(self) -> int:
        return len(self._roster.queue)

    @property
    def active_slots(self) -> int:
        return self._roster.slots.busy

    @property
    def slot_limit(self) -> int:
        return self._gate.slot_limit

    @property
    def preemptions(self) -> int:
        return self._roster.preemptions

    @property
    def draft_stats(self) -> DraftStats | None:
        """A copy of speculative decoding's counters; None while drafting is off."""
        drafts = self._planner.drafts
        return copy.deepcopy(drafts.stats) if drafts.config is not None else None

    @property
    def generated_tokens(self) -> int:
        return self._roster.generated_tokens

    @property
    def wait_factor(self) -> float:
        """What the queue-wait projection is read times: its measured error (`WaitAccuracy`)."""
        return self._roster.accuracy.factor

    @property
    def pressure_level(self) -> Level:
        return self._gov.pressure_level

    @property
    def ladder(self) -> LadderPlan:
        return self._gov.ladder

    @property
    def fault_level(self) -> Level:
        return self._gov.fault_level

    @property
    def failing_steps(self) -> str | None:
        return self._gov.failing_steps

    @property
    def memory_stale(self) -> str | None:
        """Why the memory snapshot counts as unknown now (MemWatch stopped publishing); else None."""
        return self._gov.stale_reason()

    @property
    def wait_not_ready(self) -> str | None:
        """Why a gateway should route elsewhere for now: a new request would wait near the
        queue-wait bound (with hysteresis, see `wait_ready`); None when idle or not so."""
        return None if self.idle else self._gate.readiness.reason

    @property
    def idle(self) -> bool:
        return self._roster.idle

    @property
    def outcomes(self) -> dict[str, int]:
        return dict(self._roster.outcomes)

    # --- intake ---------------------------------------------------------------------------
    def refuse_early(self) -> None:
        """Raise, counted, what `submit` would for any prompt (AdmissionGate.refuse_early)."""
        self._gate.refuse_early()

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; raises a `Refused` (ContextTooLong, Overloaded, ...) at once."""
        try:
            if self.failure is not None:
                raise EngineFailed(self.failure.cause)
            if self.stalled is not None:
                raise self.stalled
            if not self.running:
                raise Overloaded(self._cfg.retry_after_s, "the scheduler is not running")
            seq = self._gate.accept(req)
        except Refused as refusal:
            self._roster.count(refusal)
            raise
        self._wake.set()
        return RequestHandle(req, seq.mailbox, lambda: self._abort(seq))

    def _abort(self, seq: Seq) -> None:
        if seq.phase is not Phase.FINISHED:
            self._roster.finish(seq, "abort")
            self._wake.set()  # an idle loop must still send the slot's release

    # --- the loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            ahead: _InFlight | None = None
            while not self._closing or self._roster.slots.draining or ahead is not None:
                self._gate.govern()
                step = ahead or self._send(self._planner.plan(admit=not self._closing))
                if step is None:
                    await self._wait_for_work()
                    continue
                ahead = self._send(self._planner.lookahead(step.plan, self._closing))
                self._turns.fed_ahead = frozenset(d.slot for d in ahead.plan.decodes) if ahead else _NONE
                if not await self._complete(step):
                    return  # the engine stalled: no plan sent now would ever run
        except asyncio.CancelledError:
            # Cancelled without stop() (the event loop is going away): readers still get an end.
            self._end_all("abort")
            raise
        except Exception as exc:
            # The engine (or a step's bookkeeping) is unsound: every request gets an error event.
            log.exception("scheduler loop stopped: engine step failed")
            self.failure = EngineFailed(exc)
            self._unsound("engine_failed", self.failure)

    def _send(self, plan: StepPlan | None) -> _InFlight | None:
        """Hand a plan to the engine (`submit` takes requests, this sends steps); None: nothing to run."""
        if plan is None or (plan.empty and plan.max_slots is None):  # a ladder change alone is sent
            return None
        return _InFlight(plan, self._engine.submit(plan), time.monotonic())

    async def _complete(self, step: _InFlight) -> bool:
        """Wait for a step and apply it; False when it outlived the watchdog (everything ended).
        The loop wakes every tick meanwhile, so deadlines and the queue-wait bound hold."""
        waiting = asyncio.wrap_future(step.result)
        # Busy from its sending, or from the return of the one before (see `_timed`).
        busy_from = self._returned_at if step.sent_at - self._returned_at < STEP_TICK_S else step.sent_at
        self.step_costs.sent(len(step.plan.decodes), _prompt_tokens(step.plan), busy_from)
        while not (await asyncio.wait({waiting}, timeout=STEP_TICK_S))[0]:
            if self._stall_check(step, busy_from):
                return False
            self._gate.govern()
        self._timed(step, busy_from)
        try:
            result = waiting.result()
        except StepFailed as failed:
            self._step_failed(step.plan, failed)
            return True
        self._apply(step.plan, result)
        return True

    def _timed(self, step: _InFlight, busy_from: float) -> None:
        """Feed the step's engine time to the wait estimate and the watchdog. A step sent while
        the one before ran (the lookahead) or right after it came back started when that one
        ended: the loop's own time between steps is part of what each step costs."""
        now = self._returned_at = time.monotonic()
        self.step_costs.stepped(now - busy_from, len(step.plan.decodes), _prompt_tokens(step.plan))
        self._watchdog.completed(step.shape, now - busy_from)
        self._gate.forget_projection()

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        self.steps += 1
        self.reused_tokens += result.reused_tokens
        self._kv.room.update(result)
        self._roster.apply(plan, result)
        self._planner.observed(plan, result, time.monotonic())

    def _step_failed(self, plan: StepPlan, failed: StepFailed) -> None:
        """The engine failed the step and recovered; failing for want of memory raises the level."""
        self.step_failures += 1
        # A code, never the exception's text (it can name tensors, shapes, paths): the log has it.
        self.last_step_failure = "out_of_memory" if failed.memory else "step_error"
        if failed.memory:
            self._gov.step_failed_on_memory()
        self._roster.step_failed(plan, failed, self._cfg.retry_after_s)

    def _stall_check(self, step: _InFlight, busy_from: float) -> bool:
        """End everything when the step has run past the watchdog's deadline."""
        if (overdue := self._watchdog.overdue(step.shape, busy_from)) is None:
            return False
        ran, deadline = overdue
        self.stalled = EngineStalled(self._cfg.retry_after_s, ran, deadline)
        log.critical("engine stalled: a step has not returned after %.1f s (deadline %.1f s)", ran, deadline)
        self._unsound("engine_stalled", self.stalled)
        return True

    def _unsound(self, code: str, error: EngineFailed | EngineStalled) -> None:
        self._end_all("error", error)
        if self._on_unsound is not None:
            self._on_unsound(code, str(error))

    def _end_all(self, reason: FinishReason, error: Refused | None = None) -> None:
        self._closing = True
        self._roster.end_all(reason, error)

    async def _wait_for_work(self) -> None:
        """Sleep on the wake event. While idle, run the idle hook on entering idleness and every
        idle_tick_s, so buffers that age past the pool's idle limit in a long quiet spell are still
        given back; while pressure holds the queue, wake every hold_poll_s to re-read memory."""
        self._wake.clear()
        self._planner.drafts.idle()  # the next step's result is not a decode step's time
        if self.idle:
            if self._on_idle is not None:
                try:
                    self._on_idle()
                except Exception:
                    # Housekeeping: its failure must not stop serving, but it is logged.
                    log.exception("on_idle callback failed")
            timeout = self._cfg.idle_tick_s if self._on_idle is not None else None
        else:
            timeout = self._cfg.hold_poll_s
        # A timeout is a tick, not an error: go round, re-read the snapshot, maybe trim again.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)


def _prompt_tokens(plan: StepPlan) -> int:
    return sum(len(p.token_ids) for p in plan.prefills)
