"""Sampler behaviour on small hand-made logits: exact masks, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.step.sampler import Sampler, filter_logits

CPU = torch.device("cpu")


def col(*values: float) -> tuple[float, ...]:
    return values


def kept(filtered: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in filtered]


def test_greedy_is_argmax_per_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 37)
    sampler = Sampler(num_slots=8, vocab_size=37, device=CPU)
    out = sampler.sample(logits, [0, 3, 4, 6, 7], [SamplingParams(temperature=0.0)] * 5)
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()
    assert all(o.logprob is None for o in out)


def test_top_k_keeps_exactly_k_largest() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 5.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    out = filter_logits(logits, col(1.0, 1.0), [2, 0], col(1.0, 1.0), col(0.0, 0.0))
    assert kept(out) == [[4, 5], [0, 1, 2, 3, 4, 5]]


def test_temperature_scales_surviving_logits() -> None:
    logits = torch.tensor([[2.0, 4.0, 8.0]])
    out = filter_logits(logits, col(2.0), [0], col(1.0), col(0.0))
    assert out.tolist() == [[1.0, 2.0, 4.0]]


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    # sorted: 0.5 (id 1), 0.25 (id 3), 0.15 (id 2), 0.1 (id 0)
    logits = torch.tensor([[0.1, 0.5, 0.15, 0.25]]).log()
    assert kept(filter_logits(logits, col(1.0), [0], col(0.5), col(0.0))) == [[1]]
    assert kept(filter_logits(logits, col(1.0), [0], col(0.6), col(0.0))) == [[1, 3]]
    assert kept(filter_logits(logits, col(1.0), [0], col(0.74), col(0.0))) == [[1, 3]]
    assert kept(filter_logits(logits, col(1.0), [0], col(0.8), col(0.0))) == [[1, 2, 3]]
    assert kept(filter_logits(logits, col(1.0), [0], col(0.95), col(0.0))) == [[0, 1, 2, 3]]


def test_min_p_drops_below_fraction_of_top() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    out = filter_logits(probs.log(), col(1.0), [0], col(1.0), col(0.45))
    assert kept(out) == [[0, 1, 2]]  # floor 0.45 * 0.4 = 0.18: 0.1 goes, 0.2 stays


def test_filters_are_per_row() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    out = filter_logits(probs.log(), col(1.0, 1.0, 1.0), [1, 0, 0], col(1.0, 0.5, 1.0), col(0.0, 0.0, 0.6))
    assert kept(out) == [[0], [0, 1], [0, 1]]


def test_sampling_only_picks_allowed_tokens() -> None:
    sampler = Sampler(num_slots=2, vocab_size=6, device=CPU, seed=1)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    seen = set()
    for _ in range(200):
        sampler.reset([0])
        seen.add(sampler.sample(logits, [0], [SamplingParams(temperature=1.0, top_k=3)])[0].token_id)
    assert seen == {3, 4, 5}


def test_draws_follow_the_distribution() -> None:
    sampler = Sampler(num_slots=1, vocab_size=3, device=CPU, seed=7)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    # One call with 4000 rows of the same slot index would be odd for a real engine but is a
    # clean way to draw many samples from the shared generator at once.
    out = sampler.sample(logits, [0] * 4000, [SamplingParams(temperature=1.0)] * 4000)
    freq = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_repetition_penalty_on_prompt_and_output_tokens() -> None:
    sampler = Sampler(num_slots=1, vocab_size=4, device=CPU)
    sampler.observe_prompt(0, [0])
    logits = torch.tensor([[2.0, 1.9, -1.0, 1.5]])
    greedy_rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 0 was in the prompt: 2.0 / 2 = 1.0 < 1.9, so token 1 wins
    assert sampler.sample(logits, [0], [greedy_rep])[0].token_id == 1
    # now 1 was generated too: 1.9 / 2 = 0.95, token 3 (1.5) wins
    assert sampler.sample(logits, [0], [greedy_rep])[0].token_id == 3


def test_negative_logits_are_multiplied_by_repetition_penalty() -> None:
    sampler = Sampler(num_slots=1, vocab_size=2, device=CPU)
    sampler.observe_prompt(0, [0])
    logits = torch.tensor([[-1.0, -1.5]])
    # -1.0 * 2 = -2.0 < -1.5: the unseen token wins
    assert (
        sampler.sample(logits, [0], [SamplingParams(temperature=0.0, repetition_penalty=2.0)])[0].token_id
        == 1
    )


def test_frequency_and_presence_penalties_count_outputs_only() -> None:
    sampler = Sampler(num_slots=2, vocab_size=3, device=CPU)
    sampler.observe_prompt(0, [1])  # prompt tokens do not count for these penalties
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    picks = [sampler.sample(logits, [0], [freq])[0].token_id for _ in range(4)]
    # token 0 scores 3.0 - 0.3 n0, token 1 scores 2.5 - 0.3 n1 (its prompt use does not count):
    # 3.0, 2.7 win; then 2.4 < 2.5 so token 1; then 2.4 > 2.2 so token 0 again
    assert picks == [0, 0, 1, 0]
    pres = SamplingParams(temperature=0.0, presence_penalty=0.6)
    picks = [sampler.sample(logits, [1], [pres])[0].token_id for _ in range(3)]
    assert picks == [0, 1, 0]  # presence is flat: 2.4 < 2.5 after one use, then 1.9 < 2.4


def test_reset_clears_history() -> None:
    sampler = Sampler(num_slots=1, vocab_size=2, device=CPU)
    logits = torch.tensor([[1.0, 0.9]])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sampler.sample(logits, [0], [params])[0].token_id == 0
    assert sampler.sample(logits, [0], [params])[0].token_id == 1
    sampler.reset([0])
    assert sampler.sample(logits, [0], [params])[0].token_id == 0


def draw_seeded(
    sampler: Sampler, logits: torch.Tensor, slot: int, companions: list[int], steps: int
) -> list[int]:
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=0.9, top_p=0.9)
    tokens = []
    for _ in range(steps):
        slots = [*companions, slot]
        rows = torch.cat([logits] * len(slots))
        out = sampler.sample(rows, slots, [other] * len(companions) + [seeded])
        tokens.append(out[-1].token_id)
    return tokens


def test_seed_reproducible_whatever_the_batch() -> None:
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(3))
    alone = draw_seeded(Sampler(8, 500, CPU, seed=0), logits, slot=2, companions=[], steps=20)
    crowded = draw_seeded(Sampler(8, 500, CPU, seed=99), logits, slot=5, companions=[0, 1, 3], steps=20)
    assert alone == crowded
    assert len(set(alone)) > 3  # it really sampled, not argmax


def test_reset_restarts_the_seeded_stream() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(2, 100, CPU)
    first = draw_seeded(sampler, logits, slot=0, companions=[], steps=5)
    sampler.reset([0])
    assert draw_seeded(sampler, logits, slot=0, companions=[], steps=5) == first


def test_logprobs_are_normalised_and_consistent() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 50)
    sampler = Sampler(3, 50, CPU)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = sampler.sample(logits, [0, 1, 2], params)
    full = torch.log_softmax(logits, -1)
    assert math.isclose(float(full[0].exp().sum()), 1.0, rel_tol=1e-5)
    assert out[0].logprob == pytest.approx(float(full[0].max()), abs=1e-6)
    top = out[0].top_logprobs
    assert len(top) == 5
    assert [t for t, _ in top] == full[0].topk(5).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))  # descending
    assert top[0][0] == out[0].token_id
    assert out[1].logprob is None and out[1].top_logprobs == ()
    assert out[2].logprob == pytest.approx(float(full[2].max()), abs=1e-6) and out[2].top_logprobs == ()
    assert sum(math.exp(lp) for _, lp in top) <= 1.0 + 1e-6


def test_shape_mismatch_is_an_error() -> None:
    sampler = Sampler(2, 4, CPU)
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 4), [0], [SamplingParams()])
