"""A long prompt arriving while a stream decodes, through the real scheduler and engine on the CPU
(the hybrid tiny Qwen3-Next): with an ITL target, the prompt is split into small chunks sized from
the measured step times while the stream gets a token every step; without one, each step beside the
stream carries the engine's whole busy chunk. The tokens are the same either way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams, StepPlan, StepResult
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0)
STREAM = tuple(range(40, 72))
LONG = tuple(3 + (7 * i) % 250 for i in range(1500))
BUSY_CHUNK = 512


def recording(engine: Engine) -> list[StepPlan]:
    """The plans the scheduler sends, recorded on their way into the real engine."""
    plans: list[StepPlan] = []
    submit: Callable[[StepPlan], Future[StepResult]] = engine.submit

    def record(plan: StepPlan) -> Future[StepResult]:
        plans.append(plan)
        return submit(plan)

    engine.submit = record  # type: ignore[method-assign]
    return plans


async def run(max_itl_ms: float) -> tuple[list[StepPlan], list[tuple[int, ...]], Scheduler]:
    engine = Engine.load(
        EngineConfig(
            model="builtin:tiny-qwen3-next", device="cpu", max_num_seqs=2, max_model_len=2048,
            prefill_chunk_tokens=BUSY_CHUNK,
        )
    )  # fmt: skip
    plans = recording(engine)
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_itl_ms=max_itl_ms))
    await sched.start()
    try:
        stream = sched.submit(GenerationRequest("stream", STREAM, GREEDY, max_tokens=120))
        while sum(1 for p in plans if p.decodes and not p.prefills) < 4:  # decode-only steps measured
            await asyncio.sleep(0.001)
        long = sched.submit(GenerationRequest("long", LONG, GREEDY, max_tokens=4))
        done = await asyncio.gather(stream.collect(), long.collect())
    finally:
        await sched.stop()
        engine.shutdown()
    return plans, [tokens for _, tokens, _ in done], sched


def long_chunks_beside_the_stream(plans: list[StepPlan]) -> list[int]:
    out = []
    for p in plans:
        chunks = [len(c.token_ids) for c in p.prefills if c.start_pos + len(c.token_ids) <= len(LONG)]
        if chunks and p.decodes:
            out.append(sum(chunks))
    return out


@pytest.fixture(scope="module")
def unlimited() -> tuple[list[StepPlan], list[tuple[int, ...]], Scheduler]:
    return asyncio.run(run(0.0))


def test_without_a_target_each_step_beside_the_stream_takes_the_busy_chunk(unlimited) -> None:
    """The busy chunk less the stream's decode row (cut where the recurrent checkpoints fall)."""
    plans, _, _ = unlimited
    beside = long_chunks_beside_the_stream(plans)
    assert max(beside) == BUSY_CHUNK - 1 and len(beside) <= 5


async def test_with_a_target_the_prompt_is_split_while_the_stream_decodes_every_step(unlimited) -> None:
    """A target below a decode step's own time: each step beside the stream carries the floor, 64
    tokens, the first too (the stream's own prompt measured what a prompt token costs, and its
    decode steps the base); every one of those steps also carries the stream's decode, and the
    tokens match the unlimited run."""
    plans, tokens, sched = await run(0.001)
    beside = long_chunks_beside_the_stream(plans)
    costs, floor = sched.step_costs, sched.prompt_budget.floor
    assert costs.decode_s(1) is not None and costs.prefill_token_s > 0
    assert max(beside) == floor and beside.count(floor) >= len(LONG) // floor - 1
    prompt_steps = [
        p for p in plans if any(c.start_pos < len(LONG) and len(c.token_ids) > 0 for c in p.prefills)
    ]
    stream_slot = plans[0].prefills[0].slot
    assert all(stream_slot in {d.slot for d in p.decodes} for p in prompt_steps[1:])
    assert tokens == unlimited[1]
