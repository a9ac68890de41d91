"""On CUDA: the step workspace is leased at load, and the sampler's widest path stays inside its
bound (issue 31, item 4). Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.engine.step.sampler import Sampler
from ballast.engine.workspace import SAMPLER_BYTES_PER_LOGIT, step_workspace
from ballast.memory.config import MemoryConfig
from ballast.memory.watch import MemWatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_sampler_peak_stays_inside_its_bound() -> None:
    rows, vocab = 64, 151_936  # a Qwen-sized vocabulary
    device = torch.device("cuda")
    sampler = Sampler(rows, vocab, device, seed=1)
    logits = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16)
    widest = [  # top-p with seeded rows, penalties and logprobs: every temporary at once
        SamplingParams(top_p=0.9, top_k=50, seed=i if i % 2 else None, repetition_penalty=1.1, logprobs=5)
        for i in range(rows)
    ]
    sampler.sample(logits, list(range(rows)), widest)  # first call: one-time buffers
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sampler.sample(logits, list(range(rows)), widest)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = rows * vocab * SAMPLER_BYTES_PER_LOGIT
    print(f"sampler peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB")
    assert 0 < peak <= bound


def test_the_workspace_is_leased_at_load() -> None:
    watch = MemWatch(MemoryConfig())
    watch.poll_now()
    engine = Engine.load(EngineConfig(model="builtin:tiny-llama", device="cuda", max_num_seqs=8), watch)
    try:
        die = engine.gpu_die
        assert die is not None
        leases = dict(watch.ledger.leases(die))
        ws = step_workspace(8, engine.runner.sampler.vocab_size, engine.dtype.itemsize)
        assert leases["sampler-workspace"] == ws.sampler_bytes
        assert leases["prompt-logprobs"] == ws.prompt_logprobs_bytes
    finally:
        engine.shutdown()


def test_the_first_full_batch_after_start_up_allocates_nothing() -> None:
    """Start-up's warm-up draws one full batch on the sampler's widest path, so the workspace it
    leases is held from the start: the first full batch a server samples takes no new segment."""
    watch = MemWatch(MemoryConfig())
    watch.poll_now()
    engine = Engine.load(EngineConfig(model="builtin:tiny-llama", device="cuda", max_num_seqs=64), watch)
    try:
        sampler = engine.runner.sampler
        rows = list(range(sampler.num_slots))
        logits = torch.randn(len(rows), sampler.vocab_size, device="cuda")  # float32, as heads give
        widest = [
            SamplingParams(top_p=0.9, top_k=50, seed=i if i % 2 else None, repetition_penalty=1.1, logprobs=5)
            for i in rows
        ]
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        sampler.sample(logits, rows, widest)
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() == before
    finally:
        engine.shutdown()
