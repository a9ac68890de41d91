"""Overlapped steps in the real engine (CPU, tiny models): plans submitted before the previous
step's tokens are back, decodes fed from the device (LAST_SAMPLED), failures kept apart."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import (
    LAST_SAMPLED,
    DecodeToken,
    PrefillChunk,
    SamplingParams,
    StepFailed,
    StepPlan,
    StepResult,
)
from ballast.engine.text.grammar import GrammarCompiler

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=77)
STEPS = 8
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
    "required": ["color", "n"],
    "additionalProperties": False,
}


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


PROMPTS = {0: prompt(1, 9), 2: prompt(2, 13)}
PARAMS = {0: GREEDY, 2: SEEDED}


@pytest.fixture(scope="module", params=["builtin:tiny-llama", "builtin:tiny-qwen3-next"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    cfg = EngineConfig(
        model=request.param, device="cpu", max_num_seqs=4, max_model_len=64, prefill_chunk_tokens=32
    )
    eng = Engine.load(cfg)
    yield eng
    eng.shutdown()


def start_plan() -> StepPlan:
    return StepPlan(
        prefills=tuple(PrefillChunk(slot, ids, 0, True) for slot, ids in PROMPTS.items()),
        sampling=dict(PARAMS),
    )


def ahead_plan(step: int) -> StepPlan:
    """Decode `step` (1-based) of both sequences, its tokens left to the device."""
    return StepPlan(
        decodes=tuple(DecodeToken(slot, LAST_SAMPLED, len(ids) + step - 1) for slot, ids in PROMPTS.items()),
        sampling=dict(PARAMS),
    )


def tokens_of(results: list[StepResult]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {slot: [] for slot in PROMPTS}
    for res in results:
        for o in res.outputs:
            out[o.slot].append(o.token_id)
    return out


def release(engine: Engine) -> None:
    engine.submit(StepPlan(release=tuple(PROMPTS))).result(timeout=60)


def one_at_a_time(engine: Engine) -> dict[int, list[int]]:
    """Each decode names the token the previous step returned: no overlap possible."""
    results = [engine.submit(start_plan()).result(timeout=60)]
    for step in range(1, STEPS):
        last = {o.slot: o.token_id for o in results[-1].outputs}
        decodes = tuple(DecodeToken(slot, last[slot], len(ids) + step - 1) for slot, ids in PROMPTS.items())
        results.append(engine.submit(StepPlan(decodes=decodes, sampling=dict(PARAMS))).result(timeout=60))
    release(engine)
    return tokens_of(results)


def all_submitted_at_once(engine: Engine, plans: list[StepPlan]) -> list[Future[StepResult]]:
    """Submit every plan while the engine thread is held, so each finds the next one waiting."""
    gate = threading.Event()
    engine._executor.submit(gate.wait)  # holds the engine thread until every plan is queued
    futures = [engine.submit(p) for p in plans]
    gate.set()
    return futures


def test_steps_planned_ahead_give_the_tokens_of_steps_planned_one_at_a_time(engine: Engine) -> None:
    calm = one_at_a_time(engine)
    before = engine.overlapped_steps
    futures = all_submitted_at_once(engine, [start_plan()] + [ahead_plan(s) for s in range(1, STEPS)])
    ahead = tokens_of([f.result(timeout=60) for f in futures])
    release(engine)
    assert ahead == calm
    assert len(set(calm[2])) > 1  # the seeded row really sampled
    assert engine.overlapped_steps - before == STEPS - 1  # every step launched before the last finished


def test_a_failed_plan_behind_a_good_one_costs_only_its_own_requests(engine: Engine) -> None:
    calm = one_at_a_time(engine)
    bad = StepPlan(
        decodes=(DecodeToken(0, LAST_SAMPLED, len(PROMPTS[0])), DecodeToken(9, LAST_SAMPLED, 3)),
        sampling={0: GREEDY, 9: GREEDY},
    )
    first, failed = all_submitted_at_once(engine, [start_plan(), bad])
    assert tokens_of([first.result(timeout=60)]) == {slot: toks[:1] for slot, toks in calm.items()}
    with pytest.raises(StepFailed):
        failed.result(timeout=60)
    release(engine)
    assert engine.healthy
    assert one_at_a_time(engine) == calm  # the engine serves on, with the same tokens


def test_last_sampled_needs_a_token_drawn_in_the_slot(engine: Engine) -> None:
    with pytest.raises(StepFailed):
        engine.submit(StepPlan(decodes=(DecodeToken(3, LAST_SAMPLED, 4),), sampling={3: GREEDY})).result(
            timeout=60
        )
    assert engine.healthy


def test_grammar_rows_wait_for_the_previous_token_and_follow_the_grammar(engine: Engine) -> None:
    """A constrained decode planned ahead still has its matcher consume the previous token before
    its mask is built (the engine finishes the step in flight first): the tokens equal those of
    steps run one at a time, and the text stays inside the grammar."""
    tok = engine.tokenizer
    compiler = GrammarCompiler(tok.hf, engine.vocab_size, tok.eos_token_ids)
    ids = PROMPTS[0]
    json_only = SamplingParams(
        temperature=0.0, constraint=compiler.constraint(compiler.json_schema(SCHEMA), len(ids))
    )
    sampling = {0: json_only}
    start = StepPlan(prefills=(PrefillChunk(0, ids, 0, True),), sampling=sampling)

    calm = [engine.submit(start).result(timeout=60).outputs[0].token_id]
    for step in range(1, STEPS):
        plan = StepPlan(decodes=(DecodeToken(0, calm[-1], len(ids) + step - 1),), sampling=sampling)
        calm.append(engine.submit(plan).result(timeout=60).outputs[0].token_id)
    engine.submit(StepPlan(release=(0,))).result(timeout=60)

    before = engine.overlapped_steps
    plans = [start] + [
        StepPlan(decodes=(DecodeToken(0, LAST_SAMPLED, len(ids) + step - 1),), sampling=sampling)
        for step in range(1, STEPS)
    ]
    ahead = [f.result(timeout=60).outputs[0].token_id for f in all_submitted_at_once(engine, plans)]
    engine.submit(StepPlan(release=(0,))).result(timeout=60)
    assert ahead == calm
    assert engine.overlapped_steps == before  # each grammar step waited for the one before
    text = tok.hf.decode([t for t in calm if t not in tok.eos_token_ids])
    assert text.startswith('{"color": "')
