"""The scheduler under memory pressure: a real MemWatch reads a fixture /proc tree that the test
rewrites, the fake engine runs plans on its worker thread, and nothing in between is simulated."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.device import StaticDeviceReader
from ballast.memory.levels import host_reserve_bytes
from ballast.memory.types import GiB, Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import Overloaded
from ballast.scheduler.request import GenerationRequest, RequestHandle
from ballast.scheduler.scheduler import Scheduler
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens
from memfixtures import level_tree, write_tree

TOK = FakeTokenizer()
MiB = 1 << 20


def req(i: int, max_tokens: int, words: int = 3) -> GenerationRequest:
    return GenerationRequest(
        f"r{i}", tuple(TOK.encode(f"pressure test {i} " + "word " * words)), max_tokens=max_tokens
    )


def calm(r: GenerationRequest, n: int | None = None) -> str:
    return TOK.decode(expected_tokens(r.prompt_ids, n or r.max_tokens))


async def wait_until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(10000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


class Box:
    """The fixture tree and the MemWatch reading it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cfg = MemoryConfig(root=str(root))
        level_tree(root, Level.OK, config=self.cfg)
        self.watch = MemWatch(self.cfg, StaticDeviceReader())
        self.watch.poll_now()

    def set(self, level: Level) -> None:
        level_tree(self.root, level, config=self.cfg)
        assert self.watch.poll_now().level == level


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Scheduler, FakeEngine, Box]]:
    box = Box(tmp_path)
    eng = FakeEngine(num_slots=8, max_model_len=256, prefill_chunk_tokens=64, step_delay_s=0.002)
    s = Scheduler(
        eng, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, retry_after_s=1.5), memwatch=box.watch
    )
    await s.start()
    yield s, eng, box
    await s.stop()
    eng.shutdown()


def concurrency(eng: FakeEngine, since: int) -> int:
    return max((len(p.prefills) + len(p.decodes) for p in eng.recorded()[since:]), default=0)


async def test_ladder_walk_slots_window_and_refusals(rig: tuple[Scheduler, FakeEngine, Box]) -> None:
    s, eng, box = rig
    # OK: eight requests run side by side.
    ok = [s.submit(req(i, 40)) for i in range(8)]
    await wait_until(lambda: s.active_slots == 8, "8 running at OK")

    # WATCH: quantized KV for new caches and the prefix cache shed, but concurrency is untouched.
    box.set(Level.WATCH)
    watch_wave = [s.submit(req(20 + i, 4)) for i in range(8)]
    await wait_until(lambda: s.ladder.level == Level.WATCH, "WATCH plan")
    assert (
        s.ladder.force_quantized_kv
        and s.ladder.shed_prefix_cache
        and s.slot_limit == 8
        and s.ladder.context_window == 256
    )
    assert s.pressure_level == Level.OK

    # TIGHT while they run: nobody is killed, but the ceiling is 4 and the window 128.
    box.set(Level.TIGHT)
    tight = [s.submit(req(10 + i, 30)) for i in range(6)]
    capped = s.submit(req(99, 200))
    for h in ok + watch_wave:
        text, _, fin = await h.collect()
        assert fin.reason == "length" and text == calm(h.request)
    mark = len(eng.recorded())
    results = [await h.collect() for h in tight]
    assert [t for t, _, _ in results] == [calm(h.request) for h in tight]
    assert concurrency(eng, mark) <= 4 and s.slot_limit == 4 and s.ladder.context_window == 128
    text, _, fin = await capped.collect()
    n_prompt = len(capped.request.prompt_ids)
    assert fin.capped and fin.reason == "length" and fin.completion_tokens == 128 - n_prompt
    assert text == calm(capped.request, 128 - n_prompt)
    await wait_until(lambda: eng.slot_limit == 4, "engine applied the TIGHT ceiling")

    # CRITICAL: one slot; new requests refused at once; queued ones refused; the running one finishes.
    running = s.submit(req(50, 60))
    queued = [s.submit(req(51 + i, 5)) for i in range(3)]
    await wait_until(lambda: s.active_slots == 4, "four admitted at TIGHT")
    box.set(Level.CRITICAL)
    with pytest.raises(Overloaded) as refused:
        s.submit(req(60, 5))
    assert refused.value.retry_after_s == 1.5
    for h in queued:  # they had slots at TIGHT (4 of them), so they run to completion
        assert (await h.collect())[0] == calm(h.request)
    text, _, fin = await running.collect()
    assert fin.reason == "length" and text == calm(running.request)
    await wait_until(lambda: eng.slot_limit == 1, "engine applied the CRITICAL ceiling")
    assert s.pressure_level == Level.CRITICAL and s.ladder.context_window == 64

    # Back to OK: the server serves again with the full ladder.
    box.set(Level.OK)
    again = [s.submit(req(70 + i, 10)) for i in range(8)]
    assert [(await h.collect())[0] for h in again] == [calm(h.request) for h in again]
    await wait_until(lambda: s.idle and eng.active_slots == 0, "idle")
    assert s.slot_limit == 8 and s.pressure_level == Level.OK and eng.slot_limit == 8
    assert s.outcomes["overloaded"] == 1


async def test_critical_refuses_the_waiting_queue(rig: tuple[Scheduler, FakeEngine, Box]) -> None:
    s, eng, box = rig
    box.set(Level.TIGHT)  # 4 slots
    running = [s.submit(req(i, 50)) for i in range(4)]
    await wait_until(lambda: s.active_slots == 4, "4 running")
    waiting = [s.submit(req(10 + i, 5)) for i in range(5)]
    assert s.queue_depth == 5
    box.set(Level.CRITICAL)
    for h in waiting:
        _, _, fin = await h.collect()
        assert fin.reason == "error" and isinstance(fin.error, Overloaded) and fin.completion_tokens == 0
    for h in running:  # in-flight requests are never killed by pressure
        text, _, fin = await h.collect()
        assert fin.reason == "length" and text == calm(h.request)
    await wait_until(lambda: s.idle and eng.active_slots == 0, "idle")
    assert s.outcomes["overloaded"] == 5 and s.outcomes["length"] == 4


async def test_level_flapping_never_changes_an_admitted_request(
    rig: tuple[Scheduler, FakeEngine, Box],
) -> None:
    s, eng, box = rig
    reqs = [req(i, 48, words=i % 5) for i in range(16)]
    stop = threading.Event()
    flips = 0

    def flap() -> None:  # another thread rewrites /proc and publishes, as the poll thread would
        nonlocal flips
        level = Level.CRITICAL
        while not stop.is_set():
            box.set(level)
            flips += 1
            level = Level.OK if level is Level.CRITICAL else Level.CRITICAL
            stop.wait(0.05)

    flapper = threading.Thread(target=flap, name="flapper")
    flapper.start()
    handles: list[RequestHandle] = []
    refused_at_submit = 0
    try:
        for r in reqs:
            try:
                handles.append(s.submit(r))
            except Overloaded:
                refused_at_submit += 1
            await asyncio.sleep(0.02)
        results = [await h.collect() for h in handles]
    finally:
        stop.set()
        flapper.join()
    completed = 0
    for h, (text, _, fin) in zip(handles, results, strict=True):
        if fin.reason == "error":
            assert isinstance(fin.error, Overloaded) and fin.completion_tokens == 0
        else:
            assert (fin.reason, text) == ("length", calm(h.request))
            completed += 1
    assert flips >= 4 and completed > 0 and refused_at_submit + (len(handles) - completed) > 0
    box.set(Level.OK)
    await wait_until(lambda: s.idle and eng.active_slots == 0, "idle")
    assert s.queue_depth == 0 and s.active_slots == 0 and s.pressure_level == Level.OK


async def test_submit_at_critical_is_synchronous_and_cheap(rig: tuple[Scheduler, FakeEngine, Box]) -> None:
    s, _, box = rig
    box.set(Level.CRITICAL)
    # No await between submit and the refusal: it cannot wait on the loop, the engine or a lock.
    t0 = time.perf_counter()
    for i in range(1000):
        with pytest.raises(Overloaded):
            s.submit(req(i, 5))
    elapsed = time.perf_counter() - t0
    assert s.outcomes["overloaded"] == 1000 and s.queue_depth == 0
    print(f"\nsubmit refusal at CRITICAL: {elapsed / 1000 * 1e6:.1f} us each")


async def test_ceiling_changes_reach_the_engine_while_idle(tmp_path: Path) -> None:
    box = Box(tmp_path)
    eng = FakeEngine(num_slots=8)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, idle_tick_s=0.01)
    s = Scheduler(eng, cfg, memwatch=box.watch, on_idle=lambda: None)
    await s.start()
    try:
        box.set(Level.CRITICAL)
        await wait_until(lambda: eng.slot_limit == 1, "CRITICAL ceiling sent while idle")
        box.set(Level.OK)
        await wait_until(lambda: eng.slot_limit == 8, "OK ceiling sent while idle")
        # The engine now accepts all eight slots again (it refuses a slot above its limit).
        handles = [s.submit(req(i, 6)) for i in range(8)]
        assert [(await h.collect())[0] for h in handles] == [calm(h.request) for h in handles]
        assert concurrency(eng, 0) == 8
    finally:
        await s.stop()
        eng.shutdown()


@pytest.mark.parametrize("quantized", [False, True])
async def test_admission_charges_the_engines_own_kv_format(tmp_path: Path, quantized: bool) -> None:
    """An engine whose KV is int8 is charged int8 bytes: a request that the model dtype's bytes
    would cap is admitted whole (the format comes from the engine, not from a separate argument)."""
    from ballast.memory.types import CostModel, GiB, MiB
    from memfixtures import write_tree

    cfg = MemoryConfig(root=str(tmp_path))
    write_tree(
        tmp_path, mem_total=64 * GiB, mem_available=int(9.6 * GiB) + 12 * GiB
    )  # 12 GiB above the reserve
    watch = MemWatch(cfg, StaticDeviceReader())
    watch.poll_now()
    cost = CostModel(
        kv_bytes_per_token=10 * MiB,
        state_bytes_per_slot=0,
        activation_bytes_per_prefill_token=0,
        quantized_kv_bytes_per_token=10 * MiB // 4,
    )
    eng = FakeEngine(max_model_len=4096, cost_model=cost, quantized_kv=quantized)
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=2), memwatch=watch)
    await s.start()
    try:
        r = req(0, max_tokens=2000)  # ~2,010 tokens: 19.6 GiB in the model dtype, 4.9 GiB in int8
        _, tokens, fin = await s.submit(r).collect()
        assert fin.capped is not quantized
        assert len(tokens) == 2000 if quantized else 0 < len(tokens) < 2000
    finally:
        await s.stop()
        eng.shutdown()


async def test_a_head_that_fits_once_running_requests_end_waits_instead_of_being_refused(
    tmp_path: Path,
) -> None:
    """Admission charges whole requests in KV blocks: with a pool of 40 blocks and requests of ~10
    blocks each, about three run at once; the others wait at the queue head (not refused, not cut
    short) and start as blocks come back. Every request completes whole with its calm text."""
    cfg = MemoryConfig(root=str(tmp_path))
    level_tree(tmp_path, Level.OK, config=cfg)
    watch = MemWatch(cfg, StaticDeviceReader())
    watch.poll_now()
    eng = FakeEngine(max_model_len=256, kv_blocks=40)
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=8), memwatch=watch)
    await s.start()
    try:
        reqs = [req(i, max_tokens=28) for i in range(8)]  # 8-9 prompt + 28 new tokens: 10 blocks of 4
        results = await asyncio.gather(*(s.submit(r).collect() for r in reqs))
        for r, (text, _, fin) in zip(reqs, results, strict=True):
            assert fin.reason == "length" and not fin.capped and text == calm(r)
        assert s.outcomes["overloaded"] == 0 and 0 < eng.peak_blocks <= 40
        assert max(len(p.prefills) + len(p.decodes) for p in eng.recorded()) <= 4  # never all 8 at once
    finally:
        await s.stop()
        eng.shutdown()


async def test_requests_no_wait_would_serve_are_refused_together_not_one_per_poll(tmp_path: Path) -> None:
    """A host with 12 MiB of budget above its reserve (level TIGHT) and requests whose prompts
    alone need more: the first one admission refuses holds the queue until memory is seen again,
    and every queued request that would not fit even once running work ended is refused in the
    same pass (before, one per memory poll: 503s after 12.3 s p50 under an H200 squeeze). While
    the hold lasts, a new such request is refused synchronously by submit; a small one waits and
    is served after the next poll."""
    s, watch, eng = await _at_tight(tmp_path, 12 * MiB)
    try:
        big = [req(i, max_tokens=16, words=40) for i in range(10)]  # ~215 prompt tokens: 13 MiB of KV alone
        handles = [s.submit(r) for r in big]
        results = await asyncio.wait_for(asyncio.gather(*(h.collect() for h in handles)), 10)
        assert all(isinstance(fin.error, Overloaded) for _, _, fin in results), [f for _, _, f in results]
        assert s.outcomes["overloaded"] == 10
        with pytest.raises(Overloaded):  # the hold lasts: refused before it is queued
            s.submit(req(10, max_tokens=16, words=40))
        s.refuse_early()  # a one-token prompt would fit: nothing to refuse before a prompt is built
        small = req(11, max_tokens=4, words=1)
        waiting = s.submit(small)
        watch.poll_now()  # memory seen again: the hold lifts and the small one fits
        text, _, fin = await asyncio.wait_for(waiting.collect(), 10)
        assert fin.reason == "length" and text == calm(small)
    finally:
        await s.stop()
        eng.shutdown()


async def test_a_hold_no_prompt_would_pass_is_refused_before_the_prompt_is_built(tmp_path: Path) -> None:
    """TIGHT with 32 KiB above the reserve, a token's KV 64 KiB: no prompt fits, in either KV
    format. Once admission's REJECT holds the queue, `refuse_early` (which the server asks before
    building a prompt: template and tokens take the event loop milliseconds a request) refuses as
    submit would; with room for a short prompt it refuses nothing."""
    s, watch, eng = await _at_tight(tmp_path, 32 * 1024)
    try:
        s.refuse_early()  # no REJECT yet: the request is queued and admission decides
        _, _, fin = await asyncio.wait_for(s.submit(req(0, max_tokens=4, words=1)).collect(), 10)
        assert isinstance(fin.error, Overloaded)
        with pytest.raises(Overloaded) as early:
            s.refuse_early()
        with pytest.raises(Overloaded) as submitted:
            s.submit(req(1, max_tokens=4, words=1))
        assert "not even 2 tokens fit" in early.value.reason  # the least any request needs
        assert early.value.reason.split(":")[0] == submitted.value.reason.split(":")[0]
        assert s.outcomes["overloaded"] == 3
        _host(tmp_path, 12 * MiB)
        watch.poll_now()
        s.refuse_early()
    finally:
        await s.stop()
        eng.shutdown()


def _host(root: Path, above_reserve: int) -> MemoryConfig:
    """A 16 GiB host with `above_reserve` bytes available above its reserve."""
    cfg = MemoryConfig(root=str(root))
    write_tree(root, mem_total=16 * GiB, mem_available=host_reserve_bytes(16 * GiB, cfg) + above_reserve)
    return cfg


async def _at_tight(root: Path, above_reserve: int) -> tuple[Scheduler, MemWatch, FakeEngine]:
    """A started scheduler on `_host` (TIGHT) over a fake engine whose token takes 64 KiB of KV."""
    watch = MemWatch(_host(root, above_reserve), StaticDeviceReader())
    assert watch.poll_now().level is Level.TIGHT
    eng = FakeEngine(max_model_len=512, prefill_chunk_tokens=512)
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=8), memwatch=watch)
    await s.start()
    return s, watch, eng
