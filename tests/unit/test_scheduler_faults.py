"""Recoverable step failures, the queue-wait bound and stale memory snapshots, against the fake
engine on its real worker thread: a failed step costs only its own requests, a request that
cannot get a slot in time is refused at once, unknown memory turns into fast refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator

import pytest
from ballast.engine.plan import StepPlan
from ballast.memory.types import HostSample, Level, MemState
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import EngineFailed, Overloaded, QueueWaitTooLong, StepAborted
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.roster import MIN_RETRY_CHUNK
from ballast.scheduler.scheduler import Scheduler
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens

TOK = FakeTokenizer()
GiB = 1 << 30


def req(i: int, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(
        f"r{i}", tuple(TOK.encode(f"request number {i}: tell me a thing")), max_tokens=max_tokens
    )


async def settle(s: Scheduler, eng: FakeEngine) -> None:
    for _ in range(5000):
        if s.idle and eng.active_slots == 0:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"not idle: queue={s.queue_depth} active={s.active_slots} engine={eng.active_slots}")


@pytest.fixture
async def make() -> AsyncIterator:
    made: list[tuple[Scheduler, FakeEngine]] = []

    async def build(
        config: SchedulerConfig, memwatch: object = None, **engine_kw: object
    ) -> tuple[Scheduler, FakeEngine]:
        eng = FakeEngine(**engine_kw)  # type: ignore[arg-type]
        s = Scheduler(eng, config, memwatch=memwatch)  # type: ignore[arg-type]
        await s.start()
        made.append((s, eng))
        return s, eng

    yield build
    for s, eng in made:
        await s.stop()
        eng.shutdown()


def has_prefill(plan: StepPlan) -> bool:
    return bool(plan.prefills)


async def test_a_step_failure_that_is_not_memory_costs_only_that_steps_requests(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), step_delay_s=0.002)
    running = s.submit(req(0, max_tokens=40))
    first = await anext(aiter(running))  # its prefill is done: it decodes from now on
    assert first
    # The next plan with a prefill carries the newcomer's prefill and the runner's decode.
    eng.fail_next_step(ValueError("a bug hit by this batch"), recoverable=True, when=has_prefill)
    newcomer = s.submit(req(1, max_tokens=8))
    waiting = [s.submit(req(i, max_tokens=8)) for i in range(2, 5)]  # queued behind the two slots
    _, _, fin_new = await newcomer.collect()
    _, _, fin_run = await running.collect()
    assert fin_new.reason == "error" and isinstance(fin_new.error, StepAborted) and fin_new.error.retryable
    assert "ValueError" in str(fin_new.error)
    assert fin_run.reason == "error" and isinstance(fin_run.error, StepAborted)  # it was in the step
    for i, h in zip(range(2, 5), waiting, strict=True):  # nothing else is lost: the queue runs as calm
        text, _, fin = await h.collect()
        assert fin.reason == "length" and text == TOK.decode(expected_tokens(req(i).prompt_ids, 8))
    assert s.last_step_failure == "step_error" and s.ladder.level is Level.OK  # not a memory signal
    await settle(s, eng)


async def test_a_prompt_that_fails_on_memory_costs_only_itself(make) -> None:
    """An out-of-memory error in a step of a new prompt's chunk beside running decodes: the
    decodes run again (their text is the calm run's), the prompt is retried with half its chunk,
    and the level steps up a rung."""
    s, eng = await make(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), step_delay_s=0.002)
    runners = [req(i, max_tokens=30) for i in range(3)]
    handles = [s.submit(r) for r in runners]
    for h in handles:
        assert await anext(aiter(h))  # all three decode now
    eng.fail_next_step(MemoryError("injected during prefill"), recoverable=True, when=has_prefill)
    newcomer = req(9, max_tokens=8)
    text_new, _, fin_new = await s.submit(newcomer).collect()
    assert fin_new.reason == "length" and text_new == TOK.decode(expected_tokens(newcomer.prompt_ids, 8))
    for r, h in zip(runners, handles, strict=True):
        text, _, fin = await h.collect()  # the first token was read above; the rest follows
        assert fin.reason == "length" and TOK.decode(expected_tokens(r.prompt_ids, 30)).endswith(text)
    failed = next(p for p in eng.recorded() if p.prefills and p.decodes and len(p.decodes) == 3)
    chunk = next(len(c.token_ids) for c in failed.prefills if c.slot not in {d.slot for d in failed.decodes})
    retried = [
        len(c.token_ids)
        for p in eng.recorded()[eng.recorded().index(failed) + 1 :]
        for c in p.prefills
        if c.token_ids == newcomer.prompt_ids[: len(c.token_ids)] and c.start_pos == 0
    ]
    assert retried and max(retried) <= max(MIN_RETRY_CHUNK, chunk // 2)
    assert s.step_failures == 1 and s.last_step_failure == "out_of_memory" and s.outcomes["step_failed"] == 0
    await settle(s, eng)


async def test_an_unrecoverable_failure_still_ends_everything(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    eng.fail_next_step(RuntimeError("CUDA error: an illegal memory access was encountered"))
    h = s.submit(req(0))
    _, _, fin = await h.collect()
    assert isinstance(fin.error, EngineFailed) and not s.healthy


async def test_a_request_that_waited_past_the_bound_is_refused(make) -> None:
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_queue_wait_s=0.3)
    s, eng = await make(cfg, step_delay_s=0.01)
    # Each request takes ~20 steps of >= 10 ms in one of 2 slots: the tail of 12 cannot start in 0.3 s.
    handles = [s.submit(req(i, max_tokens=20)) for i in range(12)]
    results = await asyncio.gather(*(h.collect() for h in handles))
    waited = [fin.error for _, _, fin in results if isinstance(fin.error, QueueWaitTooLong)]
    assert waited, "the queue tail waited past the bound instead of being refused"
    assert all(e.wait_s >= 0.3 and e.retryable for e in waited)
    assert [fin.reason for _, _, fin in results[:2]] == ["length", "length"]  # the first two ran
    assert s.outcomes["queue_wait"] == len(waited)
    await settle(s, eng)


async def test_with_measured_steps_a_hopeless_request_is_refused_at_submit(make, caplog) -> None:
    caplog.set_level(logging.INFO, "ballast.scheduler.wait_ready")
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_queue_wait_s=1.0)
    s, eng = await make(cfg, step_delay_s=0.005)
    assert not s.step_costs.known
    warm = [s.submit(req(i, max_tokens=6)) for i in range(4)]  # steps of each kind are measured
    await asyncio.gather(*(h.collect() for h in warm))
    assert s.step_costs.known
    # Every slot busy and a queue that needs longer than the bound to clear: refused synchronously,
    # told to come back within the bound; what was queued is served, never refused for its wait.
    busy: list = []
    with pytest.raises(QueueWaitTooLong) as refused:
        for i in range(400):
            busy.append(s.submit(req(100 + i, max_tokens=40)))
    assert len(busy) > 2 and 0 < refused.value.retry_after_s <= 1.0 and refused.value.wait_s > 0.7
    assert refused.value.waits_for == "a slot"
    assert "> 0.7 of max queue wait 1 s" in str(refused.value)  # the limit it was held to, at arrival
    # /ready turned for it, and the log says once what the projection stood on
    said = [r.getMessage() for r in caplog.records if "not ready for the queue wait" in r.getMessage()]
    assert len(said) == 1 and "for a slot" in said[0] and f"0 running, {len(busy)} queued" in said[0], said
    # The least request (one token) would wait past the bound too: refused before a prompt is built
    with pytest.raises(QueueWaitTooLong) as early:
        s.refuse_early()
    assert early.value.waits_for == "a slot" and 0.7 < early.value.wait_s <= refused.value.wait_s
    results = await asyncio.gather(*(h.collect() for h in busy))
    late = [fin for _, _, fin in results if fin.reason != "length"]
    assert all(isinstance(fin.error, QueueWaitTooLong) for fin in late)
    assert len(late) <= len(busy) // 4  # the arrival share's headroom keeps the estimate's noise out
    assert s.outcomes["queue_wait"] == 2 + len(late)
    await settle(s, eng)
    s.refuse_early()  # the queue drained: nothing to refuse before a prompt is built


async def test_the_projection_is_read_times_its_measured_error(make, caplog) -> None:
    """The requests a burst queued measure how their first tokens came against their projection;
    that factor is what the next burst is projected with: read at 0.7, more are queued before the
    first refusal than at 1, and the refusal quotes the wait as read. Each such first token is a
    request event with both waits (what the GPU squeeze bins the projection's error from)."""
    caplog.set_level(logging.INFO, "ballast.events.request")
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_queue_wait_s=3.0)
    s, eng = await make(cfg, step_delay_s=0.005)
    warm = [s.submit(req(i, max_tokens=6)) for i in range(4)]
    await asyncio.gather(*(h.collect() for h in warm))
    assert s.wait_factor == 1.0

    async def burst(base: int) -> tuple[int, QueueWaitTooLong]:
        busy: list = []
        with pytest.raises(QueueWaitTooLong) as refused:
            for i in range(400):
                busy.append(s.submit(req(base + i, max_tokens=10)))
        await asyncio.gather(*(h.collect() for h in busy))
        await settle(s, eng)
        return len(busy), refused.value

    queued, refusal = await burst(1000)  # read at 1: nothing measured yet
    said = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "first_token"]
    waits = [re.search(r"first token after ([0-9.]+) s, projected ([0-9.]+) s as queued", m) for m in said]
    assert len(waits) >= 8 and all(w is not None and float(w[2]) > 0 for w in waits), said[:3]
    # measured on the first tokens of the requests it queued (a fake engine's own error)
    assert s.wait_factor != 1.0 and 0.7 <= s.wait_factor <= 2.0
    for _ in range(64):  # a whole window of first tokens at 0.7 of their projection
        s._roster.accuracy.first_token(2.0, 1.4)
    assert s.wait_factor == pytest.approx(0.7)
    s._gate.forget_projection()  # as a step coming back with those tokens would
    more, read = await burst(2000)
    assert more > queued * 1.2, (queued, more)
    assert read.wait_s > 2.1 and refusal.wait_s > 2.1  # each past the arrival share, as read
    await settle(s, eng)


async def test_a_factor_that_rises_under_a_standing_queue_refuses_arrivals_not_the_queued(make) -> None:
    """Requests queued at one reading of the projection keep their place when its measured error
    moves: the re-read that refuses a queued request that fell behind reads the projection as it
    is. Read times 2 there, 26 of 72 queued were refused seconds after they were let in."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_queue_wait_s=3.0)
    s, eng = await make(cfg, step_delay_s=0.005)
    await asyncio.gather(*(s.submit(req(i, max_tokens=6)).collect() for i in range(4)))
    queued: list = []
    with pytest.raises(QueueWaitTooLong):
        for i in range(400):
            queued.append(s.submit(req(100 + i, max_tokens=10)))
    for _ in range(64):  # the projection now measured to err short by half
        s._roster.accuracy.first_token(2.0, 4.0)
    assert s.wait_factor == 2.0
    s._gate.forget_projection()
    with pytest.raises(QueueWaitTooLong) as refused:  # a new request is read times 2: refused
        s.submit(req(999, max_tokens=10))
    assert refused.value.wait_s > 2.1
    results = await asyncio.gather(*(h.collect() for h in queued))
    late = [fin for _, _, fin in results if fin.reason != "length"]
    assert len(late) <= len(queued) // 4, (len(late), len(queued))
    await settle(s, eng)


class FrozenWatch:
    """A MemWatch whose polls stopped succeeding: read() keeps returning one old snapshot."""

    def __init__(self, taken_at: float) -> None:
        host = HostSample(total_bytes=64 * GiB, available_bytes=48 * GiB)
        self.state = MemState(host=host, level=Level.OK, host_reserve_bytes=GiB, seq=7, taken_at=taken_at)

    def read(self) -> MemState:
        return self.state


async def test_a_stale_snapshot_turns_into_fast_refusals_and_recovers(make) -> None:
    watch = FrozenWatch(taken_at=time.monotonic())
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, stale_snapshot_s=0.2)
    s, eng = await make(cfg, memwatch=watch, step_delay_s=0.005)
    running = s.submit(req(0, max_tokens=200))
    await anext(aiter(running))
    queued = s.submit(req(1))
    await asyncio.sleep(0.3)  # no poll for longer than the limit
    _, _, fin = await queued.collect()  # refused while queued, long before its deadline
    assert isinstance(fin.error, Overloaded) and "unknown" in str(fin.error)
    with pytest.raises(Overloaded, match="unknown"):
        s.submit(req(2))
    assert s.memory_stale is not None
    watch.state = dataclasses.replace(watch.state, seq=8, taken_at=time.monotonic())  # a good poll again
    assert s.memory_stale is None
    running.abort()  # the running request was never ended for it
    assert (await running.collect())[2].reason == "abort"
    assert (await s.submit(req(3)).collect())[2].reason == "length"
    await settle(s, eng)


class BrokenDetokenizer:
    stopped = False

    def add(self, token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    def flush(self) -> str:
        return ""


async def test_a_detokenizer_error_ends_only_its_request(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    good = s.submit(req(0, max_tokens=12))
    real = eng.new_detokenizer
    eng.new_detokenizer = lambda prompt, stop=(): BrokenDetokenizer()  # type: ignore[method-assign]
    bad = s.submit(req(1, max_tokens=12))
    eng.new_detokenizer = real  # type: ignore[method-assign]
    _, _, fin_bad = await bad.collect()
    text, _, fin_good = await good.collect()
    assert fin_bad.reason == "error" and "UnicodeDecodeError" in str(fin_bad.error)
    assert fin_good.reason == "length" and text == TOK.decode(expected_tokens(req(0).prompt_ids, 12))
    await settle(s, eng)
    assert s.healthy and s.outcomes["request_failed"] == 1


async def test_a_request_arriving_mid_step_counts_the_queue_ahead_of_it(make) -> None:
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_queue_wait_s=1.0)
    s, eng = await make(cfg, step_delay_s=0.01)
    await asyncio.gather(*(s.submit(req(i, max_tokens=4)).collect() for i in range(3)))  # measured
    running = s.submit(req(10, max_tokens=30))  # ~0.3 s in the one slot
    await anext(aiter(running))
    queued = [s.submit(req(11 + i, max_tokens=30)) for i in range(2)]  # ~0.6 s ahead of the next
    s._gate.forget_projection()  # as after a step: the next arrival rebuilds the projection
    with pytest.raises(QueueWaitTooLong):  # its first token after ~0.9 s of work ahead, not ~0.3
        queued.append(s.submit(req(20, max_tokens=30)))
    for h in [running, *queued]:
        h.abort()
    await settle(s, eng)
