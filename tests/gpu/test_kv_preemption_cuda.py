"""On CUDA, through the real scheduler: when the memory layer stops granting KV segments while
sequences grow, the engine preempts the youngest, parks its blocks (and recurrent state) in pinned
host memory, and resumes it when blocks are free: every request completes with the tokens of a
run that was never short of memory. Skips cleanly without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler
from fake_engine import FakeTokenizer
from memfixtures import limited_grants

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [tuple(range(100 + 11 * i, 140 + 11 * i)) for i in range(4)]
NEW = 120


def config(model: str) -> EngineConfig:
    # 64 KiB segments: a handful of blocks each, so growth is refused mid-generation.
    return EngineConfig(
        model=model,
        device="cuda",
        dtype="float32",
        max_num_seqs=4,
        max_model_len=512,
        prefill_chunk_tokens=128,
        kv_segment_bytes=64 << 10,
    )


class NoText:
    """A detokenizer that emits no text: this test compares token ids."""

    stopped = False

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class NoTextEngine:
    """The engine as the scheduler sees it, with the tests' toy tokenizer: the builtin models'
    real tokenizer is the default model's, which a machine without network cannot fetch."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.tokenizer = FakeTokenizer()

    def new_detokenizer(self, prompt_ids: object, stop: tuple[str, ...] = ()) -> NoText:
        return NoText()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


async def generate(engine: Engine) -> list[tuple[tuple[int, ...], str]]:
    sched = Scheduler(NoTextEngine(engine), SchedulerConfig(max_num_seqs=4))  # type: ignore[arg-type]
    await sched.start()
    try:
        done = await asyncio.gather(
            *(
                sched.submit(GenerationRequest(f"r{i}", p, GREEDY, max_tokens=NEW)).collect()
                for i, p in enumerate(PROMPTS)
            )
        )
    finally:
        await sched.stop()
    return [(tokens, fin.reason) for _, tokens, fin in done]


@pytest.mark.parametrize("model", ["builtin:tiny-llama", "builtin:tiny-qwen3-next"])
async def test_preempted_sequences_park_and_resume_with_the_same_tokens(model: str) -> None:
    calm_engine = Engine.load(config(model))
    try:
        want = await generate(calm_engine)
    finally:
        calm_engine.shutdown()
    engine = Engine.load(config(model))
    try:
        kv = engine.runner.kv
        assert kv is not None
        need = 4 * -(-(40 + NEW) // kv.layout.block_size)  # blocks all four need at the end
        # Grants for about two thirds of that (the graphs' scratch slot holds one block already).
        kv._acquire = limited_grants(max(2, (2 * need) // (3 * (kv.layout.seg_blocks - 1))))
        got = await generate(engine)
        assert sum(len(t) for t, _ in got) > 200  # long enough to need more blocks than granted
        slot_kv = engine.slot_kv
        assert slot_kv.preemptions > 0 and slot_kv.parked == slot_kv.preemptions  # parked, not recomputed
        assert got == want
        stats = engine._cache.stats()
        assert stats.parked == 0  # every parked sequence came back
    finally:
        engine.shutdown()


async def test_a_step_that_fails_after_parking_a_sequence_leaves_nothing_parked() -> None:
    """A step preempts (parks) a sequence, then its forward raises an out-of-memory error: the
    engine recovers and drops the parked copy (pinned host memory nobody would resume) with the
    step's sequences; the scheduler puts those requests back (a failure for want of memory costs
    no request), so every one completes with its calm-run tokens and nothing stays parked."""
    engine = Engine.load(config("builtin:tiny-llama"))
    try:
        kv = engine.runner.kv
        assert kv is not None
        need = 4 * -(-(40 + NEW) // kv.layout.block_size)
        kv._acquire = limited_grants(max(2, (2 * need) // (3 * (kv.layout.seg_blocks - 1))))
        forward = engine.runner.forward
        failed = []

        def fail_once_after_a_park(seqs, all_logits=()):  # type: ignore[no-untyped-def]
            if not failed and engine.slot_kv._parked_in_step:
                failed.append(True)
                raise torch.cuda.OutOfMemoryError("injected after a park")
            return forward(seqs, all_logits)

        engine.runner.forward = fail_once_after_a_park  # type: ignore[method-assign]
        sched = Scheduler(NoTextEngine(engine), SchedulerConfig(max_num_seqs=4))  # type: ignore[arg-type]
        await sched.start()
        try:
            done = await asyncio.gather(
                *(
                    sched.submit(GenerationRequest(f"r{i}", p, GREEDY, max_tokens=NEW)).collect()
                    for i, p in enumerate(PROMPTS)
                )
            )
        finally:
            await sched.stop()
        assert failed and engine.healthy and sched.step_failures == 1
        reasons = [fin.reason for _, _, fin in done]
        assert all(r in ("length", "stop") for r in reasons), reasons
        assert engine._cache.stats().parked == 0
    finally:
        engine.shutdown()
