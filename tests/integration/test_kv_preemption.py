"""Preemption through the real scheduler and engine on the CPU: when the memory layer stops
granting KV segments while sequences grow, the engine preempts the youngest and the scheduler
resumes it once blocks are free; every request completes with the tokens of a run that was never
short. Both ways back are exercised: recompute (what the CPU does: its blocks already are host
memory) and parking in host buffers (what the GPU does; forced here, as the CPU stands in for it).
tests/gpu/test_kv_preemption_cuda.py runs the GPU's own choice on CUDA."""

from __future__ import annotations

import asyncio

import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.engine.runner.slot_kv import SlotKV
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler
from memfixtures import limited_grants

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [tuple(range(100 + 11 * i, 140 + 11 * i)) for i in range(4)]
NEW = 120


def config(model: str) -> EngineConfig:
    # 64 KiB segments of this model's 16 KiB blocks: growth is refused mid-generation.
    return EngineConfig(
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_model_len=512,
        prefill_chunk_tokens=128,
        kv_segment_bytes=64 << 10,
    )


async def generate(engine: Engine) -> list[tuple[int, ...]]:
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=4))
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
    assert all(fin.reason == "length" for _, _, fin in done)
    return [tokens for _, tokens, _ in done]


@pytest.fixture(scope="module")
def calm() -> list[tuple[int, ...]]:
    engine = Engine.load(config("builtin:tiny-llama"))
    try:
        return asyncio.run(generate(engine))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("park", [False, True], ids=["recompute", "park"])
async def test_preempted_sequences_resume_with_the_same_tokens(
    calm: list[tuple[int, ...]], park: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if park:

        def park_always(self: SlotKV, slot: int) -> None:  # the GPU's choice, without its device check
            fed, pool = self._fed.get(slot), self.pool_of(slot)
            if fed and self._cache.parked.park(slot, fed, pool):
                self.parked += 1

        monkeypatch.setattr(SlotKV, "_park", park_always)
    engine = Engine.load(config("builtin:tiny-llama"))
    try:
        kv = engine.runner.kv
        assert kv is not None
        need = 4 * -(-(40 + NEW) // kv.layout.block_size)  # blocks all four need at the end
        kv._acquire = limited_grants((2 * need) // (3 * (kv.layout.seg_blocks - 1)))  # about two thirds of it
        got = await generate(engine)
        assert engine.slot_kv.preemptions > 0
        assert engine.slot_kv.parked == (engine.slot_kv.preemptions if park else 0)
        assert got == calm
        assert engine._cache.stats().parked == 0  # every parked sequence came back
    finally:
        engine.shutdown()
