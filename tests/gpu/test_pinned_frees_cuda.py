"""A pinned checkpoint buffer dropped while the device works costs the engine thread no wait: one
whose copy is still queued is freed only once that copy has run (the pool's pending-free list,
drained between steps), and unregistering it (cudaHostUnregister, which waits on the device) runs
on the pool's unpinner thread. A long kernel queued first keeps the device busy, so a call that
returns while that kernel still runs did not wait for it. Skips without CUDA."""

from __future__ import annotations

import weakref

import pytest
import torch
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.kv.checkpoint_buffers import checkpoint_bytes
from ballast.engine.plan import PrefillChunk, SamplingParams, StepPlan
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import GiB, MiB

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0)
BUSY_CYCLES = 2_000_000_000  # ~1 s of one SM spinning: far longer than any copy or call here


def test_a_checkpoint_buffer_dropped_behind_a_slow_copy_costs_the_engine_thread_no_wait() -> None:
    cfg = EngineConfig(
        model="builtin:tiny-qwen3-next",
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=2,
        max_model_len=256,
        prefill_chunk_tokens=64,
    )
    pool = CheckpointPool(lambda: 64 * GiB, 0.25, 64, 0)
    eng = Engine.load(cfg, prefix_cache=PrefixCacheConfig(checkpoint_interval=512), pool=pool)
    try:
        cache = eng.prefix_cache
        assert cache is not None and pool.pinned
        prompt = tuple(range(10, 50))
        eng.step(StepPlan(prefills=(PrefillChunk(0, prompt, 0, True),), sampling={0: GREEDY}))
        # Only the save's buffer in the pool, pinned while the device is idle (the buffers
        # prewarmed at load are unpinned here, before the test makes the device busy).
        pool.trim(0)
        pool.free_copied(wait=True)
        nbytes = checkpoint_bytes(eng.runner.states)
        assert pool.reserve(nbytes, 1) == 1
        torch.cuda.synchronize()

        torch.cuda._sleep(BUSY_CYCLES)  # the step's stream is busy for about a second
        assert cache.save(0, prompt)  # its copy to the pinned buffer is queued behind the kernel
        entry = next(iter(cache._entries.values()))
        assert entry.buf is not None and entry.buf.numel() == nbytes  # the buffer reserved above
        done, buf = entry.done, weakref.ref(entry.buf)
        del entry
        assert done is not None and not done.query()
        # The ladder's WATCH rung: the prefix cache is shed and the pool trimmed to nothing.
        eng.step(StepPlan(shed_prefix_cache=True))
        assert not done.query()  # the drop returned while the copy is still queued
        s = pool.stats()
        assert s.buffers == 0 and s.pending_free_bytes == nbytes and s.bytes_held == nbytes
        assert buf() is not None  # still held: its copy has not run

        torch.cuda.synchronize()
        eng.step(StepPlan(release=(0,)))  # the next step: its copy has run, so it is freed now
        assert buf() is None
        pool.unpinner.wait()
        s = pool.stats()
        assert (s.bytes_held, s.pending_free_bytes) == (0, 0)
    finally:
        eng.shutdown()
    assert torch.ones(4, device="cuda").sum().item() == 4  # CUDA still sound


def test_trimming_pinned_buffers_while_the_device_is_busy_does_not_wait_for_it() -> None:
    """The WATCH shed's trim(0) unpins idle buffers (no copy on them) while a step runs: trim
    returns at once, the bytes stay counted until the unpinner's thread has unregistered them,
    and then nothing is held. (Measured on an H200: a kernel another thread launches while that
    unregister runs waits for the device too, as the driver serializes the calls; the engine
    thread's next launch can therefore wait for the work in flight once. docs/RELIABILITY.md.)"""
    pool = CheckpointPool(lambda: 64 * GiB, 0.25, 8, MiB)
    assert pool.reserve(256 * MiB, 2) == 2
    x = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    busy = torch.cuda.Event()
    busy.record()
    assert pool.trim(0) == 512 * MiB
    assert not busy.query()  # trim returned with the device still busy
    assert pool.stats().bytes_held == 512 * MiB  # counted until really unpinned
    x.add_(1)
    busy.synchronize()
    pool.unpinner.wait()
    assert pool.stats().bytes_held == 0 and pool.stats().pending_free_bytes == 0
    assert x.sum().item() == 4
