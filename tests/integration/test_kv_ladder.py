"""The ladder acts on the KV pool, through the real scheduler and engine (tiny Llama on the CPU):
a walk OK -> WATCH -> TIGHT -> CRITICAL -> OK while 8 greedy streams run. WATCH sheds the prefix
cache, TIGHT gives free segments back, CRITICAL refuses new segments so sequences that need blocks
are preempted (youngest first) and resume later; every request completes with the tokens of a calm
run, and the pool ends idle."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.memory.config import MemoryConfig
from ballast.memory.device import StaticDeviceReader
from ballast.memory.types import Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import FinishEvent, GenerationRequest, TokenEvent
from ballast.scheduler.scheduler import Scheduler
from memfixtures import level_tree

GREEDY = SamplingParams(temperature=0.0)
STREAMS, NEW_TOKENS = 8, 96
# 64 KiB segments hold 4 blocks of this model's KV (16 KiB each): the pool grows and shrinks often.
CFG = EngineConfig(
    model="builtin:tiny-llama",
    device="cpu",
    max_num_seqs=STREAMS,
    max_model_len=256,
    prefill_chunk_tokens=64,
    kv_segment_bytes=64 << 10,
)


class Signals:
    """The memory files MemWatch reads, in a temp tree, set to a level on demand."""

    def __init__(self, root: Path, level: Level) -> None:
        self.root, self.mem = root, MemoryConfig(root=str(root))
        level_tree(root, level, config=self.mem)
        self.watch = MemWatch(self.mem, StaticDeviceReader())
        self.watch.poll_now()

    def set(self, level: Level) -> None:
        level_tree(self.root, level, config=self.mem)
        self.watch.poll_now()


def prompts() -> list[tuple[int, ...]]:
    return [tuple(range(100 + 7 * i, 100 + 7 * i + 20 + 3 * i)) for i in range(STREAMS)]


async def run_all(sched: Scheduler, on_progress=None) -> list[tuple[tuple[int, ...], str]]:  # type: ignore[no-untyped-def]
    handles = [
        sched.submit(GenerationRequest(f"r{i}", p, GREEDY, max_tokens=NEW_TOKENS))
        for i, p in enumerate(prompts())
    ]
    tokens: list[list[int]] = [[] for _ in handles]

    async def consume(i: int) -> str:
        async for ev in handles[i]:
            if isinstance(ev, TokenEvent):
                tokens[i].extend(ev.token_ids)
            elif isinstance(ev, FinishEvent):
                return ev.reason
        return "none"

    tasks = [asyncio.ensure_future(consume(i)) for i in range(len(handles))]
    if on_progress is not None:
        while not all(t.done() for t in tasks):
            await on_progress(sum(len(t) for t in tokens))
            await asyncio.sleep(0.002)
    reasons = await asyncio.gather(*tasks)
    return [(tuple(t), r) for t, r in zip(tokens, reasons, strict=True)]


async def test_ladder_walk_gives_kv_memory_back_and_every_request_completes(tmp_path: Path) -> None:
    calm_engine = Engine.load(CFG)
    calm = Scheduler(calm_engine, SchedulerConfig(max_num_seqs=STREAMS))
    await calm.start()
    try:
        want = await run_all(calm)
    finally:
        await calm.stop()
        calm_engine.shutdown()
    assert all(r == "length" and len(t) == NEW_TOKENS for t, r in want)

    signals = Signals(tmp_path, Level.OK)
    watch = signals.watch
    engine = Engine.load(CFG, watch)
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=STREAMS), memwatch=watch)
    kv, cache = engine.runner.kv, engine.prefix_cache
    assert kv is not None and cache is not None
    total = STREAMS * NEW_TOKENS
    walk = [(0.1, Level.WATCH), (0.25, Level.TIGHT), (0.4, Level.CRITICAL), (0.7, Level.OK)]
    seen: dict[Level, dict[str, int]] = {}
    peak = {"kv": 0}

    async def on_progress(done: int) -> None:
        peak["kv"] = max(peak["kv"], kv.bytes_held)
        if walk and done >= walk[0][0] * total:
            _, level = walk.pop(0)
            seen[level] = {"kv": kv.bytes_held, "cache": cache.bytes_held, "at": done}
            signals.set(level)

    await sched.start()
    try:
        got = await run_all(sched, on_progress)
    finally:
        await sched.stop()
    try:
        assert [t for t, _ in got] == [t for t, _ in want]  # same tokens as the calm run, every one
        assert all(r == "length" for _, r in got)
        assert set(seen) == {Level.WATCH, Level.TIGHT, Level.CRITICAL, Level.OK}
        assert (
            seen[Level.WATCH]["cache"] > 0 and seen[Level.TIGHT]["cache"] == 0
        )  # WATCH shed the prefix cache
        preempted = engine.slot_kv.preemptions
        assert preempted > 0 and sched.preemptions == preempted  # CRITICAL: no new segment
        assert seen[Level.OK]["kv"] < peak["kv"]  # TIGHT and CRITICAL gave segments back
        assert kv.figures().used_blocks == 0 or cache.bytes_held > 0  # only the prefix cache may hold blocks
        cache.shed()
        assert kv.figures().used_blocks == 0
    finally:
        engine.shutdown()


async def test_watch_starts_new_sequences_in_int8_blocks(tmp_path: Path) -> None:
    """At WATCH new sequences keep their KV in int8 blocks (fewer bytes per token than the model
    dtype), beside sequences already running in the main pool; their tokens are those of an engine
    configured for int8 KV."""
    int8_engine = Engine.load(EngineConfig(**{**CFG.__dict__, "kv_quant": "int8"}))
    ref = Scheduler(int8_engine, SchedulerConfig(max_num_seqs=STREAMS))
    await ref.start()
    try:
        want = await run_all(ref)
    finally:
        await ref.stop()
        int8_engine.shutdown()

    signals = Signals(tmp_path, Level.WATCH)
    watch = signals.watch
    engine = Engine.load(CFG, watch)
    main, int8 = engine.runner.kv, engine.runner.kv_int8
    assert main is not None and int8 is not None
    assert int8.layout.block_bytes * 3 < main.layout.block_bytes  # float32 KV: int8 + scales is < 1/3
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=STREAMS), memwatch=watch)
    peak = {"main": 0, "int8": 0}

    async def on_progress(done: int) -> None:
        peak["main"] = max(peak["main"], main.figures().used_blocks)
        peak["int8"] = max(peak["int8"], int8.figures().used_blocks)

    await sched.start()
    try:
        got = await run_all(sched, on_progress)
    finally:
        await sched.stop()
        engine.shutdown()
    assert peak["int8"] > 0 and peak["main"] == 0  # every sequence started at WATCH is int8
    assert got == want


async def test_watch_fills_free_main_blocks_before_growing_the_int8_pool(tmp_path: Path) -> None:
    """At WATCH a new sequence that the main pool's free blocks hold whole starts there: no new
    memory (the main pool does not grow, the int8 pool takes nothing), the tokens of the calm run.
    The int8 pool is for growth; growing it under a squeeze stalled every new request."""
    signals = Signals(tmp_path, Level.OK)
    watch = signals.watch
    engine = Engine.load(CFG, watch)
    main, int8 = engine.runner.kv, engine.runner.kv_int8
    assert main is not None and int8 is not None
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=STREAMS), memwatch=watch)
    peak = {"main": 0, "int8": 0}

    async def on_progress(done: int) -> None:
        peak["main"] = max(peak["main"], main.bytes_held)
        peak["int8"] = max(peak["int8"], int8.figures().used_blocks)

    await sched.start()
    try:
        calm = await run_all(sched)  # grows the main pool for 8 streams at OK
        grown = main.bytes_held
        signals.set(Level.WATCH)
        got = await run_all(sched, on_progress)
    finally:
        await sched.stop()
        engine.shutdown()
    assert grown > 0 and got == calm
    assert peak["int8"] == 0 and peak["main"] <= grown


async def test_tight_keeps_the_free_blocks_that_queued_requests_need(tmp_path: Path) -> None:
    """At TIGHT the pool gives back only its surplus: the free blocks that running requests will
    still take and that queued ones would take stay, so the queue starts without new memory (the
    pool never grows again at TIGHT, nothing is preempted, nothing goes to int8) and with the tokens
    of the calm run. Giving every free segment back made each new request wait for memory that a
    co-tenant squeezing the die did not give back (measured on an H200)."""
    signals = Signals(tmp_path, Level.OK)
    watch = signals.watch
    engine = Engine.load(CFG, watch)
    main, int8 = engine.runner.kv, engine.runner.kv_int8
    assert main is not None and int8 is not None
    # TIGHT: 2 slots. No working set kept (kv_keep_s 0): what is kept is for the queue alone
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=4, kv_keep_s=0.0), memwatch=watch)
    asked = prompts()[:4]
    pools = Watched(sched, engine)
    await sched.start()
    try:
        calm = await pools.run(asked, 160)  # at OK the pool grows for 4 long sequences
        grown = main.bytes_held
        signals.set(Level.TIGHT)
        pools.held.clear()
        tight = await asyncio.wait_for(pools.run(asked, 48), 60)  # 2 start, 2 wait for a slot
    finally:
        await sched.stop()
        engine.shutdown()
    assert [r for _, r in calm] == ["length"] * 4 and [r for _, r in tight] == ["length"] * 4
    assert [t for t, _ in tight] == [t[:48] for t, _ in calm]
    assert engine.slot_kv.preemptions == 0 and pools.int8_peak == 0
    assert min(pools.held) < grown  # the surplus went back
    assert all(b <= a for a, b in itertools.pairwise(pools.held)), pools.held  # and it never grew again


class Watched:
    """Runs requests to their end, reading the main pool's bytes and the most blocks the int8
    pool used at every event."""

    def __init__(self, sched: Scheduler, engine: Engine) -> None:
        self._sched, self._main, self._int8 = sched, engine.runner.kv, engine.runner.kv_int8
        self.held: list[int] = []
        self.int8_peak = 0
        self._sent = 0

    async def run(self, asked: list[tuple[int, ...]], n_tokens: int) -> list[tuple[tuple[int, ...], str]]:
        """(text, finish reason) of each prompt in `asked`, given n_tokens new tokens."""
        assert self._main is not None and self._int8 is not None
        handles = []
        for p in asked:
            self._sent += 1
            handles.append(
                self._sched.submit(GenerationRequest(f"w{self._sent}", p, GREEDY, max_tokens=n_tokens))
            )
        out = []
        for h in handles:
            toks: list[int] = []
            async for ev in h:
                self.held.append(self._main.bytes_held)
                self.int8_peak = max(self.int8_peak, self._int8.figures().used_blocks)
                if isinstance(ev, TokenEvent):
                    toks.extend(ev.token_ids)
                elif isinstance(ev, FinishEvent):
                    out.append((tuple(toks), ev.reason))
        return out


async def _long_after_a_short(tmp_path: Path, keep_s: float) -> tuple[int, int, list[int], int, bool]:
    """4 longer requests at OK, then TIGHT: one short request (the shrink comes with its steps,
    nothing else queued), then the 4 longer ones again. Returns the main pool's bytes after the calm
    run and after the short request, its bytes at every event of the second run, the most blocks
    the int8 pool held then, and whether that run's texts were the calm run's."""
    tmp_path.mkdir()
    signals = Signals(tmp_path, Level.OK)
    engine = Engine.load(CFG, signals.watch)
    main, int8 = engine.runner.kv, engine.runner.kv_int8
    assert main is not None and int8 is not None
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=4, kv_keep_s=keep_s), memwatch=signals.watch)
    pools = Watched(sched, engine)
    await sched.start()
    try:
        calm = await pools.run(prompts()[:4], 200)  # past TIGHT's halved window (128)
        grown = main.bytes_held
        signals.set(Level.TIGHT)
        await pools.run([prompts()[5][:8]], 4)
        after_short = main.bytes_held
        pools.held.clear()
        again = await asyncio.wait_for(pools.run(prompts()[:4], 200), 60)
    finally:
        await sched.stop()
        engine.shutdown()
    assert engine.slot_kv.preemptions == 0
    assert [r for _, r in calm] == ["length"] * 4 and [r for _, r in again] == ["length"] * 4
    return grown, after_short, pools.held, pools.int8_peak, again == calm


async def test_tight_keeps_the_working_set_for_requests_that_come_after_a_lull(tmp_path: Path) -> None:
    """The free blocks the pool's sequences held in the last `kv_keep_s` seconds stay at TIGHT even
    while nothing is queued: requests that come after a lull start on them, with the calm run's
    text, and no pool grows. They ask for more than TIGHT's halved window (128): on blocks the pool
    holds they run whole (the narrower window binds only requests that need new memory; without
    that they were capped, their texts cut short). With `kv_keep_s=0` the lull gave them back, and
    the same requests needed new memory at TIGHT: the main pool may not grow there, so they went to
    int8 blocks (their text no longer the calm run's). On an H100 under a co-tenant there was no
    new memory at all: 3 of a burst's 192 requests were served (s26)."""
    default = SchedulerConfig().kv_keep_s
    grown, after_short, held, int8_peak, same = await _long_after_a_short(tmp_path / "keep", default)
    assert after_short >= grown - CFG.kv_segment_bytes  # at most the surplus segment went back
    assert same and max(held) <= after_short and int8_peak == 0  # they ran on what was kept
    grown, after_short, held, int8_peak, same = await _long_after_a_short(tmp_path / "none", 0.0)
    assert after_short < grown - CFG.kv_segment_bytes and max(held) <= after_short
    assert int8_peak > 0 and not same


async def test_a_scheduler_states_its_slot_limit_to_an_engine_another_one_narrowed() -> None:
    """The engine refuses sequences started past its slot limit, which the last plan set: a
    scheduler taking over an engine that an earlier one (with one slot) left at limit 1 states
    its own limit in its first plan, and two requests then run side by side."""
    engine = Engine.load(EngineConfig(model="builtin:tiny-llama", max_num_seqs=2, max_model_len=128))
    greedy = SamplingParams(temperature=0.0)
    try:
        first = Scheduler(engine, SchedulerConfig(max_num_seqs=1))
        await first.start()
        await first.submit(GenerationRequest("a", (5, 6, 7), greedy, max_tokens=3)).collect()
        await first.stop()
        assert engine._steps.slot_limit == 1
        second = Scheduler(engine, SchedulerConfig(max_num_seqs=2))
        await second.start()
        try:
            handles = [
                second.submit(GenerationRequest(f"b{i}", (9, 8, 7 + i), greedy, max_tokens=4)) for i in (0, 1)
            ]
            finishes = [f for _, _, f in await asyncio.gather(*(h.collect() for h in handles))]
            assert [f.reason for f in finishes] == ["length", "length"]
            assert engine._steps.slot_limit == 2 and engine.healthy and engine._steps.step_failures == 0
        finally:
            await second.stop()
    finally:
        engine.shutdown()


async def test_at_tight_requests_wait_for_kept_main_blocks_rather_than_start_cut_in_int8(
    tmp_path: Path,
) -> None:
    """At TIGHT the main pool keeps the blocks of 2 long sequences, the ladder allows 4 slots, and
    4 requests past TIGHT's halved window (128) come. 2 start on the kept blocks; the other 2 wait
    for those blocks and then run whole, with the calm run's text; the int8 pool takes nothing and
    no pool grows. Sent to the int8 pool because the main pool's blocks were busy, they met the
    halved window there and were cut short; on an H100 under a co-tenant, where the int8 pool had no
    memory to grow, 184 of a burst's 192 were refused beside main blocks that would have served
    them in turn (s28)."""
    signals = Signals(tmp_path, Level.OK)
    engine = Engine.load(CFG, signals.watch)
    main = engine.runner.kv
    assert main is not None
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=8), memwatch=signals.watch)  # TIGHT: 4
    pools = Watched(sched, engine)
    await sched.start()
    try:
        calm = await pools.run(prompts()[:2], 200)  # the main pool grows for 2 long sequences
        grown = main.bytes_held
        signals.set(Level.TIGHT)
        pools.held.clear()
        tight = await asyncio.wait_for(pools.run(prompts()[:2] * 2, 200), 60)
        limit = sched.slot_limit
    finally:
        await sched.stop()
        engine.shutdown()
    assert limit == 4  # slots were not what held them back
    assert [r for _, r in tight] == ["length"] * 4
    assert tight == calm * 2 and pools.int8_peak == 0
    assert max(pools.held) <= grown
