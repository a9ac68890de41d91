"""Prefix reuse through the scheduler: checkpoint orders against the fake engine (whose prefix cache
checks every save names exactly what its slot consumed), the ladder shedding the cache at WATCH,
and a multi-turn chat on the real engine (builtin:tiny-qwen3-next) whose later turns restore
checkpoints, give the same tokens as a cold engine, and prefill fewer tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.interface import EngineLike
from ballast.engine.plan import SamplingParams, StepPlan
from ballast.memory.config import MemoryConfig
from ballast.memory.device import StaticDeviceReader
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens
from memfixtures import level_tree
from prometheus_client.parser import text_string_to_metric_families
from serverproc import running_server

TOK = FakeTokenizer()
INTERVAL = 8
GREEDY = SamplingParams(temperature=0.0)


async def chat(s: Scheduler, turns: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Each turn's prompt is the previous prompt + its answer + the new user message."""
    prompt: tuple[int, ...] = ()
    answers: list[list[int]] = []
    for i, user in enumerate(turns):
        prompt = prompt + (tuple(answers[-1]) if answers else ()) + tuple(user)
        _, ids, _ = await s.submit(
            GenerationRequest(f"t{i}", prompt, GREEDY, max_tokens=max_tokens)
        ).collect()
        answers.append(list(ids))
    return answers


async def run_chat(
    engine: EngineLike, turns: Sequence[Sequence[int]], max_tokens: int, memwatch: MemWatch | None = None
) -> tuple[list[list[int]], Scheduler]:
    s = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), memwatch=memwatch)
    await s.start()
    try:
        return await chat(s, turns, max_tokens), s
    finally:
        await s.stop()


USER = [
    TOK.encode("user: hello there, how are you today?\nassistant:"),
    TOK.encode("user: and what is the weather like?\nassistant:"),
    TOK.encode("user: thanks!\nassistant:"),
]


async def test_fake_engine_turns_restore_and_chunks_end_at_checkpoints() -> None:
    eng = FakeEngine(checkpoint_interval=INTERVAL)
    try:
        answers, s = await run_chat(eng, USER, 10)
    finally:
        eng.shutdown()
    prompt: tuple[int, ...] = ()
    prompt_tokens = 0
    for user, answer in zip(USER, answers, strict=True):
        prompt = prompt + tuple(user)
        prompt_tokens += len(prompt)
        assert answer == expected_tokens(prompt, 10)  # reuse changes no token
        prompt = prompt + tuple(answer)
    plans = eng.recorded()
    restores = [r for p in plans for r in p.restores]
    # Turns 2 and 3 restore the previous turn's end-of-generation checkpoint (prompt + answer
    # minus its last token, which was sampled but never fed).
    assert len(restores) == 2 and s.reused_tokens == eng.reused_tokens == sum(len(r.prefix) for r in restores)
    assert len(restores[0].prefix) == len(USER[0]) + 10 - 1
    assert eng.prefilled_tokens + eng.reused_tokens == prompt_tokens
    first_restore = next(i for i, p in enumerate(plans) if p.restores)
    for p in plans[:first_restore]:
        for c in p.prefills:  # the cold first prompt: no chunk crosses a checkpoint position
            assert (c.start_pos + len(c.token_ids) - 1) // INTERVAL == c.start_pos // INTERVAL
    # Saves only where a later request can start: interval multiples of the cold prompt, each
    # prompt's end and each answer's end; the turns that continue a restored checkpoint save
    # nothing inside their new part.
    ends, prompt = [], ()
    for user, answer in zip(USER, answers, strict=True):
        prompt = prompt + tuple(user)
        ends += [len(prompt), len(prompt) + len(answer) - 1]
        prompt = prompt + tuple(answer)
    cold = range(INTERVAL, len(USER[0]), INTERVAL)
    assert sorted(len(sv.prefix) for p in plans for sv in p.saves) == sorted([*cold, *ends])


async def test_an_answer_resent_as_text_is_saved_only_where_its_text_gives_back_its_tokens() -> None:
    """A chat client resends the answer as text: a checkpoint at the answer's end is kept only when
    the tokens of that text are the answer's (the fake vocabulary merges "t" "h" into "th", so some
    answers do not come back); a client that resends token ids gets it either way."""

    def comes_back(prompt: tuple[int, ...]) -> bool:
        out = expected_tokens(prompt, 6)
        return TOK.encode(TOK.decode(out)) == out

    prompts = [tuple(TOK.encode(f"user: question {i}?\nassistant:")) for i in range(2000)]
    back = next(p for p in prompts if comes_back(p))
    lost = [p for p in prompts if not comes_back(p)][:2]
    eng = FakeEngine(checkpoint_interval=INTERVAL)
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    await s.start()
    try:
        for rid, prompt, as_text in (("back", back, True), ("lost", lost[0], True), ("ids", lost[1], False)):
            await s.submit(
                GenerationRequest(rid, prompt, GREEDY, max_tokens=6, resent_as_text=as_text)
            ).collect()
    finally:
        await s.stop()
        eng.shutdown()
    saves = [sv.prefix for plan in eng.recorded() for sv in plan.saves]

    def answer_saved(prompt: tuple[int, ...]) -> bool:
        return any(len(sv) > len(prompt) and sv[: len(prompt)] == prompt for sv in saves)

    assert answer_saved(back) and answer_saved(lost[1]) and not answer_saved(lost[0])
    assert lost[0] in saves  # its prompt's end is saved all the same


async def test_no_checkpoint_orders_when_the_engine_has_no_cache() -> None:
    eng = FakeEngine()
    try:
        answers, _ = await run_chat(eng, USER[:2], 6)
    finally:
        eng.shutdown()
    assert answers[0] == expected_tokens(tuple(USER[0]), 6)
    assert not any(p.saves or p.restores or p.shed_prefix_cache for p in eng.recorded())


async def test_watch_sheds_once_and_stops_checkpoints(tmp_path: Path) -> None:
    cfg = MemoryConfig(root=str(tmp_path))
    level_tree(tmp_path, Level.OK, config=cfg)
    watch = MemWatch(cfg, StaticDeviceReader())
    watch.poll_now()
    eng = FakeEngine(checkpoint_interval=INTERVAL)
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), memwatch=watch)
    await s.start()
    try:
        await chat(s, USER[:1], 6)
        assert eng.checkpoints
        for _ in range(5000):  # the answer can arrive before the plan releasing its slot has run
            if s.idle:
                break
            await asyncio.sleep(0.001)
        assert s.idle
        level_tree(tmp_path, Level.WATCH, config=cfg)
        assert watch.poll_now().level is Level.WATCH
        since = len(eng.recorded())
        answers = await chat(s, USER[:2], 6)
        at_watch = eng.recorded()[since:]
        assert sum(p.shed_prefix_cache for p in at_watch) == 1 and at_watch[0].shed_prefix_cache
        assert not any(p.saves or p.restores for p in at_watch)
        assert not eng.checkpoints and eng.sheds == 1
        assert answers[1] == expected_tokens(tuple(USER[0]) + tuple(answers[0]) + tuple(USER[1]), 6)
        level_tree(tmp_path, Level.OK, config=cfg)
        watch.poll_now()
        await chat(s, USER[:1], 6)
        assert eng.checkpoints  # back at OK, checkpoints are saved again
    finally:
        await s.stop()
        eng.shutdown()


HYBRID = EngineConfig(
    model="builtin:tiny-qwen3-next", device="cpu", max_num_seqs=2, max_model_len=256, prefill_chunk_tokens=64
)


def tiny_hybrid(fraction: float) -> Engine:
    return Engine.load(HYBRID, prefix_cache=PrefixCacheConfig(fraction=fraction, checkpoint_interval=16))


async def test_real_engine_chat_through_the_scheduler_matches_cold_and_prefills_less() -> None:
    turns = [[5 + i for i in range(40)], [900 + i for i in range(13)], [3000 + i for i in range(9)]]
    cold_engine, warm_engine = tiny_hybrid(0.0), tiny_hybrid(0.05)
    try:
        cold, _ = await run_chat(cold_engine, turns, 8)
        warm, s = await run_chat(warm_engine, turns, 8)
        assert warm == cold
        assert cold_engine.reused_tokens == 0
        assert warm_engine.reused_tokens > 0 and s.reused_tokens == warm_engine.reused_tokens
        assert warm_engine.prefilled_tokens + warm_engine.reused_tokens == cold_engine.prefilled_tokens
        assert warm_engine.prefilled_tokens < cold_engine.prefilled_tokens / 2
    finally:
        cold_engine.shutdown()
        warm_engine.shutdown()


async def test_an_attention_only_prompt_is_one_step_and_its_inner_checkpoints_serve_the_next() -> None:
    """tiny-llama has no recurrent state: a cold 40-token prompt prefills in one step (no split at
    the interval, 16), and a later prompt sharing its first 32 tokens restores the checkpoint saved
    inside that step (the KV blocks of the prefix), with the tokens of a cold engine."""
    llama = EngineConfig(
        model="builtin:tiny-llama", device="cpu", max_num_seqs=2, max_model_len=256, prefill_chunk_tokens=64
    )
    shared = [7 + i for i in range(32)]
    prompts = [shared + [500 + i for i in range(8)], shared + [900 + i for i in range(5)]]
    engines = [
        Engine.load(llama, prefix_cache=PrefixCacheConfig(fraction=f, checkpoint_interval=16))
        for f in (0.0, 0.05)
    ]
    try:
        assert not engines[1].recurrent_state
        results = []
        for eng in engines:
            plans: list[StepPlan] = []
            submit = eng.submit

            def recording(plan: StepPlan, submit: Any = submit, plans: list[StepPlan] = plans) -> Any:
                plans.append(plan)
                return submit(plan)

            eng.submit = recording  # type: ignore[method-assign]
            s = Scheduler(eng, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
            await s.start()
            try:
                _, first, _ = await s.submit(
                    GenerationRequest("a", tuple(prompts[0]), GREEDY, max_tokens=1)
                ).collect()
                chunks = sum(len(p.prefills) for p in plans)
                _, second, _ = await s.submit(
                    GenerationRequest("b", tuple(prompts[1]), GREEDY, max_tokens=4)
                ).collect()
            finally:
                await s.stop()
            results.append((first, second, chunks))
        (cold_first, cold_second, cold_chunks), (first, second, chunks) = results
        assert (first, second) == (cold_first, cold_second)
        assert chunks == cold_chunks == 1  # with the cache on too, the 40 tokens are one chunk
        assert engines[1].reused_tokens == 32 and engines[0].reused_tokens == 0
    finally:
        for eng in engines:
            eng.shutdown()


def metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not on /metrics")


def test_server_wiring_pools_evicted_checkpoints_trims_when_idle_and_sheds_at_watch(tmp_path: Path) -> None:
    """The app's pool: checkpoints the engine's small cache evicts go back to it, the idle
    scheduler trims it, WATCH sheds the cache, and /metrics shows the pool's figures."""
    mem = MemoryConfig(root=str(tmp_path))
    level_tree(tmp_path, Level.OK, config=mem)
    watch = MemWatch(mem, StaticDeviceReader())
    pool = CheckpointPool(lambda: watch.read().host.effective_total_bytes, 0.5, 64, 1, pin=False)
    engines: list[Engine] = []

    def factory() -> Engine:
        # Room for two or three of this model's checkpoints (~17 KiB of state + 16 KiB per block
        # of 32 tokens they keep), so later saves evict earlier ones and their buffers pool up.
        cache = PrefixCacheConfig(checkpoint_interval=16, max_bytes=120_000)
        engines.append(Engine.load(HYBRID, watch, prefix_cache=cache, pool=pool))
        return engines[0]

    app = create_app(
        ServerConfig(),
        SchedulerConfig(idle_tick_s=0.02),
        factory,
        memwatch=watch,
        pool=pool,
        pool_max_idle_s=0.0,
    )
    with running_server(app) as url:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "tell me a long story about a cat " * 8,
            "max_tokens": 4,
            "temperature": 0,
        }
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        cache = engines[0].prefix_cache
        assert cache is not None
        # The response can arrive before the step that releases the slot and saves its end-of-
        # generation checkpoint has run (a big save may evict every entry before it inserts), so
        # wait, bounded, for the engine thread to settle; no timing is asserted.
        for _ in range(500):
            if cache.stats().entries > 0 and cache.stats().evictions > 0:
                break
            time.sleep(0.01)
        assert cache.stats().entries > 0 and cache.stats().evictions > 0
        for _ in range(500):  # the idle hook runs every idle tick; bounded wait, no timing asserted
            if pool.stats().trimmed_bytes > 0 and pool.stats().bytes_held == 0:
                break
            time.sleep(0.01)
        assert (
            pool.stats().high_water_bytes > 0
            and pool.stats().bytes_held == 0
            and pool.stats().trimmed_bytes > 0
        )
        assert metric(url, "ballast_checkpoint_pool_trimmed_bytes_total") == pool.stats().trimmed_bytes
        assert metric(url, "ballast_checkpoint_pool_high_water_bytes") == pool.stats().high_water_bytes
        level_tree(tmp_path, Level.WATCH, config=mem)
        assert watch.poll_now().level is Level.WATCH
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert cache.stats().entries == 0 and cache.stats().sheds == 1 and pool.stats().bytes_held == 0
        assert metric(url, "ballast_checkpoint_pool_bytes") == 0


def test_reused_prompt_tokens_reach_metrics(tmp_path: Path) -> None:
    """A prompt sent twice restores its last interval checkpoint the second time; /metrics counts
    the restored tokens (and the first request restored none)."""
    mem = MemoryConfig(root=str(tmp_path))
    level_tree(tmp_path, Level.OK, config=mem)
    watch = MemWatch(mem, StaticDeviceReader())
    app = create_app(
        ServerConfig(),
        SchedulerConfig(),
        lambda: Engine.load(HYBRID, watch, prefix_cache=PrefixCacheConfig(checkpoint_interval=16)),
        memwatch=watch,
    )
    with running_server(app) as url:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "tell me a long story about a cat " * 8,
            "max_tokens": 4,
            "temperature": 0,
        }
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert metric(url, "ballast_prompt_tokens_reused_total") == 0
        second = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert metric(url, "ballast_prompt_tokens_reused_total") >= 16


def test_usage_reports_cached_prompt_tokens_through_the_openai_client(tmp_path: Path) -> None:
    """usage.prompt_tokens_details.cached_tokens (as OpenAI reports it) is the number of prompt
    tokens the scheduler restored from a checkpoint: 0 on a first turn, and on the second turn
    of a chat exactly what /metrics counts as reused, streamed or not."""
    import openai

    level_tree(tmp_path, Level.OK)
    watch = MemWatch(MemoryConfig(root=str(tmp_path)))
    app = create_app(
        ServerConfig(),
        SchedulerConfig(),
        lambda: FakeEngine(max_model_len=512, checkpoint_interval=INTERVAL),
        memwatch=watch,
    )
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hello there, how are you today?"}]
        first = client.chat.completions.create(
            model="fake-model", messages=messages, temperature=0, max_tokens=12
        )  # type: ignore[arg-type]
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "and what is the weather like?"},
        ]
        for stream in (False, True):
            before = metric(url, "ballast_prompt_tokens_reused_total")
            if stream:
                chunks = list(
                    client.chat.completions.create(
                        model="fake-model",
                        messages=messages,
                        temperature=0,
                        max_tokens=4,
                        stream=True,  # type: ignore[arg-type]
                        stream_options={"include_usage": True},
                    )
                )
                usage = chunks[-1].usage
            else:
                usage = client.chat.completions.create(
                    model="fake-model", messages=messages, temperature=0, max_tokens=4
                ).usage  # type: ignore[arg-type]
            assert usage is not None and usage.prompt_tokens_details is not None
            reused = metric(url, "ballast_prompt_tokens_reused_total") - before
            assert 0 < usage.prompt_tokens_details.cached_tokens == reused < usage.prompt_tokens
