"""The sampler batched: every knob gives a row the same tokens alone or among other rows, a seeded
row's stream follows its distribution, and draw/collect split the step around one copy."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.step.sampler import Sampler

CPU = torch.device("cpu")
VOCAB = 64
PROMPT = list(range(0, VOCAB, 2))  # half the vocabulary seen: the repetition penalty bites

# One request per option the sampler knows, each seeded so its stream is a function of the seed.
OPTIONS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "plain": SamplingParams(temperature=1.0, seed=11),
    "hot": SamplingParams(temperature=1.7, seed=12),
    "top_k": SamplingParams(temperature=1.0, top_k=5, seed=13),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6, seed=14),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2, seed=15),
    "repetition": SamplingParams(temperature=0.8, repetition_penalty=1.8, seed=16),
    "frequency": SamplingParams(temperature=0.8, frequency_penalty=1.5, seed=17),
    "presence": SamplingParams(temperature=0.8, presence_penalty=1.5, seed=18),
    "logprobs": SamplingParams(temperature=1.0, logprobs=3, seed=19),
    "bias": SamplingParams(temperature=1.0, logit_bias=((7, 6.0), (8, -100.0)), seed=20),
    "greedy_logprobs": SamplingParams(temperature=0.0, logprobs=0),
}


def logits_for(step: int, rows: int) -> torch.Tensor:
    """The same logits for every row at a step (rows differ only by their knobs)."""
    base = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(100 + step)) * 2
    return base.expand(rows, VOCAB).contiguous()


def run(
    names: list[str], slots: list[int], steps: int = 12
) -> dict[str, list[tuple[int, float | None, tuple]]]:
    sampler = Sampler(num_slots=16, vocab_size=VOCAB, device=CPU, seed=5)
    for slot in slots:
        sampler.observe_prompt(slot, PROMPT)
    out: dict[str, list[tuple[int, float | None, tuple]]] = {n: [] for n in names}
    for step in range(steps):
        drawn = sampler.sample(logits_for(step, len(names)), slots, [OPTIONS[n] for n in names])
        for name, d in zip(names, drawn, strict=True):
            out[name].append((d.token_id, d.logprob, d.top_logprobs))
    return out


def test_each_option_gives_the_same_tokens_alone_and_batched() -> None:
    names = list(OPTIONS)
    batched = run(names, slots=list(range(3, 3 + len(names))))
    for i, name in enumerate(names):
        alone = run([name], slots=[i % 2])[name]
        assert [t for t, _, _ in alone] == [t for t, _, _ in batched[name]], name
        for (_, lp_a, top_a), (_, lp_b, top_b) in zip(alone, batched[name], strict=True):
            assert lp_a == pytest.approx(lp_b, abs=1e-6) if lp_a is not None else lp_b is None
            assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_each_option_changes_what_is_drawn() -> None:
    """Each knob moves the tokens away from the plain seeded draw (the test would pass if a knob
    were ignored only by accident of the logits, and the logits are fixed)."""
    names = list(OPTIONS)
    streams = {n: [t for t, _, _ in s] for n, s in run(names, slots=list(range(len(names)))).items()}
    base = run(["plain"], slots=[0])["plain"]
    for name in ("top_k", "top_p", "min_p", "repetition", "frequency", "presence", "bias"):
        params = OPTIONS[name]
        plain_same_seed = SamplingParams(temperature=params.temperature, seed=params.seed)
        sampler = Sampler(num_slots=1, vocab_size=VOCAB, device=CPU)
        sampler.observe_prompt(0, PROMPT)
        unfiltered = [
            sampler.sample(logits_for(step, 1), [0], [plain_same_seed])[0].token_id for step in range(12)
        ]
        assert streams[name] != unfiltered, name
    assert [t for t, _, _ in base] == streams["plain"]


def test_filters_hold_on_every_draw() -> None:
    """top-k / top-p / min-p keep every drawn token inside their sets; bias -100 is never drawn."""
    for step in range(12):
        logits = logits_for(step, 1)[0]
        probs = torch.softmax(logits, -1)
        streams = run(["top_k", "top_p", "min_p", "bias"], slots=[0, 1, 2, 3], steps=step + 1)
        assert streams["top_k"][step][0] in logits.topk(5).indices.tolist()
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        assert streams["top_p"][step][0] in order[mass_before < 0.6].tolist()
        assert probs[streams["min_p"][step][0]] >= 0.2 * probs.max()
        assert streams["bias"][step][0] != 8


def test_seeded_draws_follow_the_distribution() -> None:
    """Across seeds, a row's first draw lands on each token with the token's probability."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 3000
    sampler = Sampler(num_slots=n, vocab_size=4, device=CPU)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    out = sampler.sample(probs.log().expand(n, 4).contiguous(), list(range(n)), params)
    freq = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_a_seed_beyond_int64_and_its_wrapped_value_give_one_stream() -> None:
    """Seeds are 64-bit patterns: 2**64 - 1 and -1 name the same generator."""
    logits = logits_for(0, 2)
    sampler = Sampler(num_slots=2, vocab_size=VOCAB, device=CPU)
    a, b = sampler.sample(
        logits, [0, 1], [SamplingParams(temperature=1.0, seed=(1 << 64) - 1), SamplingParams(seed=-1)]
    )
    assert a.token_id == b.token_id


def test_draw_returns_before_collect_and_collect_reads_the_tokens() -> None:
    sampler = Sampler(num_slots=2, vocab_size=VOCAB, device=CPU)
    logits = logits_for(0, 2)
    draw = sampler.draw(logits, [0, 1], [OPTIONS["greedy"], OPTIONS["greedy_logprobs"]])
    assert draw.tokens.tolist() == [int(logits[0].argmax())] * 2
    first, second = sampler.collect(draw)
    assert first.token_id == second.token_id == int(logits[0].argmax())
    assert second.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)
    assert second.top_logprobs == ()  # logprobs=0: the sampled token only
