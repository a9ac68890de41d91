"""Steps on the engine thread, one ahead: step N+1 is prepared and queued while the GPU runs N.

`launch` does a step's host work and returns with its sampled tokens still on their way; `finish`
waits for that copy. When plan N+1 comes before N's tokens are back (its decodes fed from the
device), the engine thread launches N+1 before finishing N, so the GPU never idles on the host.

For each plan: finish the step in flight first if the plan needs host tokens (a grammar row's
matcher must consume the previous token); launch it; finish the step in flight; then wait for the
next plan or this step's copy, and if no plan came finish this one too, so a step is never left
in flight with nothing queued behind it. The step in flight is always finished first, also when
one raises, so requests are answered in order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ballast.engine.plan import StepPlan, StepResult
from ballast.engine.step.sampler import Draw

# How often the engine thread looks at the GPU while it waits for the next plan or this step's
# copy (an event query is ~1 us; the wait sleeps on a threading.Event in between).
POLL_S = 50e-6


# Per drawn row: the slot, the position its token will be fed at, and whether that position is
# past the slot's capacity (the request then finishes by length).
DrawnRow = tuple[int, int, bool]


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose kernels are queued: its result but for the sampled tokens, which `draw` is
    bringing to the host, one per row of `rows`."""

    plan: StepPlan
    result: StepResult
    draw: Draw | None
    rows: tuple[DrawnRow, ...]

    @property
    def copied(self) -> bool:
        """The sampled tokens are on the host (or there are none)."""
        return self.draw is None or self.draw.ready is None or self.draw.ready.query()


Launch = Callable[[StepPlan], LaunchedStep]
Finish = Callable[[LaunchedStep], StepResult]
# Called with the plan and the exception of a step that failed: raises what the scheduler should
# see (StepFailed, or the exception itself when the engine is unsound).
OnFailure = Callable[[StepPlan, BaseException], None]
NeedsHostTokens = Callable[[StepPlan], bool]


class StepPipeline:
    """Owns the engine thread's queue of plans and the one step in flight."""

    def __init__(
        self,
        executor: ThreadPoolExecutor,
        launch: Launch,
        finish: Finish,
        on_failure: OnFailure,
        needs_host_tokens: NeedsHostTokens,
    ) -> None:
        self._executor = executor
        self._launch = launch
        self._finish = finish
        self._on_failure = on_failure
        self._needs_host_tokens = needs_host_tokens
        self._in_flight: tuple[LaunchedStep, Future[StepResult]] | None = None  # engine thread only
        self._submitted = 0  # written by the submitting thread only
        self._started = 0  # written by the engine thread only
        self._arrived = threading.Event()
        self.overlapped = 0  # steps launched while the previous one was still in flight

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        future: Future[StepResult] = Future()
        # Running from the start: a caller's cancellation must not skip a plan (its releases, or
        # the step the next plan's device-fed tokens come from).
        future.set_running_or_notify_cancel()
        self._submitted += 1
        self._executor.submit(self._run, plan, future)
        self._arrived.set()
        return future

    def _run(self, plan: StepPlan, future: Future[StepResult]) -> None:
        """On the engine thread: steps 1-4 of the module's docstring."""
        self._started += 1
        if self._in_flight is not None and self._needs_host_tokens(plan):
            self._finish_in_flight()
        try:
            launched = self._launch(plan)
        except BaseException as exc:
            self._finish_in_flight()
            self._fail(plan, exc, future)
            return
        if self._in_flight is not None:
            self.overlapped += 1
        self._finish_in_flight()
        self._in_flight = (launched, future)
        self._wait_for_plan_or_copy(launched)
        if not self._plan_waiting():
            self._finish_in_flight()

    def _finish_in_flight(self) -> None:
        if self._in_flight is None:
            return
        launched, future = self._in_flight
        self._in_flight = None
        try:
            result = self._finish(launched)
        except BaseException as exc:
            self._fail(launched.plan, exc, future)
            return
        future.set_result(result)

    def _fail(self, plan: StepPlan, exc: BaseException, future: Future[StepResult]) -> None:
        try:
            self._on_failure(plan, exc)
        except BaseException as raised:
            future.set_exception(raised)
            return
        future.set_exception(exc)

    def _plan_waiting(self) -> bool:
        return self._submitted > self._started

    def _wait_for_plan_or_copy(self, launched: LaunchedStep) -> None:
        while not self._plan_waiting() and not launched.copied:
            self._arrived.wait(POLL_S)
            self._arrived.clear()
