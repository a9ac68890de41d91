"""The engine's prefix cache on the built-in tiny models (random init, CPU, float32): a multi-turn
chat whose later turns restore checkpoints gives the same greedy tokens as cold runs and prefills
fewer tokens (engine counters); LRU eviction under a small byte budget; shed empties the cache and
returns its buffers to the pool; malformed checkpoint orders are plan errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ballast.engine.config import MIN_INTERVAL, EngineConfig, PrefixCacheConfig, auto_interval
from ballast.engine.engine import Engine
from ballast.engine.plan import (
    CheckpointRestore,
    CheckpointSave,
    DecodeToken,
    PlanError,
    PrefillChunk,
    SamplingParams,
    StepFailed,
    StepPlan,
)
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import MiB

GREEDY = SamplingParams(temperature=0.0)
INTERVAL = 16
MAX_LEN = 160


def load(model: str, kv_quant: str = "none", pool: CheckpointPool | None = None, **cache: object) -> Engine:
    cfg = EngineConfig(
        model=model,
        device="cpu",
        max_num_seqs=2,
        max_model_len=MAX_LEN,
        prefill_chunk_tokens=64,
        kv_quant=kv_quant,
    )
    prefix = PrefixCacheConfig(**{"checkpoint_interval": INTERVAL, **cache})  # type: ignore[arg-type]
    return Engine.load(cfg, prefix_cache=prefix, pool=pool)


def llama_in_small_segments(prefill_chunk_tokens: int) -> Engine:
    """tiny-llama with the prefix cache on and KV segments of 8 blocks: the pool fills quickly."""
    probe = load("builtin:tiny-llama")
    block_bytes = probe.kv_figures().block_bytes  # type: ignore[union-attr]
    probe.shutdown()
    cfg = EngineConfig(
        model="builtin:tiny-llama",
        device="cpu",
        max_num_seqs=2,
        max_model_len=MAX_LEN,
        prefill_chunk_tokens=prefill_chunk_tokens,
        kv_segment_bytes=8 * block_bytes,
    )
    return Engine.load(cfg, prefix_cache=PrefixCacheConfig(checkpoint_interval=INTERVAL))


@pytest.fixture(scope="module")
def hybrid() -> Iterator[Engine]:
    eng = load("builtin:tiny-qwen3-next")
    yield eng
    eng.shutdown()


def ids(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def run_request(
    eng: Engine, slot: int, prompt: tuple[int, ...], new_tokens: int, *, reuse: bool = True
) -> list[int]:
    """One greedy request the way the scheduler runs it: restore the longest checkpoint, prefill
    the rest in chunks ending at checkpoint positions (saving there and at the prompt's end),
    decode, then save prompt + output[:-1] in the plan that releases the slot."""
    start = eng.match_prefix(prompt) if reuse else 0
    restores = (CheckpointRestore(slot, prompt[:start]),) if start else ()
    out: list[int] = []
    while start < len(prompt):
        end = min(len(prompt), (start // INTERVAL + 1) * INTERVAL)
        last = end == len(prompt)
        chunk = PrefillChunk(slot, prompt[start:end], start, last)
        res = eng.step(
            StepPlan(
                prefills=(chunk,),
                sampling={slot: GREEDY},
                restores=restores,
                saves=(CheckpointSave(slot, prompt[:end]),),
            )
        )
        restores = ()
        out += [o.token_id for o in res.outputs]
        start = end
    for _ in range(new_tokens - 1):
        res = eng.step(
            StepPlan(
                decodes=(DecodeToken(slot, out[-1], len(prompt) + len(out) - 1),), sampling={slot: GREEDY}
            )
        )
        out.append(res.outputs[0].token_id)
    eng.step(StepPlan(release=(slot,), saves=(CheckpointSave(slot, prompt + tuple(out[:-1])),)))
    return out


def chat(eng: Engine, turns: int, *, reuse: bool) -> tuple[list[list[int]], int, int]:
    """A multi-turn chat: each turn's prompt is the previous prompt + its answer + a new user
    message. Returns the answers and the prompt tokens prefilled and reused."""
    prefilled, reused = eng.prefilled_tokens, eng.reused_tokens
    prompt: tuple[int, ...] = ()
    answers: list[list[int]] = []
    for turn in range(turns):
        prompt = prompt + (tuple(answers[-1]) if answers else ()) + ids(100 + turn, 21 + 3 * turn)
        answers.append(run_request(eng, turn % 2, prompt, 6, reuse=reuse))
    return answers, eng.prefilled_tokens - prefilled, eng.reused_tokens - reused


def test_multi_turn_reuse_matches_cold_and_prefills_less(hybrid: Engine) -> None:
    assert hybrid.prefix_cache is not None
    hybrid.prefix_cache.shed()
    cold, cold_prefilled, cold_reused = chat(hybrid, 3, reuse=False)
    hybrid.prefix_cache.shed()
    warm, warm_prefilled, warm_reused = chat(hybrid, 3, reuse=True)
    assert warm == cold
    assert cold_reused == 0
    # Turns 2 and 3 restore the previous turn's end-of-generation checkpoint: everything but the
    # new user message (and the last answer token, never fed) is restored, not prefilled.
    assert warm_reused > 0
    assert warm_prefilled + warm_reused == cold_prefilled
    assert hybrid.prefix_cache.stats().restores >= 2


def test_restored_state_equals_prefilled_state(hybrid: Engine) -> None:
    """The slot's recurrent and KV state after restore + the rest equals a cold prefill's."""
    assert hybrid.prefix_cache is not None
    hybrid.prefix_cache.shed()
    base = ids(7, 40)
    run_request(hybrid, 0, base, 2)
    longer = base + ids(8, 9)
    assert hybrid.match_prefix(longer) == len(base)  # the end-of-prompt checkpoint
    warm = run_request(hybrid, 1, longer, 4)
    hybrid.prefix_cache.shed()
    assert run_request(hybrid, 0, longer, 4, reuse=False) == warm


def test_llama_family_reuses_kv_only() -> None:
    eng = load("builtin:tiny-llama")
    try:
        cold, cold_prefilled, _ = chat(eng, 2, reuse=False)
        assert eng.prefix_cache is not None
        eng.prefix_cache.shed()
        warm, warm_prefilled, warm_reused = chat(eng, 2, reuse=True)
        assert warm == cold and warm_reused > 0 and warm_prefilled < cold_prefilled
    finally:
        eng.shutdown()


def test_qwen35_moe_reuse_matches_cold() -> None:
    eng = load("builtin:tiny-qwen3.5-moe")
    try:
        cold, _, _ = chat(eng, 2, reuse=False)
        assert eng.prefix_cache is not None
        eng.prefix_cache.shed()
        warm, _, warm_reused = chat(eng, 2, reuse=True)
        assert warm == cold and warm_reused > 0
    finally:
        eng.shutdown()


def test_int8_kv_checkpoints_carry_their_scales() -> None:
    eng = load("builtin:tiny-qwen3-next", kv_quant="int8")
    try:
        assert eng.runner.quantized_kv
        cold, _, _ = chat(eng, 2, reuse=False)
        assert eng.prefix_cache is not None
        eng.prefix_cache.shed()
        warm, _, warm_reused = chat(eng, 2, reuse=True)
        assert warm == cold and warm_reused > 0
    finally:
        eng.shutdown()


def measured_entry_bytes(eng: Engine, n_tokens: int) -> int:
    """Bytes the checkpoints of one n_tokens prompt take in the cache (segments are aligned): one
    checkpoint for n <= INTERVAL, two (INTERVAL and n) up to 2 * INTERVAL."""
    assert eng.prefix_cache is not None
    eng.prefix_cache.shed()
    run_request(eng, 0, ids(99, n_tokens), 1)
    held = eng.prefix_cache.bytes_held
    eng.prefix_cache.shed()
    return held


def test_lru_eviction_under_a_small_budget(hybrid: Engine) -> None:
    e16 = measured_entry_bytes(hybrid, INTERVAL)
    e17 = measured_entry_bytes(hybrid, INTERVAL + 1) - e16
    assert e17 == e16  # 16 and 17 positions take one KV block each
    small = load("builtin:tiny-qwen3-next", max_bytes=2 * e16 + e17)
    try:
        assert small.prefix_cache is not None
        a, b, c = (ids(s, INTERVAL) for s in (11, 12, 13))
        for p in (a, b, c):  # one 16-token checkpoint each: all three fit
            run_request(small, 0, p, 1)
        assert small.prefix_cache.stats().entries == 3 and small.prefix_cache.stats().evictions == 0
        # A restore of a makes it the most recent; the 17-token checkpoint its request saves then
        # needs room, and b, now the least recently used, is evicted (not a, the oldest).
        run_request(small, 1, a + (9,), 1)
        stats = small.prefix_cache.stats()
        assert stats.restores == 1 and stats.evictions == 1 and stats.bytes_held <= 2 * e16 + e17
        assert small.match_prefix(b + (5,)) == 0
        assert small.match_prefix(a + (9, 5)) == INTERVAL + 1
        assert small.match_prefix(a + (5,)) == INTERVAL
        assert small.match_prefix(c + (5,)) == INTERVAL
    finally:
        small.shutdown()


def test_save_larger_than_budget_is_declined() -> None:
    eng = load("builtin:tiny-qwen3-next", max_bytes=1024)
    try:
        run_request(eng, 0, ids(3, 20), 2)
        assert eng.prefix_cache is not None
        stats = eng.prefix_cache.stats()
        assert stats.entries == 0 and stats.declined == 3 and stats.saves == 0
        assert eng.match_prefix(ids(3, 20) + (1,)) == 0
    finally:
        eng.shutdown()


def test_shed_returns_buffers_to_the_pool_and_the_ladder_shed_trims_it() -> None:
    pool = CheckpointPool(lambda: 1 << 34, 0.5, 64, 1, pin=False)
    eng = load("builtin:tiny-qwen3-next", pool=pool)
    try:
        run_request(eng, 0, ids(21, 40), 3)
        cache = eng.prefix_cache
        assert cache is not None
        held = cache.stats()
        assert held.entries == 4 and pool.stats().buffers == 0  # 16, 32, 40, 42 tokens
        # The entries' bytes are their recurrent buffers and the KV blocks they hold (1, 1, 2, 2).
        assert eng.runner.kv is not None
        buffers = held.bytes_held - 6 * eng.runner.kv.layout.block_bytes
        used = eng.runner.kv.figures().used_blocks
        # Shed: the buffers go back to the pool, and the next checkpoints reuse them (hits); the
        # blocks go back to the KV pool.
        assert cache.shed() == held.bytes_held
        assert cache.stats().entries == 0 and pool.stats().buffers == 4 and pool.stats().bytes_held >= buffers
        assert eng.runner.kv.figures().used_blocks == used - 2  # the 42-token answer's blocks
        assert eng.match_prefix(ids(21, 40) + (1,)) == 0
        run_request(eng, 0, ids(22, 40), 3)
        assert pool.stats().hits >= 4 and cache.stats().entries == 4
        # The ladder's shed (WATCH) also trims the pool: under pressure nothing would reuse the
        # buffers, so they go back to the OS at once instead of after the idle age.
        res = eng.step(StepPlan(shed_prefix_cache=True))
        assert res.outputs == ()
        assert cache.stats().entries == 0 and cache.bytes_held == 0
        assert pool.stats().bytes_held == 0 and pool.stats().trimmed_bytes >= buffers
    finally:
        eng.shutdown()


def test_a_checkpoint_gone_since_the_plan_skips_its_slot_not_the_step(hybrid: Engine) -> None:
    """The scheduler plans a step while the one before runs, whose saves can evict the entry the
    plan restores: that slot is skipped like a preempted one (the scheduler queues it again); the
    step's other sequences run, and the slot prefills from scratch next time."""
    assert hybrid.prefix_cache is not None
    hybrid.prefix_cache.shed()
    p, other = ids(31, 20), ids(32, 12)
    res = hybrid.step(
        StepPlan(
            prefills=(PrefillChunk(0, p[16:], 16, True), PrefillChunk(1, other, 0, True)),
            sampling={0: GREEDY, 1: GREEDY},
            restores=(CheckpointRestore(0, p[:16]),),
        )
    )
    assert res.preempted == (0,) and [o.slot for o in res.outputs] == [1]
    assert res.reused_tokens == 0 and res.prefill_tokens == len(other)
    res = hybrid.step(StepPlan(prefills=(PrefillChunk(0, p, 0, True),), sampling={0: GREEDY}))
    assert [o.slot for o in res.outputs] == [0]
    hybrid.step(StepPlan(release=(0, 1)))


def test_bad_checkpoint_orders_are_plan_errors(hybrid: Engine) -> None:
    p = ids(31, 20)
    with pytest.raises(PlanError, match="prefill chunk starting there"):
        hybrid.step(StepPlan(restores=(CheckpointRestore(0, p[:16]),)))
    with pytest.raises(PlanError, match="cannot also"):
        hybrid.step(StepPlan(shed_prefix_cache=True, saves=(CheckpointSave(0, p),)))


def test_cache_off_refuses_checkpoint_orders() -> None:
    eng = load("builtin:tiny-llama", fraction=0.0)
    try:
        assert eng.checkpoint_interval == 0 and eng.prefix_cache is None and eng.match_prefix((1, 2, 3)) == 0
        with pytest.raises(PlanError, match="off"):
            eng.step(StepPlan(saves=(CheckpointSave(0, (1, 2)),)))
    finally:
        eng.shutdown()


def test_auto_interval_follows_the_cost_ratio() -> None:
    assert auto_interval(0, 1024) == MIN_INTERVAL
    assert auto_interval(75 * MiB, 24 * 1024) == 3328  # a Qwen3-Next-80B-like ratio, 256-aligned
    assert auto_interval(MiB, 0) == MIN_INTERVAL


def greedy(eng: Engine, slot: int, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    """One greedy sequence, prefilled whole, decoded; the slot is not released."""
    res = eng.step(StepPlan(prefills=(PrefillChunk(slot, prompt, 0, True),), sampling={slot: GREEDY}))
    out = [res.outputs[0].token_id]
    for _ in range(new_tokens - 1):
        res = eng.step(
            StepPlan(
                decodes=(DecodeToken(slot, out[-1], len(prompt) + len(out) - 1),), sampling={slot: GREEDY}
            )
        )
        out.append(res.outputs[0].token_id)
    return out


@pytest.mark.parametrize("model", ["builtin:tiny-llama", "builtin:tiny-qwen3-next"])
def test_a_parked_sequence_resumes_exactly_where_it_stopped(model: str) -> None:
    """Parking copies a sequence's blocks and recurrent states out of the pools (what the engine
    does on CUDA when it preempts); its slot is released; a restore of the same tokens into another
    slot brings it back and decoding goes on with the tokens of an uninterrupted run. Unpark drops
    a parked sequence whose request ended."""
    cfg = EngineConfig(
        model=model, device="cpu", max_num_seqs=3, max_model_len=MAX_LEN, prefill_chunk_tokens=64
    )
    eng = Engine.load(
        cfg, prefix_cache=PrefixCacheConfig(fraction=0.0)
    )  # prefix caching off: parking still works
    try:
        p = ids(41, 45)
        calm = greedy(eng, 0, p, 8)
        eng.step(StepPlan(release=(0,)))
        first = greedy(eng, 0, p, 4)
        kv = eng.runner.kv
        assert kv is not None and eng.prefix_cache is None
        fed = p + tuple(first[:-1])
        assert eng._cache.parked.park(0, fed, kv) and eng.match_parked(fed + (first[-1],)) == len(fed)
        eng.step(StepPlan(release=(0,)))
        assert kv.figures().used_blocks == 0
        res = eng.step(
            StepPlan(
                prefills=(PrefillChunk(2, (first[-1],), len(fed), True),),
                restores=(CheckpointRestore(2, fed),),
                sampling={2: GREEDY},
            )
        )
        assert res.reused_tokens == 0  # a resume, not prefix reuse
        out = first + [res.outputs[0].token_id]
        for _ in range(3):
            step = eng.step(
                StepPlan(decodes=(DecodeToken(2, out[-1], len(p) + len(out) - 1),), sampling={2: GREEDY})
            )
            out.append(step.outputs[0].token_id)
        assert out == calm
        assert eng._cache.stats().parked == 0
        eng.step(StepPlan(release=(2,)))
        greedy(eng, 0, p, 2)
        assert eng._cache.parked.park(0, p, kv) and eng._cache.stats().parked == 1
        eng.step(StepPlan(release=(0,), unpark=(p + (1,),)))
        assert eng._cache.stats().parked == 0 and eng.match_parked(p + (1,)) == 0
    finally:
        eng.shutdown()


def test_a_restore_into_a_pool_full_of_cached_prefixes_evicts_older_ones() -> None:
    """Found by the soak: once cached prefixes held every block of the KV pool, restoring a
    checkpoint whose last block is partly filled (it must be copied) found no free block and
    failed the step. Older entries now give way; the restored one is kept."""
    eng = llama_in_small_segments(prefill_chunk_tokens=64)
    try:
        prompts = [ids(90 + i, 2 * INTERVAL + 4) for i in range(12)]  # 3 blocks each, the last one partial
        for p in prompts:  # fill the cache until the pool has no free block left
            run_request(eng, 0, p, 2, reuse=False)
            kv = eng.kv_figures()
            assert kv is not None
            if kv.free_blocks <= 1 and kv.addable_blocks == 0:
                break
        else:
            pytest.fail(f"the cache never filled the pool: {eng.kv_figures()}")
        # A running sequence takes what is left.
        eng.step(StepPlan(prefills=(PrefillChunk(0, ids(200, 10), 0, True),), sampling={0: GREEDY}))
        assert eng.kv_figures().free_blocks == 0  # type: ignore[union-attr]
        target = next(p for p in prompts if eng.match_prefix(p + (7,)) == len(p))
        out = run_request(eng, 1, target + (7,), 3)  # restores `target`, copying its partial block
        assert eng.reused_tokens >= len(target) and len(out) == 3
    finally:
        eng.shutdown()


def test_a_failed_step_that_restored_a_checkpoint_leaves_the_cache_whole() -> None:
    """A hybrid engine (recurrent-state checkpoints in pool buffers): a step that restores a
    checkpoint and then fails (a MemoryError in the forward) drops only that slot; the cache keeps
    its entries and buffers, no block stays held by a sequence, and the same request afterwards
    gives the calm run's tokens."""
    eng = load("builtin:tiny-qwen3-next")
    try:
        base = ids(70, 2 * INTERVAL)
        run_request(eng, 0, base, 2)  # checkpoints of `base` are cached
        follow = base + ids(71, 5)
        calm = run_request(eng, 0, follow, 4)
        assert eng.prefix_cache is not None
        entries = eng.prefix_cache.stats().entries
        start = eng.match_prefix(follow)
        assert start > 0
        forward = eng.runner.forward

        def oom(seqs, all_logits=()):  # type: ignore[no-untyped-def]
            raise MemoryError("injected")

        eng.runner.forward = oom  # type: ignore[method-assign]
        plan = StepPlan(
            prefills=(PrefillChunk(1, follow[start:], start, True),),
            sampling={1: GREEDY},
            restores=(CheckpointRestore(1, follow[:start]),),
        )
        with pytest.raises(StepFailed) as failed:
            eng.submit(plan).result(timeout=60)
        eng.runner.forward = forward  # type: ignore[method-assign]
        assert failed.value.slots == {1} and eng.healthy
        assert eng.prefix_cache.stats().entries == entries
        kv = eng.kv_figures()
        assert kv is not None and kv.used_blocks == kv.evictable_blocks  # only the cache holds blocks
        eng.submit(StepPlan(release=(1,))).result(timeout=60)  # the scheduler's release: a no-op now
        assert run_request(eng, 1, follow, 4) == calm
    finally:
        eng.shutdown()


def test_checkpoint_buffers_are_in_the_pool_before_the_first_save() -> None:
    # Floor 0: the tiny model's checkpoints (KiB) are below the default 1 MiB pooling floor.
    pool = CheckpointPool(lambda: 64 * MiB * 1024, 0.25, 8, 0, pin=False)
    eng = load("builtin:tiny-qwen3-next", pool=pool)
    try:
        cache = eng.prefix_cache
        assert cache is not None
        need = sum(v.numel() * v.element_size() for s in eng.runner.states for v in s.slot_views(0))
        s = pool.stats()
        assert need > 0 and (s.buffers, s.misses) == (4, 0)  # two per slot, warmed at load
        assert s.bytes_held >= 4 * need
        prompt = ids(7, 20)
        eng.step(
            StepPlan(
                prefills=(PrefillChunk(0, prompt, 0, True), PrefillChunk(1, prompt[:16], 0, False)),
                sampling={0: GREEDY, 1: GREEDY},
                saves=(CheckpointSave(0, prompt), CheckpointSave(1, prompt[:16])),
            )
        )
        s = pool.stats()
        assert (s.hits, s.misses, cache.stats().saves) == (2, 0, 2)  # both saves of the step hit
    finally:
        eng.shutdown()
    # A cache that is off warms nothing.
    off_pool = CheckpointPool(lambda: 64 * MiB * 1024, 0.25, 8, 0, pin=False)
    off = load("builtin:tiny-qwen3-next", pool=off_pool, fraction=0.0)
    off.shutdown()
    assert off_pool.stats().high_water_buffers == 0


def test_a_sequence_short_of_blocks_evicts_cached_prefixes_before_anyone_is_preempted() -> None:
    """Found by the soak (a few preemptions beside thousands of evictable cached blocks): with some
    free blocks in a pool otherwise full of cached prefixes, a sequence needing more than were free
    asked the cache to evict until only its shortfall was free, which it already was, and was
    preempted. The cache now evicts until the blocks it needs are free."""
    eng = llama_in_small_segments(prefill_chunk_tokens=MAX_LEN)
    try:
        for i in range(40):  # fill the cache until the pool is at its limit, (nearly) every block cached
            run_request(eng, 0, ids(90 + i, 2 * INTERVAL + 4), 2, reuse=False)
            full = eng.kv_figures()
            if full is not None and full.addable_blocks == 0 and full.free_blocks <= 1:
                break
        else:
            pytest.fail(f"the cache never filled the pool: {eng.kv_figures()}")
        cache = eng.prefix_cache
        assert cache is not None and cache.evict_for_blocks(2)  # a few blocks free, the rest cached
        kv = eng.kv_figures()
        assert kv is not None and kv.addable_blocks == 0 and kv.evictable_blocks > kv.free_blocks >= 2
        prompt = ids(500, (kv.free_blocks + 1) * kv.block_size)  # one block more than is free
        res = eng.step(StepPlan(prefills=(PrefillChunk(0, prompt, 0, True),), sampling={0: GREEDY}))
        assert not res.preempted and [o.slot for o in res.outputs] == [0]
        assert eng.slot_kv.preemptions == 0
    finally:
        eng.shutdown()
