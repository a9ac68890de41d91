"""Prefix checkpoints and parked sequences under tensor parallel, on the CPU (gloo), through the
real scheduler and engine: every rank saves, restores, parks and resumes its own shard of each
slot state (recurrent + conv state, and a parked sequence's KV blocks), driven by rank 0's cache.
A multi-turn chat on two ranks restores the previous turns (it prefills less) and gives the
tokens and logprobs of one device; sequences preempted for want of KV blocks are parked and
resume with the tokens of a calm run. tests/gpu/test_tensor_parallel_cache_cuda.py runs both on
two GPUs."""

from __future__ import annotations

import pytest
from ballast.engine.runner.slot_kv import SlotKV
from tp_cache_runs import assert_same, chat, chat_engine, generate, preempt_engine


async def test_a_chat_on_two_ranks_restores_its_turns_with_the_tokens_of_one() -> None:
    results = {}
    for tp, fraction in ((1, 0.0), (1, 0.05), (2, 0.05)):
        engine = chat_engine(tp, fraction)
        try:
            assert (engine.prefix_cache is not None) == (fraction > 0)
            answers = await chat(engine)
            results[tp, fraction] = (answers, engine.prefilled_tokens, engine.reused_tokens)
            assert engine.healthy
        finally:
            engine.shutdown()
    cold, cold_prefilled, _ = results[1, 0.0]
    one, one_prefilled, one_reused = results[1, 0.05]
    two, two_prefilled, two_reused = results[2, 0.05]
    assert_same(two, one)
    assert_same(two, cold)
    # The same restores on both: the later turns prefill only their new part.
    assert two_reused == one_reused > 0
    assert two_prefilled == one_prefilled < cold_prefilled * 2 / 3
    assert two_prefilled + two_reused == cold_prefilled


async def test_sequences_preempted_on_two_ranks_park_and_resume_with_the_calm_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calm_engine = preempt_engine(1)
    try:
        calm = await generate(calm_engine, limit_blocks=False)
        assert calm_engine.slot_kv.preemptions == 0
    finally:
        calm_engine.shutdown()

    def park_always(self: SlotKV, slot: int) -> None:  # the GPU's choice, without its device check
        fed, pool = self._fed.get(slot), self.pool_of(slot)
        if fed and self._cache.parked.park(slot, fed, pool):
            self.parked += 1

    monkeypatch.setattr(SlotKV, "_park", park_always)  # rank 0 decides; the workers follow its journal
    engine = preempt_engine(2)
    try:
        got = await generate(engine, limit_blocks=True)
        assert engine.healthy
        assert engine.slot_kv.preemptions > 0 and engine.slot_kv.parked == engine.slot_kv.preemptions
        assert engine._cache.stats().parked == 0  # every parked sequence came back
    finally:
        engine.shutdown()
    assert_same(got, calm)
