"""Prefix checkpoints and parking under tensor parallel on two GPUs (NCCL): every rank copies its
shard of a slot's state (and of a parked sequence's KV blocks) to pinned host memory and back,
on its own stream. A chat's later turns restore checkpoints with the tokens of one GPU; sequences
preempted for want of KV blocks are parked (not recomputed: the GPU's own choice) and resume with
the tokens of a calm run. float32, so tokens compare exactly.

Run with NVLink SHARP off: NCCL_NVLS_ENABLE=0 pytest tests/gpu/test_tensor_parallel_cache_cuda.py"""

from __future__ import annotations

import pytest
import torch
from tp_cache_runs import assert_same, chat, chat_engine, generate, preempt_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


async def test_a_chat_on_two_gpus_restores_its_turns_with_the_tokens_of_one() -> None:
    results = {}
    for tp in (1, 2):
        engine = chat_engine(tp, 0.05, "cuda")
        try:
            results[tp] = (await chat(engine), engine.prefilled_tokens, engine.reused_tokens)
            assert engine.healthy
        finally:
            engine.shutdown()
    (one, one_prefilled, one_reused), (two, two_prefilled, two_reused) = results[1], results[2]
    assert_same(two, one, tol=1e-3)
    assert two_reused == one_reused > 0 and two_prefilled == one_prefilled


async def test_sequences_preempted_on_two_gpus_park_and_resume_with_the_calm_tokens() -> None:
    calm_engine = preempt_engine(1, "cuda")
    try:
        calm = await generate(calm_engine, limit_blocks=False)
    finally:
        calm_engine.shutdown()
    engine = preempt_engine(2, "cuda")
    try:
        got = await generate(engine, limit_blocks=True)
        assert engine.healthy
        slot_kv = engine.slot_kv
        assert slot_kv.preemptions > 0 and slot_kv.parked == slot_kv.preemptions  # parked, not recomputed
        assert engine._cache.stats().parked == 0
    finally:
        engine.shutdown()
    assert_same(got, calm, tol=1e-3)
