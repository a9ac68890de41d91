"""A verify step's rollback on real built-in models (CPU, float32): whatever position a draft is
rejected at, the slot ends with the recurrent states, KV blocks and fed record of the run that
never drafted, and goes on to emit the same tokens."""

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

GREEDY = SamplingParams(temperature=0.0)
K = 3
SLOT = 1


@pytest.fixture(scope="module", params=["builtin:tiny-qwen3-next", "builtin:tiny-llama"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    eng = Engine.load(
        EngineConfig(
            model=request.param, device="cpu", max_num_seqs=2, max_model_len=64, prefill_chunk_tokens=32
        )
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


@pytest.mark.parametrize("accepted", [0, 1, K - 1, K])
def test_a_rejection_at_any_position_leaves_the_states_of_the_run_without_drafts(
    engine: Engine, accepted: int
) -> None:
    want, want_states = reference(engine, K + 4)
    first = start(engine)
    assert first == want[0]
    # Drafts: the true continuation, wrong from position `accepted` on.
    draft = tuple(want[1 : 1 + K])
    if accepted < K:
        draft = (*draft[:accepted], (draft[accepted] + 1) % 200, *draft[accepted + 1 :])
    pos = len(prompt())
    res = run(engine, StepPlan(decodes=(DecodeToken(SLOT, first, pos, draft),), sampling={SLOT: GREEDY}))
    got = [o.token_id for o in res.outputs]
    assert got == want[1 : accepted + 2]  # the accepted drafts, then the target's own token
    fed = pos + 1 + accepted  # positions the slot now holds
    for ours, theirs in zip(states(engine), want_states[accepted], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
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
