"""Runs of the prefix cache and of parking under tensor parallel, for the CPU test (gloo) and the
GPU test (NCCL): a multi-turn chat through the real scheduler, and four sequences growing past
the KV blocks the memory layer grants. Each returns every answer's tokens and logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest, TokenEvent
from ballast.scheduler.scheduler import Scheduler
from memfixtures import limited_grants

MODEL = "builtin:tiny-qwen3-next"  # gated DeltaNet (recurrent + conv state) and attention (KV blocks)
GREEDY = SamplingParams(temperature=0.0, logprobs=0)
TURNS = [[5 + i for i in range(40)], [900 + i for i in range(13)], [3000 + i for i in range(9)]]
PROMPTS = [tuple(range(100 + 11 * i, 140 + 11 * i)) for i in range(4)]
NEW = 100

Answer = tuple[tuple[int, ...], tuple[float, ...]]


async def collect(s: Scheduler, rid: str, prompt: Sequence[int], max_tokens: int) -> Answer:
    ids: list[int] = []
    logprobs: list[float] = []
    async for event in s.submit(GenerationRequest(rid, tuple(prompt), GREEDY, max_tokens=max_tokens)):
        if isinstance(event, TokenEvent):
            ids.extend(event.token_ids)
            logprobs.extend(lp.logprob for lp in event.logprobs or ())
    return tuple(ids), tuple(logprobs)


def chat_engine(tp: int, fraction: float, device: str = "cpu") -> Engine:
    cfg = EngineConfig(
        model=MODEL,
        device=device,
        dtype="float32",
        max_num_seqs=2,
        max_model_len=256,
        prefill_chunk_tokens=64,
        tensor_parallel_size=tp,
    )
    return Engine.load(cfg, prefix_cache=PrefixCacheConfig(fraction=fraction, checkpoint_interval=16))


async def chat(engine: Engine, max_tokens: int = 8) -> list[Answer]:
    """Each turn's prompt is the previous prompt + its answer + the new user message. Between
    turns another short request runs in the same slot, so a turn that resumed from what its slot
    still held, rather than from the restored checkpoint, would go wrong."""
    s = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    await s.start()
    try:
        prompt: tuple[int, ...] = ()
        answers: list[Answer] = []
        for i, user in enumerate(TURNS):
            prompt = prompt + (answers[-1][0] if answers else ()) + tuple(user)
            answers.append(await collect(s, f"t{i}", prompt, max_tokens))
            answers.append(await collect(s, f"other{i}", [7000 + i, 11, 12, 13, 14], 3))
        return answers[::2]
    finally:
        await s.stop()


def preempt_engine(tp: int, device: str = "cpu") -> Engine:
    cfg = EngineConfig(
        model=MODEL,
        device=device,
        dtype="float32",
        max_num_seqs=4,
        max_model_len=256,
        prefill_chunk_tokens=128,
        kv_segment_bytes=1,  # small segments: growth is refused mid-generation
        tensor_parallel_size=tp,
    )
    return Engine.load(cfg, prefix_cache=PrefixCacheConfig(fraction=0.0))


async def generate(engine: Engine, limit_blocks: bool) -> list[Answer]:
    """Four sequences of 40 + NEW tokens; limit_blocks: the memory layer grants about two thirds
    of the KV blocks they need at the end, so the youngest are preempted as they grow."""
    kv = engine.runner.kv
    assert kv is not None
    if limit_blocks:
        need = 4 * -(-(40 + NEW) // kv.layout.block_size)
        kv._acquire = limited_grants(max(2, (2 * need) // (3 * kv.layout.seg_blocks)))
    s = Scheduler(engine, SchedulerConfig(max_num_seqs=4))
    await s.start()
    try:
        return list(await asyncio.gather(*(collect(s, f"r{i}", p, NEW) for i, p in enumerate(PROMPTS))))
    finally:
        await s.stop()


def assert_same(got: Sequence[Answer], want: Sequence[Answer], tol: float = 1e-4) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=tol, rtol=tol)
