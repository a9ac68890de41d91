"""The scheduler plans step N+1 before step N's tokens are back (fake engine, real worker thread)."""

from __future__ import annotations

import asyncio
from collections import Counter

from ballast.engine.plan import LAST_SAMPLED
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens

TOK = FakeTokenizer()


def req(i: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}", tuple(TOK.encode(f"request {i}: say something")), max_tokens=max_tokens)


async def run(
    eng: FakeEngine, reqs: list[GenerationRequest], overlap: bool = True
) -> list[tuple[str, list[int], str]]:
    s = Scheduler(eng, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, overlap=overlap))
    await s.start()
    try:
        results = await asyncio.gather(*(s.submit(r).collect() for r in reqs))
        for _ in range(2000):  # the last releases go out in a plan after the last token
            if s.idle and eng.active_slots == 0:
                break
            await asyncio.sleep(0.001)
        assert s.idle and eng.active_slots == 0
    finally:
        await s.stop()
        eng.shutdown()
    return [(text, list(tokens), fin.reason) for text, tokens, fin in results]


async def test_decodes_are_planned_ahead_and_the_text_is_the_calm_run() -> None:
    eng = FakeEngine(step_delay_s=0.002)
    reqs = [req(i, max_tokens=12) for i in range(3)]
    out = await run(eng, reqs)
    for r, (text, _, reason) in zip(reqs, out, strict=True):
        assert reason == "length" and text == TOK.decode(expected_tokens(r.prompt_ids, 12))
    plans = eng.recorded()
    ahead = [p for p in plans if any(d.token_id == LAST_SAMPLED for d in p.decodes)]
    assert len(ahead) >= 8  # steady decoding ran one step ahead
    # A request that reaches max_tokens is never decoded past it: 11 decodes after the prefill's token.
    decodes = Counter(d.slot for p in plans for d in p.decodes)
    assert sorted(decodes.values()) == [11, 11, 11]


async def test_overlap_off_plans_from_returned_tokens_only() -> None:
    eng = FakeEngine(step_delay_s=0.001)
    reqs = [req(i, max_tokens=6) for i in range(2)]
    out = await run(eng, reqs, overlap=False)
    assert [t for t, _, _ in out] == [TOK.decode(expected_tokens(r.prompt_ids, 6)) for r in reqs]
    assert not any(d.token_id == LAST_SAMPLED for p in eng.recorded() for d in p.decodes)


async def test_a_request_ending_while_its_next_step_runs_saves_what_its_slot_consumed() -> None:
    """An end of sequence is only seen after the step ahead fed that token to the slot: the final
    checkpoint then names prompt + every output token (the fake engine refuses a save that names
    anything but what the slot consumed); without overlap it names prompt + output[:-1]."""
    r = req(1, max_tokens=20)
    for overlap in (True, False):
        eng = FakeEngine(checkpoint_interval=4, eos_after=5)
        [(_, tokens, reason)] = await run(eng, [r], overlap=overlap)
        generated = tuple(expected_tokens(r.prompt_ids, 20, eos_after=5))
        assert len(generated) == 6  # five tokens, then the end of sequence
        assert reason == "stop" and tuple(tokens) == generated  # the EOS has its event too
        consumed = r.prompt_ids + (generated if overlap else generated[:-1])
        assert consumed in eng.checkpoints
