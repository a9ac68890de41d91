"""The scheduler's live count of generated tokens (what `ballast_generation_tokens_total` shows):
every token handed to a request counted once, as it is handed, however the request ends, so that
a request adds exactly its completion_tokens. Against the deterministic fake engine, whose step
gate holds a request mid-way without relying on timing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import FinishEvent, GenerationRequest, RequestHandle, TokenEvent
from ballast.scheduler.scheduler import Scheduler
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens

TOK = FakeTokenizer()


def req(i: int, max_tokens: int, stop: tuple[str, ...] = ()) -> GenerationRequest:
    ids = tuple(TOK.encode(f"request number {i}: tell me a thing"))
    return GenerationRequest(f"r{i}", ids, max_tokens=max_tokens, stop=stop)


@pytest.fixture
async def started() -> AsyncIterator[list[tuple[Scheduler, FakeEngine]]]:
    made: list[tuple[Scheduler, FakeEngine]] = []
    yield made
    for s, eng in made:
        eng.allow_steps(None)  # a held step would keep the scheduler from stopping
        await s.stop()
        eng.shutdown()


async def scheduler(
    made: list[tuple[Scheduler, FakeEngine]], **engine_kw: object
) -> tuple[Scheduler, FakeEngine]:
    eng = FakeEngine(**engine_kw)  # type: ignore[arg-type]
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    await s.start()
    made.append((s, eng))
    return s, eng


async def read_tokens(handle: RequestHandle, k: int) -> int:
    """Read events until at least k tokens have arrived; how many did."""
    seen = 0
    events = aiter(handle)
    while seen < k:
        event = await anext(events)
        assert isinstance(event, TokenEvent), event
        seen += len(event.token_ids)
    return seen


async def finish_of(handle: RequestHandle) -> FinishEvent:
    async for _ in handle:
        pass
    assert handle.finish is not None
    return handle.finish


async def settle(s: Scheduler, eng: FakeEngine) -> None:
    """Wait (bounded, no timing asserted) until every release has reached the engine."""
    for _ in range(5000):
        if s.idle and eng.active_slots == 0:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the scheduler never went idle")


async def test_tokens_are_counted_while_a_request_runs(started) -> None:
    s, eng = await scheduler(started)
    eng.allow_steps(6)  # the prefill and five decodes: at most six tokens, far from 200
    h = s.submit(req(1, max_tokens=200))
    seen = await read_tokens(h, 4)
    assert seen <= s.generated_tokens <= 6  # counted before it is read, never before it is sampled
    eng.allow_steps(None)
    fin = await finish_of(h)
    assert fin.reason == "length" and fin.completion_tokens == 200 and s.generated_tokens == 200


async def test_each_request_adds_its_completion_tokens_however_it_ends(started) -> None:
    s, eng = await scheduler(started)
    calm = TOK.decode(expected_tokens(req(2, 40).prompt_ids, 40))
    stop = calm[12:14]  # generation stops at the token completing its first occurrence
    length, stopped = s.submit(req(1, max_tokens=9)), s.submit(req(2, max_tokens=40, stop=(stop,)))
    finishes = [await finish_of(length), await finish_of(stopped)]
    eng.allow_steps(3)
    aborted = s.submit(req(3, max_tokens=200))
    await read_tokens(aborted, 1)
    aborted.abort()
    eng.allow_steps(None)
    finishes.append(await finish_of(aborted))
    await settle(s, eng)  # no plan of the aborted request left in flight for the failure to hit
    # A failed forward after its first token ends the request with an error.
    eng.fail_next_step(
        RuntimeError("a failed forward"), recoverable=True, when=lambda plan: bool(plan.decodes)
    )
    finishes.append(await finish_of(s.submit(req(4, max_tokens=200))))
    assert [f.reason for f in finishes] == ["length", "stop", "abort", "error"]
    assert finishes[0].completion_tokens == 9 and 0 < finishes[1].completion_tokens < 40
    assert 1 <= finishes[2].completion_tokens <= 3 and finishes[3].completion_tokens >= 1
    assert s.generated_tokens == sum(f.completion_tokens for f in finishes)


async def test_an_end_of_sequence_token_is_counted_as_usage_counts_it(started) -> None:
    s, _ = await scheduler(started, eos_after=3)
    fins = await asyncio.gather(*(finish_of(s.submit(req(i, max_tokens=10))) for i in range(3)))
    assert all(f.reason == "stop" and f.completion_tokens == 4 for f in fins)  # 3 tokens and the EOS
    assert s.generated_tokens == 12
