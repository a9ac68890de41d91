"""Engine steps the tests drive: fresh prompts of given lengths, optionally beside a decode token,
each in a slot of its own, then released (the GPU compile tests); a CPU model runner whose slots
are prefilled, for graph-against-eager steps (the verify and MTP graph tests); a pair of engines
with graphs and without; requests served through the real scheduler with drafting on or off."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

import torch
from ballast.engine.engine import Engine
from ballast.engine.graphs.decode import PAD_POSITION
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.runner.model_runner import ModelRunner
from ballast.engine.spec.governor import DraftStats
from ballast.engine.workspace import VerifySize
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0)


def fresh_prompts_step(engine: Engine, lengths: list[int], seed: int, decode_slot: int | None = None) -> None:
    """One step: a fresh random prompt of each length in slots 0.. (with decode_slot, that slot's
    3-token prompt first, then its one decode token beside them); then every slot is released."""
    gen = torch.Generator().manual_seed(seed)
    prefills = tuple(
        PrefillChunk(s, tuple(torch.randint(5, 500, (n,), generator=gen).tolist()), 0, True)
        for s, n in enumerate(lengths)
    )
    decodes: tuple[DecodeToken, ...] = ()
    if decode_slot is not None:
        engine.step(
            StepPlan(
                prefills=(PrefillChunk(decode_slot, (7, 8, 9), 0, True),), sampling={decode_slot: GREEDY}
            )
        )
        decodes = (DecodeToken(decode_slot, 11, 3),)
    slots = [*range(len(lengths)), *([decode_slot] if decode_slot is not None else [])]
    engine.step(StepPlan(prefills=prefills, decodes=decodes, sampling=dict.fromkeys(slots, GREEDY)))
    engine.step(StepPlan(release=tuple(slots)))


def prefilled_runner(
    model: torch.nn.Module, prompts: dict[int, list[int]], slots: int, ctx: int, size: VerifySize
) -> ModelRunner:
    """A float32 CPU runner of `slots` slots (and the scratch slot graphs pad into), each prompt
    prefilled in its slot with room for a verify row of `size.drafts` drafts after it."""
    r = ModelRunner(
        model, torch.device("cpu"), torch.float32, slots, ctx, False, 0, scratch_slot=True, verify=size
    )
    assert r.kv is not None and r._scratch_block(PAD_POSITION + size.drafts + 1)
    for s, p in prompts.items():
        assert r.kv.ensure(s, len(p) + size.drafts + 1)
    r.forward([(s, p, 0) for s, p in prompts.items()])
    return r


def graphs_and_eager(load: Callable[[bool], Engine]) -> Iterator[tuple[Engine, Engine]]:
    """A module fixture's body: `load(True)` (CUDA graphs on) and `load(False)`, shut down after."""
    with_graphs, eager = load(True), load(False)
    yield with_graphs, eager
    with_graphs.shutdown()
    eager.shutdown()


def serve_drafting(
    engine: Engine, reqs: Sequence[GenerationRequest], spec: str | None, tried: bool = False
) -> tuple[list[tuple[int, ...]], DraftStats]:
    """The requests' tokens through a real scheduler of 4 slots (`spec`: its speculative config),
    and its draft counts; `tried`: the governor starts as one that has seen every draft kept, so
    each new sequence drafts until its own checks say otherwise (random weights draft poorly)."""

    async def go() -> tuple[list[tuple[int, ...]], DraftStats]:
        s = Scheduler(engine, SchedulerConfig(max_num_seqs=4, speculative_config=spec))
        drafts = s._planner.drafts
        if tried and drafts.config is not None:
            drafts.acceptance = [1.0] * drafts.config.num_speculative_tokens
        await s.start()
        try:
            out = await asyncio.gather(*(s.submit(r).collect() for r in reqs))
        finally:
            await s.stop()
        return [o[1] for o in out], s._planner.drafts.stats

    return asyncio.run(go())
