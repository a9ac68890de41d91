"""The continuous-batching scheduler against the deterministic fake engine (real worker thread)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable

import pytest
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import ContextTooLong, EngineFailed, Overloaded, QueueFull, RequestTimeout
from ballast.scheduler.request import FinishEvent, GenerationRequest, Mailbox, TokenEvent
from ballast.scheduler.roster import SlotError, SlotTable
from ballast.scheduler.scheduler import Scheduler
from fake_engine import EOS, FakeEngine, FakeEngineError, FakeTokenizer, expected_tokens

TOK = FakeTokenizer()


def req(i: int | str, prompt: str | None = None, max_tokens: int = 8, **kw: object) -> GenerationRequest:
    text = prompt if prompt is not None else f"request number {i}: tell me a thing"
    return GenerationRequest(f"r{i}", tuple(TOK.encode(text)), max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def calm_text(r: GenerationRequest, eos_after: int | None = None) -> str:
    return TOK.decode(expected_tokens(r.prompt_ids, r.max_tokens, eos_after))


async def settle(s: Scheduler, eng: FakeEngine) -> None:
    """Wait (bounded) until the loop has sent every release: no assertion on how long it takes."""
    for _ in range(5000):
        if s.idle and eng.active_slots == 0:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"not idle: queue={s.queue_depth} active={s.active_slots} engine={eng.active_slots}")


async def wait_until(cond: Callable[[], bool]) -> None:
    for _ in range(5000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def assert_idle(s: Scheduler, eng: FakeEngine) -> None:
    await settle(s, eng)
    assert s.queue_depth == 0 and s.active_slots == 0 and eng.active_slots == 0


def slots_in(plan: StepPlan) -> set[int]:
    return {c.slot for c in plan.prefills} | {d.slot for d in plan.decodes}


@pytest.fixture
async def make() -> AsyncIterator:
    made: list[tuple[Scheduler, FakeEngine]] = []

    async def build(
        config: SchedulerConfig | None = None, **engine_kw: object
    ) -> tuple[Scheduler, FakeEngine]:
        eng = FakeEngine(**engine_kw)  # type: ignore[arg-type]
        s = Scheduler(eng, config or SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
        await s.start()
        made.append((s, eng))
        return s, eng

    yield build
    for s, eng in made:
        await s.stop()
        eng.shutdown()


async def test_requests_share_steps_and_text_is_the_calm_run(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    reqs = [req(i, max_tokens=12) for i in range(4)]
    handles = [s.submit(r) for r in reqs]
    results = await asyncio.gather(*(h.collect() for h in handles))
    for r, (text, ids, fin) in zip(reqs, results, strict=True):
        assert text == calm_text(r)
        assert list(ids) == expected_tokens(r.prompt_ids, 12)
        assert fin == FinishEvent("length", len(r.prompt_ids), 12)
    # Continuous batching: most steps decode all four requests at once.
    batched = [p for p in eng.recorded() if len(p.decodes) == 4]
    assert len(batched) >= 10
    await assert_idle(s, eng)
    assert s.outcomes["length"] == 4


async def test_chunked_prefill_respects_the_token_budget_and_mixes_with_decode(make) -> None:
    budget = 16
    s, eng = await make(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), prefill_chunk_tokens=12
    )
    long_prompt = "the quick brown fox jumps over the lazy dog " * 2
    reqs = [req(i, long_prompt + str(i), max_tokens=6) for i in range(4)]
    handles = [s.submit(r) for r in reqs]
    results = await asyncio.gather(*(h.collect() for h in handles))
    assert [t for t, _, _ in results] == [calm_text(r) for r in reqs]
    plans = eng.recorded()
    for p in plans:
        prefill = sum(len(c.token_ids) for c in p.prefills)
        assert prefill + len(p.decodes) <= budget
        assert prefill <= 12  # the engine's profiled chunk
    # Each prompt arrived in several chunks, in order, covering it exactly once.
    building: dict[int, list[int]] = {}
    complete: list[tuple[int, ...]] = []
    for p in plans:
        for c in p.prefills:
            if c.start_pos == 0:
                building[c.slot] = []
            fed = building[c.slot]
            assert len(fed) == c.start_pos
            fed.extend(c.token_ids)
            if c.sample:
                complete.append(tuple(fed))
    assert sorted(complete) == sorted(r.prompt_ids for r in reqs)
    assert sum(len(c.token_ids) < len(reqs[0].prompt_ids) for p in plans for c in p.prefills) >= 8
    assert any(p.prefills and p.decodes for p in plans)  # chunked prefill rides along with decode
    await assert_idle(s, eng)


async def test_the_default_token_budget_is_the_engines_prefill_chunk(make) -> None:
    """max_num_batched_tokens 0 (the default): a step carries the engine's profiled chunk (at
    least one token per slot), decodes included, so a GPU engine's bigger chunk is used whole."""
    s, eng = await make(SchedulerConfig(max_num_seqs=4), prefill_chunk_tokens=12)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 2
    reqs = [req(i, long_prompt + str(i), max_tokens=6) for i in range(4)]
    results = await asyncio.gather(*(s.submit(r).collect() for r in reqs))
    assert [t for t, _, _ in results] == [calm_text(r) for r in reqs]
    plans = eng.recorded()
    assert all(sum(len(c.token_ids) for c in p.prefills) + len(p.decodes) <= 12 for p in plans)
    assert max(sum(len(c.token_ids) for c in p.prefills) for p in plans) == 12
    await assert_idle(s, eng)


async def test_a_prompt_beside_decodes_takes_the_engines_busy_chunk_and_alone_the_whole(make) -> None:
    """A CPU engine's steps are compute-bound: a prompt chunk beside running streams stays at the
    engine's busy chunk (so their next token waits no longer), and one with nothing decoding
    takes the whole profiled chunk (its first token sooner)."""
    s, eng = await make(SchedulerConfig(max_num_seqs=4), prefill_chunk_tokens=24, busy_prefill_chunk_tokens=6)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 3
    first = req("first", long_prompt + "0", max_tokens=40)
    handle = s.submit(first)
    while not any(p.decodes for p in eng.recorded()):
        await asyncio.sleep(0.001)
    late = [req(i, long_prompt + str(i), max_tokens=4) for i in range(1, 3)]
    results = await asyncio.gather(handle.collect(), *(s.submit(r).collect() for r in late))
    assert [t for t, _, _ in results] == [calm_text(r) for r in (first, *late)]
    plans = eng.recorded()
    alone = [sum(len(c.token_ids) for c in p.prefills) for p in plans if p.prefills and not p.decodes]
    beside = [sum(len(c.token_ids) for c in p.prefills) for p in plans if p.prefills and p.decodes]
    assert alone[0] == 24 and beside and max(beside) <= 6
    await assert_idle(s, eng)


async def test_fcfs_admission_order_and_a_long_prompt_is_not_starved(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), prefill_chunk_tokens=8)
    long_req = req("long", "a long prompt that needs many chunks to prefill " * 3, max_tokens=4)
    short = [req(i, f"hi {i}", max_tokens=30) for i in range(6)]
    handles = [s.submit(short[0]), s.submit(long_req), *(s.submit(r) for r in short[1:])]
    await asyncio.gather(*(h.collect() for h in handles))
    plans = eng.recorded()
    starts = [c.token_ids for p in plans for c in p.prefills if c.start_pos == 0]
    order = [short[0], long_req, *short[1:]]
    assert starts == [r.prompt_ids[: len(t)] for r, t in zip(order, starts, strict=True)]
    # While the long prompt was prefilling, every step carried a chunk of it: decodes never
    # crowd it out (the budget always leaves it at least one token).
    first = next(
        i
        for i, p in enumerate(plans)
        for c in p.prefills
        if c.start_pos == 0 and c.token_ids == long_req.prompt_ids[: len(c.token_ids)]
    )
    slot = next(
        c.slot
        for c in plans[first].prefills
        if c.start_pos == 0 and c.token_ids == long_req.prompt_ids[: len(c.token_ids)]
    )
    last = next(i for i, p in enumerate(plans) for c in p.prefills if c.slot == slot and c.sample)
    assert all(any(c.slot == slot for c in p.prefills) for p in plans[first : last + 1])
    assert any(p.decodes for p in plans[first : last + 1])
    assert handles[1].finish is not None and handles[1].finish.reason == "length"
    await assert_idle(s, eng)


async def test_abort_frees_the_slot_in_the_next_step(make) -> None:
    s, eng = await make(step_delay_s=0.01)
    h = s.submit(req(1, max_tokens=200))
    other = s.submit(req(2, max_tokens=20))
    async for event in h:
        if isinstance(event, TokenEvent) and len(event.token_ids) > 0:
            break
    slot = next(
        c.slot
        for p in eng.recorded()
        for c in p.prefills
        if c.token_ids == h.request.prompt_ids[: len(c.token_ids)] and c.start_pos == 0
    )
    # Plans 0..recorded-1 ran or run; two more may be queued (while decoding, the plan after the
    # one running is submitted before its tokens are back).
    recorded = len(eng.recorded())
    h.abort()
    events = [e async for e in h]
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "abort"
    text, _, fin = await other.collect()
    plans = eng.recorded()
    release_at = next(i for i, p in enumerate(plans) if slot in p.release)
    assert release_at <= recorded + 2  # the plan after those in flight when abort() was called
    assert all(slot not in slots_in(p) for p in plans[recorded + 2 : release_at + 1])
    assert fin.reason == "length" and text == calm_text(other.request)
    await assert_idle(s, eng)
    assert s.outcomes["abort"] == 1


async def test_abort_while_waiting_and_async_with(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8), step_delay_s=0.005)
    first = s.submit(req(1, max_tokens=50))
    await wait_until(lambda: s.active_slots == 1)
    async with s.submit(req(2)) as waiting:
        assert s.queue_depth == 1
    assert waiting.finished and s.queue_depth == 0
    first.abort()
    await assert_idle(s, eng)
    assert s.outcomes["abort"] == 2


async def test_deadline_ends_running_and_waiting_requests_cleanly(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8), step_delay_s=0.005)
    soon = time.monotonic() + 0.3
    running = s.submit(req(1, max_tokens=200, deadline_s=soon))
    waiting = s.submit(req(2, max_tokens=5, deadline_s=soon))
    t1, _, f1 = await running.collect()
    _, _, f2 = await waiting.collect()
    assert f1.reason == "error" and isinstance(f1.error, RequestTimeout)
    assert 0 < f1.completion_tokens < 200 and calm_text(running.request).startswith(t1)
    assert f2.reason == "error" and isinstance(f2.error, RequestTimeout) and f2.completion_tokens == 0
    await assert_idle(s, eng)
    assert s.outcomes["timeout"] == 2


async def test_stop_string_eos_and_logprobs(make) -> None:
    s, eng = await make()
    probe = req(1, max_tokens=20)
    calm = calm_text(probe)
    stop = calm[7:10]
    cut = calm.find(stop)
    text, _, fin = await s.submit(req(1, max_tokens=20, stop=(stop, "zzzzzz"))).collect()
    assert fin.reason == "stop" and text == calm[:cut]
    lp = await s.submit(req(3, max_tokens=4, params=SamplingParams(temperature=0, logprobs=2))).collect()
    assert lp[2].reason == "length"
    h = s.submit(req(4, max_tokens=3, params=SamplingParams(temperature=0, logprobs=2)))
    events = [e async for e in h if isinstance(e, TokenEvent) and e.token_ids]
    assert all(
        e.logprobs is not None and len(e.logprobs) == 1 and len(e.logprobs[0].top) == 2 for e in events
    )
    await assert_idle(s, eng)

    s2, eng2 = await make(eos_after=3)
    r = req(9, max_tokens=10)
    text, ids, fin = await s2.submit(r).collect()
    # The EOS token counts as generated and has its event (no text), before the finish: a client
    # scoring by logprobs sees every generated token.
    assert fin.reason == "stop" and fin.completion_tokens == 4 and len(ids) == 4 and ids[-1] == EOS
    assert text == calm_text(r, eos_after=3) and len(text) == 3
    await assert_idle(s2, eng2)


async def test_refusals_are_typed_and_synchronous(make) -> None:
    s, eng = await make(
        SchedulerConfig(max_num_seqs=1, max_queue=2, max_num_batched_tokens=8),
        max_model_len=64,
        step_delay_s=0.005,
    )
    with pytest.raises(ContextTooLong) as too_long:
        s.submit(req(0, "x" * 60, max_tokens=10))
    assert too_long.value.limit == 64 and too_long.value.prompt_tokens == 60
    handles = [s.submit(req(0, max_tokens=10))]
    await wait_until(lambda: s.active_slots == 1)
    handles += [s.submit(req(i, max_tokens=10)) for i in (1, 2)]
    assert s.queue_depth == 2
    with pytest.raises(QueueFull) as full:
        s.submit(req(9))
    assert full.value.retry_after_s == s._cfg.retry_after_s
    for h in handles:
        assert (await h.collect())[2].reason == "length"
    await assert_idle(s, eng)
    assert s.outcomes["queue_full"] == 1 and s.outcomes["context_length"] == 1


async def test_engine_failure_ends_every_request_with_an_error(make) -> None:
    s, eng = await make(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), step_delay_s=0.002)
    handles = [s.submit(req(i, max_tokens=50)) for i in range(4)]
    await asyncio.sleep(0.02)
    eng.fail_next_step(RuntimeError("CUDA error: an illegal memory access"))
    finishes = [(await h.collect())[2] for h in handles]
    assert all(f.reason == "error" and isinstance(f.error, EngineFailed) for f in finishes)
    assert not s.healthy and not eng.healthy
    with pytest.raises(EngineFailed):  # a 500, not a retryable 503: the process must restart
        s.submit(req(9))


async def test_stop_aborts_everything_and_releases_engine_slots() -> None:
    eng = FakeEngine(step_delay_s=0.002)
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8))
    await s.start()
    handles = [s.submit(req(i, max_tokens=100)) for i in range(5)]
    await asyncio.sleep(0.02)
    await s.stop()
    finishes = [(await h.collect())[2] for h in handles]
    assert {f.reason for f in finishes} == {"abort"}
    assert s.idle and eng.active_slots == 0
    with pytest.raises(Overloaded):
        s.submit(req(9))
    eng.shutdown()


async def test_idle_hook_runs_when_idle_and_on_a_slow_tick_never_while_busy() -> None:
    eng = FakeEngine(step_delay_s=0.002)
    seen: list[tuple[int, int]] = []  # (busy slots, engine slots) each time the hook ran
    s: Scheduler | None = None

    def trim() -> None:
        assert s is not None
        seen.append((s.active_slots, eng.active_slots))

    s = Scheduler(
        eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, idle_tick_s=0.02), on_idle=trim
    )
    await s.start()
    try:
        await wait_until(lambda: len(seen) >= 3)  # idle from the start: entry, then ticks
        handles = [s.submit(req(i, max_tokens=30)) for i in range(3)]
        before = len(seen)
        await asyncio.gather(*(h.collect() for h in handles))
        assert len(seen) <= before + 1  # at most the tick that was already due; none while busy
        await wait_until(lambda: len(seen) >= before + 3)
        assert set(seen) == {(0, 0)}  # only ever with every slot released
        steps = s.steps
        await asyncio.sleep(0.03)
        assert s.steps == steps  # ticks run the hook but never an engine step
    finally:
        await s.stop()
        eng.shutdown()


async def test_a_failing_idle_hook_is_logged_and_serving_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    eng = FakeEngine()
    calls = 0

    def trim() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("trim broke")

    s = Scheduler(eng, SchedulerConfig(max_num_seqs=2, idle_tick_s=0.01), on_idle=trim)
    await s.start()
    try:
        await wait_until(lambda: calls >= 2)  # called again on the tick after it failed
        r = req(1)
        text, _, finish = await s.submit(r).collect()
        assert finish.reason == "length" and text == calm_text(r)
        assert s.healthy and "on_idle callback failed" in caplog.text
    finally:
        await s.stop()
        eng.shutdown()


async def test_no_leaks_after_200_mixed_requests(make) -> None:
    s, eng = await make(
        SchedulerConfig(max_num_seqs=4, max_queue=12, max_num_batched_tokens=24),
        max_model_len=96,
        prefill_chunk_tokens=16,
    )
    rng = random.Random(7)
    handles = []
    refused = 0

    async def consume(h, kind: str) -> str:
        if kind == "cancel":
            n = rng.randrange(0, 4)
            async for _event in h:
                n -= 1
                if n <= 0:
                    h.abort()
        _, _, fin = await h.collect() if h.finish is None else ("", (), h.finish)
        return fin.reason

    tasks = []
    for i in range(200):
        if i % 50 < 30:  # then bursts of 20 back-to-back submissions overflow the queue
            await asyncio.sleep(0.003)
        kind = rng.choice(["finish", "finish", "cancel", "timeout", "stop", "too_long"])
        prompt = f"mixed load request {i} " + "pad " * rng.randrange(0, 12)
        kw: dict[str, object] = {}
        if kind == "timeout":
            kw["deadline_s"] = time.monotonic() + rng.uniform(
                -0.01, 0.02
            )  # some already past: a timeout is sure
        if kind == "stop":
            kw["stop"] = ("e",)
        n = 200 if kind == "too_long" else rng.randrange(1, 20)
        try:
            h = s.submit(req(i, prompt, max_tokens=n, **kw))
        except (QueueFull, ContextTooLong):
            refused += 1
            continue
        handles.append(h)
        tasks.append(asyncio.ensure_future(consume(h, kind)))
    reasons = await asyncio.gather(*tasks)
    assert refused > 0 and set(reasons) >= {"length", "abort", "error"}
    await assert_idle(s, eng)
    assert (
        min(s.outcomes[k] for k in ("stop", "length", "abort", "timeout", "queue_full", "context_length")) > 0
    )
    assert sum(s.outcomes.values()) == 200
    assert all(h.finished for h in handles)


def test_mailbox_coalesces_tokens_when_the_reader_is_slow() -> None:
    box = Mailbox(capacity=4)
    for i in range(10):
        box.put(TokenEvent(str(i), (i,)))
    box.put(FinishEvent("length", 1, 10))
    assert len(box) == 4

    async def drain() -> list[object]:
        return [await box.get() for _ in range(4)]

    events = asyncio.run(drain())
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert "".join(e.text for e in tokens) == "0123456789"
    assert sum((e.token_ids for e in tokens), ()) == tuple(range(10))
    assert isinstance(events[-1], FinishEvent)
    with pytest.raises(RuntimeError):
        box.put(TokenEvent("x", (1,)))


def test_slot_table_reuses_a_slot_only_after_its_release_ran() -> None:
    table = SlotTable(3)
    assert [table.acquire(3), table.acquire(3), table.acquire(2)] == [0, 1, None]  # the limit binds
    table.retire(0)
    assert table.acquire(1) is None  # draining: not free until the engine has released it
    sent = table.take_releases()
    assert sent == (0,) and table.take_releases() == ()  # each release travels in one plan only
    assert table.highest_held == 2 and table.draining == 1
    table.released(sent)
    assert table.acquire(1) == 0
    with pytest.raises(SlotError):
        table.retire(2)  # never acquired
    with pytest.raises(SlotError):
        table.released((1,))  # busy, not draining


@pytest.mark.parametrize(
    "plans",
    [
        [
            StepPlan(prefills=(PrefillChunk(0, (5, 6), 0, True),), sampling={0: SamplingParams()}),
            StepPlan(prefills=(PrefillChunk(0, (7,), 0, True),), sampling={0: SamplingParams()}),
        ],
        [
            StepPlan(prefills=(PrefillChunk(0, (5, 6), 0, True),), sampling={0: SamplingParams()}),
            StepPlan(decodes=(DecodeToken(0, EOS, 2),), sampling={0: SamplingParams()}),
        ],
        [StepPlan(prefills=(PrefillChunk(0, (5, 6), 2, False),), sampling={0: SamplingParams()})],
        [
            StepPlan(max_slots=2),
            StepPlan(prefills=(PrefillChunk(3, (5,), 0, True),), sampling={3: SamplingParams()}),
        ],
        [StepPlan(prefills=(PrefillChunk(0, tuple(range(1, 80)), 0, True),), sampling={0: SamplingParams()})],
        [StepPlan(release=(3,))],
    ],
    ids=[
        "reuse-without-release",
        "decode-of-unsampled-token",
        "prefill-at-wrong-position",
        "slot-above-limit",
        "over-profiled-chunk",
        "release-of-empty-slot",
    ],
)
def test_fake_engine_refuses_plans_a_real_engine_could_not_run(plans: list[StepPlan]) -> None:
    eng = FakeEngine(prefill_chunk_tokens=64)
    try:
        *ok, bad = plans
        for plan in ok:
            eng.submit(plan).result()
        with pytest.raises(FakeEngineError):
            eng.submit(bad).result()
        assert not eng.healthy
    finally:
        eng.shutdown()
