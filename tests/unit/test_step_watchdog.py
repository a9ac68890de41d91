"""Faults that last, against the fake engine on its real worker thread: a step that never returns
(the watchdog), steps that keep failing for want of memory (the level they raise), and the
deadlines that hold while a step runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from ballast.memory.ladder import LadderConfig
from ballast.memory.types import CostModel, Level
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import EngineStalled, Overloaded, RequestTimeout
from ballast.scheduler.governor import FaultPressure, Governor, GovernorSettings
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler
from ballast.scheduler.watchdog import NEW_SHAPE_FACTOR, STEP_P99_FACTOR, StepWatchdog, shape_of
from fake_engine import FakeEngine, FakeTokenizer

TOK = FakeTokenizer()


def req(i: int, max_tokens: int = 6, deadline_s: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        f"r{i}", tuple(TOK.encode(f"watchdog request {i}")), max_tokens=max_tokens, deadline_s=deadline_s
    )


@pytest.fixture
async def stalled_rig() -> AsyncIterator[tuple[Scheduler, FakeEngine, list[tuple[str, str]]]]:
    eng = FakeEngine(num_slots=1, step_delay_s=0.001)
    unsound: list[tuple[str, str]] = []
    cfg = SchedulerConfig(max_num_seqs=1, step_watchdog_s=1.0)
    s = Scheduler(eng, cfg, on_unsound=lambda code, why: unsound.append((code, why)))  # type: ignore[arg-type]
    await s.start()
    yield s, eng, unsound
    eng.allow_steps(None)  # the stuck step runs out, so the engine thread can end
    await s.stop()
    eng.shutdown()


async def test_a_step_that_never_returns_ends_every_request_and_the_scheduler_says_so(stalled_rig) -> None:
    s, eng, unsound = stalled_rig
    await s.submit(req(0)).collect()  # a calm request first: its prefill and decode shapes are known
    while not (s.idle and eng.active_slots == 0):  # its release has run too
        await asyncio.sleep(0.001)
    eng.allow_steps(1)  # the next step runs, the one after it never returns
    running = s.submit(req(1, max_tokens=50))
    first = await anext(aiter(running))
    assert first  # its prefill ran; its first decode step is the one that hangs
    queued = s.submit(req(2))  # the one slot is held: it waits in the queue
    # A queued request with a deadline before the watchdog's: its deadline holds while the step hangs.
    short = s.submit(req(3, deadline_s=time.monotonic() + 0.1))
    _, _, fin_short = await asyncio.wait_for(short.collect(), 10)
    assert isinstance(fin_short.error, RequestTimeout) and s.healthy
    _, _, fin_run = await asyncio.wait_for(running.collect(), 10)
    _, _, fin_queued = await asyncio.wait_for(queued.collect(), 10)
    for fin in (fin_run, fin_queued):
        assert fin.reason == "error" and isinstance(fin.error, EngineStalled) and fin.error.retryable
    stall = fin_run.error
    assert isinstance(stall, EngineStalled) and stall.deadline_s == pytest.approx(1.0)
    assert not s.healthy and unsound and unsound[0][0] == "engine_stalled"
    assert s.outcomes["stalled"] == 2
    with pytest.raises(EngineStalled):
        s.submit(req(4))


def test_the_deadline_follows_measured_steps_and_gives_new_shapes_room() -> None:
    dog = StepWatchdog(floor_s=2.0)
    assert dog.deadline_s(shape_of(300)) == 2.0 * NEW_SHAPE_FACTOR  # never seen: may compile first
    for _ in range(100):
        dog.completed(shape_of(300), 0.01)
    assert dog.deadline_s(shape_of(300)) == 2.0  # fast steps: the floor
    assert dog.deadline_s(shape_of(300)) == dog.deadline_s(shape_of(400))  # one size class
    assert dog.deadline_s(shape_of(2000)) == 2.0 * NEW_SHAPE_FACTOR
    dog.completed(0, 30.0)  # a class's first step (it may compile) is not a measure of the rest
    for _ in range(600):
        dog.completed(0, 0.5)  # slow steps lift it past the floor
    assert dog.deadline_s(0) == pytest.approx(STEP_P99_FACTOR * 0.5)
    assert dog.deadline_s(shape_of(300)) == 2.0  # each class by its own steps
    assert not StepWatchdog(0.0).enabled


def test_memory_failures_step_the_level_up_and_calm_down() -> None:
    fp = FaultPressure(calm_s=2.0)
    assert fp.level(0.0) is Level.OK and fp.reason(0.0) is None
    fp.failed(10.0, Level.OK)
    assert fp.level(10.0) is Level.WATCH
    fp.failed(10.5, Level.OK)
    fp.failed(11.0, Level.OK)
    assert fp.level(11.0) is Level.CRITICAL and "3 so far" in (fp.reason(11.0) or "")
    fp.failed(11.1, Level.OK)
    assert fp.level(11.1) is Level.CRITICAL  # no higher rung
    assert [fp.level(11.1 + t) for t in (1.9, 2.0, 4.0, 6.0)] == [
        Level.CRITICAL,
        Level.TIGHT,
        Level.WATCH,
        Level.OK,
    ]
    fp.failed(20.0, Level.TIGHT)  # one rung above the snapshot's own level
    assert fp.level(20.0) is Level.CRITICAL


def test_failing_steps_shrink_the_ladder_and_refuse_new_work_fast() -> None:
    cost = CostModel(kv_bytes_per_token=1 << 10, state_bytes_per_slot=0, activation_bytes_per_prefill_token=0)
    gov = Governor(GovernorSettings(LadderConfig(8, 256), False, 15.0, 2.0, None), cost)
    gov.refresh()
    assert gov.ladder.max_slots == 8 and not gov.holding
    gov.step_failed_on_memory()
    assert gov.ladder.shed_prefix_cache and not gov.holding  # WATCH: cached state goes first
    gov.check_submit()  # one failure: new work still comes in
    gov.step_failed_on_memory()
    assert gov.ladder.max_slots == 4  # TIGHT: half the slots, and new work refused at once
    assert gov.pressure_level is Level.CRITICAL
    with pytest.raises(Overloaded) as refused:
        gov.check_submit()
    assert "want of memory" in refused.value.reason and refused.value.retry_after_s == 2.0
    gov.step_failed_on_memory()
    assert gov.ladder.max_slots == 1  # CRITICAL
