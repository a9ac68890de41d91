"""On CUDA a checkpoint save and restore never wait on the host: the save's copies run on a side
stream behind the forward that produced the state, a later write to the slot waits for them on
the device, and a restore reads the buffer after them. A long kernel queued first keeps the device
busy, so a call that returns while that kernel still runs did not synchronise. Skips without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.kv.checkpoint_buffers import checkpoint_bytes
from ballast.engine.kv.state_copies import StateCopies
from ballast.engine.plan import PrefillChunk, SamplingParams, StepPlan
from ballast.memory.config import MemoryConfig
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import GiB
from ballast.memory.watch import MemWatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0)
BUSY_CYCLES = 2_000_000_000  # ~1 s of one SM spinning: far longer than any copy here


def load(max_num_seqs: int, prefill_chunk_tokens: int, watch: MemWatch | None = None) -> Engine:
    cfg = EngineConfig(
        model="builtin:tiny-qwen3-next",
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        prefill_chunk_tokens=prefill_chunk_tokens,
    )
    pool = CheckpointPool(lambda: 64 * GiB, 0.25, 64, 0)
    return Engine.load(cfg, watch, prefix_cache=PrefixCacheConfig(checkpoint_interval=512), pool=pool)


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = load(max_num_seqs=2, prefill_chunk_tokens=64)
    yield eng
    eng.shutdown()


def states(eng: Engine, slot: int) -> list[torch.Tensor]:
    return [v.clone() for s in eng.runner.states for v in s.slot_views(slot)]


@pytest.mark.parametrize("staged", [True, False])
def test_save_and_restore_return_before_the_device_is_done(engine: Engine, staged: bool) -> None:
    cache = engine.prefix_cache
    assert cache is not None
    if not staged:  # no staging room: the side stream reads the slot itself
        cache._copies = StateCopies(engine.device, staging_bytes=0)
    prompt = tuple(range(10, 50))
    engine.step(StepPlan(prefills=(PrefillChunk(0, prompt, 0, True),), sampling={0: GREEDY}))
    torch.cuda.synchronize()
    saved = states(engine, 0)
    torch.cuda._sleep(BUSY_CYCLES)  # the step's stream is busy for about a second
    assert cache.save(0, prompt)
    entry = next(iter(cache._entries.values()))
    assert entry.done is not None and not entry.done.query()  # returned; the copy is still queued
    assert cache._copies.pending_slots() == (frozenset() if staged else frozenset({0}))
    # The next step writes slot 0 (a fresh sequence): it must wait for the copy on the device.
    cache.before_writes([0])
    engine.runner.reset([0])
    engine.slot_kv.start([1], [False])  # as the engine does before a restore
    assert cache.restore(1, prompt) == len(prompt)  # restore into slot 1 returns without a sync too
    assert not entry.done.query()
    torch.cuda.synchronize()
    for got, want in zip(states(engine, 1), saved, strict=True):
        assert torch.equal(got, want)  # the checkpoint holds the state before slot 0 was reset
    assert all(not v.any() for v in states(engine, 0))
    engine.step(StepPlan(release=(0, 1)))


def test_a_burst_of_saves_is_staged_in_memory_leased_from_the_ledger() -> None:
    """A step that ends several prompts saves each. The engine leased staging for that many
    checkpoints at load (tag checkpoint-staging, one per sequence up to 8), so no saved slot is
    left for the side stream to read from (the next step waits on no transfer to the host), and
    shutdown gives the lease back."""
    with MemWatch(MemoryConfig()) as watch:
        eng = load(max_num_seqs=4, prefill_chunk_tokens=256, watch=watch)
        die = torch.cuda.current_device()
        try:
            cache = eng.prefix_cache
            assert cache is not None
            one = checkpoint_bytes(eng.runner.states)
            assert one > 0
            assert [n for tag, n in watch.ledger.leases(die) if tag == "checkpoint-staging"] == [4 * one]
            prompts = {s: tuple(range(10 + s, 50 + s)) for s in range(4)}
            prefills = tuple(PrefillChunk(s, p, 0, True) for s, p in prompts.items())
            eng.step(StepPlan(prefills=prefills, sampling=dict.fromkeys(prompts, GREEDY)))
            torch.cuda._sleep(BUSY_CYCLES)  # the copies stay queued while the test looks
            for slot, prompt in prompts.items():
                assert cache.save(slot, prompt)
            assert cache._copies.pending_slots() == frozenset()  # all four staged
            torch.cuda.synchronize()
            eng.step(StepPlan(release=tuple(prompts)))
        finally:
            eng.shutdown()
        assert not any(tag == "checkpoint-staging" for tag, _ in watch.ledger.leases(die))
