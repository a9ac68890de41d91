"""On CUDA: prefix reuse through checkpoints restores the same state as a cold prefill (bf16
hybrid model, KV and recurrent state copied device -> pooled pinned host buffer -> device).
Skips cleanly without CUDA."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import GiB

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_prefix_cache import INTERVAL, MAX_LEN, chat  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(params=["builtin:tiny-qwen3-next", "builtin:tiny-llama"])
def cuda_engine(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, CheckpointPool]]:
    cfg = EngineConfig(
        model=request.param,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=2,
        max_model_len=MAX_LEN,
        prefill_chunk_tokens=64,
    )
    # Floor 0: the tiny models' checkpoints (tens of KiB) are below the default 1 MiB floor, under
    # which the pool (rightly) allocates fresh; this test wants them to go through the pool.
    pool = CheckpointPool(lambda: 64 * GiB, 0.25, 64, 0)
    eng = Engine.load(cfg, prefix_cache=PrefixCacheConfig(checkpoint_interval=INTERVAL), pool=pool)
    yield eng, pool
    eng.shutdown()


def test_cuda_reuse_matches_cold_and_uses_pinned_buffers(cuda_engine: tuple[Engine, CheckpointPool]) -> None:
    engine, pool = cuda_engine
    cache = engine.prefix_cache
    assert cache is not None
    cache.shed()
    cold, cold_prefilled, _ = chat(engine, 3, reuse=False)
    cache.shed()
    warm, warm_prefilled, warm_reused = chat(engine, 3, reuse=True)
    assert warm == cold
    assert warm_reused > 0 and warm_prefilled + warm_reused == cold_prefilled
    entries = list(cache._entries.values())
    assert entries and all(e.blocks for e in entries)  # KV stays on the GPU, shared by reference
    if engine.runner.fixed_bytes > engine.runner.sampler.state_bytes:  # a hybrid: recurrent states are copied
        assert all(e.buf is not None and e.buf.is_pinned() for e in entries)  # into pinned host memory
        stats = pool.stats()
        # The cold run's buffers went back to the pool at shed() and the warm run took them again.
        assert stats.misses > 0 and stats.hits > 0 and stats.declines == 0
    else:  # attention only: nothing to copy, the pool is never asked
        assert all(e.buf is None for e in entries) and pool.stats().misses == 0
