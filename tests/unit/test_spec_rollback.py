"""A verify step's rollback on real built-in models (CPU, float32): whatever position a draft is
rejected at, the slot ends with the recurrent states, KV blocks and fed record of the run that
never drafted, and goes on to emit the same tokens: the hybrid's from the states its verify step
kept, copied back (no second forward)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.kv.blocks import blocks_for
from ballast.engine.plan import (
    DecodeToken,
    PlanError,
    PrefillChunk,
    SamplingParams,
    StepFailed,
    StepPlan,
    StepResult,
)
from ballast.engine.workspace import VerifySize
from ballast.models.layers.state import RecurrentState
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.scheduler import Scheduler
from memfixtures import limited_grants

from ballast.settings import ConfigError

GREEDY = SamplingParams(temperature=0.0)
K = 3
SLOT = 1


@pytest.fixture(scope="module", params=["builtin:tiny-qwen3-next", "builtin:tiny-llama"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    eng = Engine.load(
        EngineConfig(
            model=request.param, device="cpu", max_num_seqs=2, max_model_len=64, prefill_chunk_tokens=32
        ),
        verify=VerifySize(1, K),
    )
    yield eng
    eng.shutdown()


def run(engine: Engine, plan: StepPlan) -> StepResult:
    return engine.submit(plan).result(timeout=60)


def prompt() -> tuple[int, ...]:
    return tuple(torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(7)).tolist())


def start(engine: Engine) -> int:
    res = run(
        engine,
        StepPlan(prefills=(PrefillChunk(SLOT, prompt(), 0, True),), sampling={SLOT: GREEDY}, release=(SLOT,)),
    )
    return res.outputs[0].token_id


def states(engine: Engine) -> list[torch.Tensor]:
    return [t.clone() for s in engine.runner.states for t in s.slot_views(SLOT)]


def reference(engine: Engine, steps: int) -> tuple[list[int], list[list[torch.Tensor]]]:
    """Greedy tokens without drafts, and the slot's states after each decode step."""
    tokens = [start(engine)]
    after: list[list[torch.Tensor]] = []
    for i in range(steps):
        pos = len(prompt()) + i
        res = run(engine, StepPlan(decodes=(DecodeToken(SLOT, tokens[-1], pos),), sampling={SLOT: GREEDY}))
        tokens.append(res.outputs[0].token_id)
        after.append(states(engine))
    return tokens, after


@pytest.mark.parametrize(
    ("accepted", "all_wrong"), [(0, True), (0, False), (1, False), (K - 1, False), (K, False)]
)
def test_a_rejection_at_any_position_leaves_the_states_of_the_run_without_drafts(
    engine: Engine, accepted: int, all_wrong: bool
) -> None:
    want, want_states = reference(engine, K + 4)
    first = start(engine)
    assert first == want[0]
    # Drafts: the true continuation, wrong at position `accepted` (all_wrong: at every position).
    draft = tuple(want[1 : 1 + K])
    if accepted < K:
        draft = tuple((t + 1) % 200 if j == accepted or all_wrong else t for j, t in enumerate(draft))
    pos = len(prompt())
    res = run(engine, StepPlan(decodes=(DecodeToken(SLOT, first, pos, draft),), sampling={SLOT: GREEDY}))
    got = [o.token_id for o in res.outputs]
    assert got == want[1 : accepted + 2]  # the accepted drafts, then the target's own token
    fed = pos + 1 + accepted  # positions the slot now holds
    # Not bit for bit: the verify row's projections multiply 4 rows at once, which the CPU's
    # matmul rounds otherwise than 1 row (1.2e-7 seen); the rule itself keeps a decode step's bits
    # (test_verify_states.py).
    for ours, theirs in zip(states(engine), want_states[accepted], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    if accepted < K and engine.recurrent_state:  # the state is the one the verify step kept
        kept = [s.kept_states[0, accepted] for s in engine.runner.states if isinstance(s, RecurrentState)]
        recurrent = [s.recurrent[SLOT] for s in engine.runner.states if isinstance(s, RecurrentState)]
        assert kept and all(torch.equal(a, b) for a, b in zip(kept, recurrent, strict=True))
    kv = engine.runner.kv
    if kv is not None:
        assert len(kv.table(SLOT)) == blocks_for(fed, kv.layout.block_size)
    # And it goes on as the run without drafts did.
    tokens = got[:]
    for i in range(2):
        step = run(
            engine, StepPlan(decodes=(DecodeToken(SLOT, tokens[-1], fed + i),), sampling={SLOT: GREEDY})
        )
        tokens.append(step.outputs[0].token_id)
    assert tokens == want[1 : accepted + 4]


def test_a_failed_drafting_step_costs_only_its_sequence(engine: Engine) -> None:
    first = start(engine)
    pos = len(prompt())
    with pytest.raises(StepFailed) as failed:
        run(engine, StepPlan(decodes=(DecodeToken(SLOT, first, pos, (10**9,)),), sampling={SLOT: GREEDY}))
    assert isinstance(failed.value.cause, PlanError) and failed.value.slots == frozenset({SLOT})
    # The failed step cost only its sequence: the slot starts again and drafts as before.
    again = start(engine)
    res = run(engine, StepPlan(decodes=(DecodeToken(SLOT, again, pos, (again,)),), sampling={SLOT: GREEDY}))
    assert engine.healthy and 1 <= len(res.outputs) <= 2


def test_a_drafting_row_preempted_for_blocks_runs_none_of_its_draft() -> None:
    """Two one-block sequences and one free block: slot 0's decode takes it, slot 1's drafting
    row (the younger decode) is preempted. The step reports slot 0's token alone; slot 1 holds no
    block, and started again it drafts and emits the greedy tokens of a run without drafts."""
    eng = Engine.load(
        EngineConfig(
            model="builtin:tiny-llama",
            device="cpu",
            max_num_seqs=2,
            max_model_len=128,
            prefill_chunk_tokens=64,
            kv_segment_bytes=64 << 10,  # one segment of four blocks: one free after the prompts
        )
    )
    try:
        kv = eng.runner.kv
        assert kv is not None
        kv._acquire = limited_grants(1)
        n = kv.layout.block_size
        prompts = {
            s: tuple(torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(s)).tolist())
            for s in (0, 1)
        }
        res = run(
            eng,
            StepPlan(
                prefills=tuple(PrefillChunk(s, p, 0, True) for s, p in prompts.items()),
                sampling=dict.fromkeys(prompts, GREEDY),
            ),
        )
        last = {o.slot: o.token_id for o in res.outputs}
        assert kv.figures().free_blocks == 1
        decodes = (DecodeToken(0, last[0], n), DecodeToken(1, last[1], n, (last[1],) * K))
        res = run(eng, StepPlan(decodes=decodes, sampling=dict.fromkeys(prompts, GREEDY)))
        assert res.preempted == (1,) and [o.slot for o in res.outputs] == [0]
        assert res.decode_tokens == 1 and kv.table(1) == [] and eng.healthy
        # slot 1 again from its prompt (slot 0 released): greedy alone, then a draft of those tokens
        res = run(
            eng,
            StepPlan(prefills=(PrefillChunk(1, prompts[1], 0, True),), sampling={1: GREEDY}, release=(0,)),
        )
        want = [res.outputs[0].token_id]
        for i in range(K + 1):
            step = StepPlan(decodes=(DecodeToken(1, want[-1], n + i),), sampling={1: GREEDY})
            want.append(run(eng, step).outputs[0].token_id)
        run(
            eng,
            StepPlan(prefills=(PrefillChunk(1, prompts[1], 0, True),), sampling={1: GREEDY}, release=(1,)),
        )
        res = run(
            eng, StepPlan(decodes=(DecodeToken(1, want[0], n, tuple(want[1 : K + 1])),), sampling={1: GREEDY})
        )
        assert [o.token_id for o in res.outputs] == want[1:]
    finally:
        eng.shutdown()


def test_a_hybrid_without_a_verify_workspace_refuses_drafts() -> None:
    """Its rejected drafts would have no state to go back to: a scheduler that would draft refuses
    to start on it, and a drafting step handed to it fails for its sequence alone."""
    eng = Engine.load(
        EngineConfig(model="builtin:tiny-qwen3-next", device="cpu", max_num_seqs=2, max_model_len=64)
    )
    try:
        with pytest.raises(ConfigError, match="keeps 0 of 0"):
            Scheduler(eng, SchedulerConfig(max_num_seqs=2, speculative_config='{"method": "ngram"}'))
        first = start(eng)
        with pytest.raises(StepFailed, match="Engine.load"):
            run(
                eng,
                StepPlan(
                    decodes=(DecodeToken(SLOT, first, len(prompt()), (first,)),), sampling={SLOT: GREEDY}
                ),
            )
        assert eng.healthy
    finally:
        eng.shutdown()
