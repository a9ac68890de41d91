"""Memory governance once per step: snapshot -> ladder plan -> admission -> pressure level.
It never blocks (MemWatch.read() is one reference read) and never touches the engine.

A TIGHT snapshot alone does not hold new work (a small box sits at TIGHT at rest, and the ladder
already halves the slots there); an admission REJECT does: it pins the level at max(TIGHT,
snapshot level) until a fresher snapshot no worse than the refused one arrives, so the queue is
held (TIGHT) or refused (CRITICAL) until memory has been looked at again. A CRITICAL snapshot
counts directly: admission refuses everything there anyway, and a 503 before queueing lets a
client back off in microseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ballast.memory.admission import admit_request
from ballast.memory.ladder import LadderConfig, plan_for
from ballast.memory.types import CostModel, LadderPlan, Level, MemState, PoolRoom, Verdict, VerdictKind
from ballast.scheduler.errors import Overloaded


class SnapshotSource(Protocol):
    """What the scheduler needs of MemWatch: a non-blocking read of the latest snapshot."""

    def read(self) -> MemState: ...


@runtime_checkable
class ExactSource(SnapshotSource, Protocol):
    """A source that also keeps our own accounts (MemWatch: the VRAM ledger and the host book)."""

    def exact(self, state: MemState | None = None) -> MemState: ...


class VerdictRecorder(Protocol):
    """What the scheduler needs of the admission metrics: count one verdict."""

    def record(self, verdict: Verdict) -> None: ...


@dataclass(frozen=True)
class Admission:
    """A request may start with `max_tokens` new tokens (fewer than asked when `capped`)."""

    max_tokens: int
    capped: bool
    verdict: Verdict


@dataclass(frozen=True)
class GovernorSettings:
    ladder: LadderConfig  # the operator's slots and window: the plan at OK
    ladder_disable: bool
    psi_full_reject_pct: float
    retry_after_s: float
    gpu_die: int | None  # the die a GPU-resident engine's caches live on; None = host path
    quantized_kv: bool = False  # the engine's main KV pool holds int8 (--kv-quant, fixed at load)
    stale_snapshot_s: float = 0.0  # a polled snapshot older than this is unknown (0 = never)


class Governor:
    def __init__(
        self,
        settings: GovernorSettings,
        cost: CostModel,
        source: SnapshotSource | None = None,
        recorder: VerdictRecorder | None = None,
    ) -> None:
        self._s = settings
        self._cost = cost
        self._source = source
        self._recorder = recorder
        self._state: MemState | None = None
        self._plan = plan_for(Level.OK, settings.ladder, disabled=settings.ladder_disable)
        self._pin: Level = Level.OK  # raised by a reject; see the module doc
        self._pin_seq = -1  # snapshot seq the reject was decided on
        self._pin_snapshot_level = Level.OK
        self._stale: str | None = None  # why the snapshot read last counts as unknown
        # It calms a rung per retry-after (at least 1 s): a client retrying as told finds it calmer.
        self._faults = FaultPressure(max(1.0, settings.retry_after_s))
        self.denials = 0

    # --- per step -------------------------------------------------------------------------
    def refresh(self) -> None:
        state = self._read()
        self._stale = self._staleness(state)
        self._state = state
        level = max(self.snapshot_level, self.fault_level)
        if level != self._plan.level:
            self._plan = plan_for(level, self._s.ladder, disabled=self._s.ladder_disable)
        self._decay(state)

    def step_failed_on_memory(self) -> None:
        self._faults.failed(time.monotonic(), self.snapshot_level)
        self.refresh()

    def admit(
        self, n_prompt: int, max_tokens: int, pool: PoolRoom | None = None, quantized: bool = False
    ) -> Admission:
        """Whether a request may take a slot now; a REJECT raises Overloaded and the level. A CAP
        shortens max_tokens to the ladder's window; a prompt that cannot fit is refused, not cut.
        pool: the KV pool's room (spare blocks count before new memory); quantized: int8 KV."""
        verdict = self.verdict(n_prompt, max_tokens, pool, quantized)
        if self._recorder is not None:
            self._recorder.record(verdict)
        if verdict.kind is VerdictKind.REJECT:
            self._deny()
            raise Overloaded(self._s.retry_after_s, verdict.reason or "admission refused")
        capped = verdict.kind is VerdictKind.CAP
        return Admission(verdict.fit_tokens - n_prompt if capped else max_tokens, capped, verdict)

    def verdict(
        self, n_prompt: int, max_tokens: int, pool: PoolRoom | None = None, quantized: bool = False
    ) -> Verdict:
        """What `admit` would decide now, without counting it or acting on it. The ladder's
        narrower window saves new memory: a request the pool's spare blocks hold whole needs none,
        and runs at the operator's window (the 8B squeeze at TIGHT, s27: 152 of 192 requests of
        ~1k tokens refused for a 1,024-token window beside a kept working set)."""
        window = self._plan.context_window
        asked = self._s.ladder.context_window
        if window < asked and pool is not None:
            held = self._cost.cache_bytes(min(n_prompt + max_tokens, asked), quantized)
            window = asked if held <= pool.spare_bytes else window
        if self._state is None:  # no memory signals: only the window applies (fail open)
            fit = min(n_prompt + max_tokens, window)
            kind = VerdictKind.ADMIT if fit == n_prompt + max_tokens else VerdictKind.CAP
            if fit > n_prompt:
                return Verdict(kind, fit)
            return Verdict(
                VerdictKind.REJECT, 0, f"context window limit: {n_prompt} prompt tokens, window {window}"
            )
        # Our own accounts are exact and read now; a snapshot of them is up to a poll old, and a
        # segment leased since then would count twice: as ledger headroom and as the pool's
        # spare blocks (which come from the last step).
        state = self._source.exact(self._state) if isinstance(self._source, ExactSource) else self._state
        return admit_request(
            n_prompt,
            max_tokens,
            state,
            self._cost,
            max_window=window,
            gpu_die=self._s.gpu_die,
            quantized_kv=self._s.quantized_kv or quantized,
            psi_full_reject_pct=self._s.psi_full_reject_pct,
            min_window=n_prompt + 1,
            pool=pool,
        )

    def check_submit(self) -> None:
        """Raise Overloaded at CRITICAL pressure, from a fresh snapshot (microseconds)."""
        self.refresh()
        if self.pressure_level >= Level.CRITICAL:
            raise Overloaded(self._s.retry_after_s, self._pressure_reason)

    def overloaded(self, what: str) -> Overloaded:
        return Overloaded(self._s.retry_after_s, f"{self._pressure_reason}: {what}")

    def stale_reason(self) -> str | None:
        """Why the latest snapshot counts as unknown (read now, not at the last refresh)."""
        return self._staleness(self._read())

    # --- figures --------------------------------------------------------------------------
    @property
    def ladder(self) -> LadderPlan:
        return self._plan

    @property
    def snapshot(self) -> MemState | None:
        return self._state

    @property
    def snapshot_level(self) -> Level:
        return self._state.level if self._state is not None else Level.OK

    @property
    def fault_level(self) -> Level:
        return self._faults.level(time.monotonic())

    @property
    def failing_steps(self) -> str | None:
        """Why new work should go elsewhere while steps fail for want of memory (TIGHT+), else None."""
        return self._faults.reason(time.monotonic()) if self.fault_level >= Level.TIGHT else None

    @property
    def pressure_level(self) -> Level:
        if self._stale is not None:
            return Level.CRITICAL  # unknown memory is treated as the worst: refuse new work fast
        direct = self.snapshot_level if self.snapshot_level >= Level.CRITICAL else Level.OK
        # Steps failing for want of memory twice within a calm spell (TIGHT) refuse new work at
        # once: held, it would wait for the calm and then most likely fail the same way (measured
        # with BALLAST_FAULTS oom: held requests waited 3.3 s for a 503). Requests put back by a
        # failed step are running work and still wait.
        faults = Level.CRITICAL if self.fault_level >= Level.TIGHT else self.fault_level
        return max(direct, self._pin, faults)

    @property
    def holding(self) -> bool:
        """New work waits in the queue (TIGHT) or is refused (CRITICAL)."""
        return self.pressure_level >= Level.TIGHT

    # --- internals ------------------------------------------------------------------------
    def _read(self) -> MemState | None:
        return self._source.read() if self._source is not None else None

    def _staleness(self, state: MemState | None) -> str | None:
        """A polled snapshot (taken_at > 0) older than stale_snapshot_s: MemWatch's polls keep
        failing, so memory counts as unknown. Refusing at once (not holding the queue until
        deadlines) lets clients go elsewhere; the next good poll resumes serving. Running requests
        are never ended for it."""
        limit = self._s.stale_snapshot_s
        if state is None or limit <= 0 or state.taken_at <= 0:
            return None
        age = time.monotonic() - state.taken_at
        return f"memory signals unknown: the last snapshot is {age:.1f} s old" if age > limit else None

    @property
    def _pressure_reason(self) -> str:
        if self._stale:
            return self._stale
        faults = self._faults.reason(time.monotonic())
        if faults is not None and self.snapshot_level < Level.CRITICAL and self._pin <= self.fault_level:
            return faults
        return f"memory pressure {self.pressure_level.name}"

    def _deny(self) -> None:
        """A REJECT on the current snapshot: pin the level (see the module doc)."""
        self.denials += 1
        self._pin = max(self._pin, Level.TIGHT, self.snapshot_level)
        self._pin_seq = self._state.seq if self._state is not None else -1
        self._pin_snapshot_level = self.snapshot_level

    def _decay(self, state: MemState | None) -> None:
        if self._pin is Level.OK:
            return
        # Without signals the reject was about the window alone: nothing to hold.
        if state is None or (state.seq != self._pin_seq and state.level <= self._pin_snapshot_level):
            self._pin, self._pin_seq, self._pin_snapshot_level = Level.OK, -1, Level.OK
        elif state.level > self._pin_snapshot_level:
            # Worse than when we were refused: follow it up (CRITICAL refuses the queue).
            self._pin = max(self._pin, state.level)
            self._pin_snapshot_level = state.level


class FaultPressure:
    """Steps that fail for want of memory, as a pressure level the governor adds to the snapshot's.

    An out-of-memory error in a step is a signal the snapshot may not show (a co-tenant took VRAM
    between two polls, fragmentation): each raises the level one rung above the worst of it and the
    snapshot's, so the ladder shrinks the work. It steps down a rung per `calm_s` without one: a
    client told to retry after `calm_s` finds the server one rung calmer."""

    def __init__(self, calm_s: float) -> None:
        self._calm_s = calm_s
        self._level = Level.OK
        self._at = 0.0  # when the level was last raised (monotonic seconds)
        self.memory_failures = 0

    def failed(self, now: float, snapshot_level: Level) -> None:
        self.memory_failures += 1
        base = max(self.level(now), snapshot_level)
        self._level = Level(min(Level.CRITICAL, base + 1))
        self._at = now

    def level(self, now: float) -> Level:
        if self._level is Level.OK or self._calm_s <= 0:
            return Level.OK
        calmed = int((now - self._at) / self._calm_s)
        return Level(max(Level.OK, self._level - calmed))

    def reason(self, now: float) -> str | None:
        level = self.level(now)
        if level is Level.OK:
            return None
        return f"steps failing for want of memory ({self.memory_failures} so far): {level.name}"
