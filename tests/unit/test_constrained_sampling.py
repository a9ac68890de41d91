"""Constrained decoding and logit_bias inside the batched sampler, with the default model's real
tokenizer (llguidance needs one) and random logits standing in for a model."""

from __future__ import annotations

import json
from collections.abc import Sequence

import jsonschema
import pytest
import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.step.sampler import Sampler
from ballast.engine.text.grammar import GrammarCompiler, GrammarError
from ballast.engine.text.tokenizer import Tokenizer
from ballast.models.weights.default_model import default_model_path
from ballast.models.weights.gguf_loader import build_tokenizer, read_gguf

CPU = torch.device("cpu")
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tokenizer(read_gguf(default_model_path()).metadata))


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids)


def run(
    sampler: Sampler,
    slots: Sequence[int],
    params: Sequence[SamplingParams],
    steps: int,
    seed: int,
    stop: frozenset[int],
) -> list[list[int]]:
    """Sample `steps` tokens per slot from seeded random logits; a slot that drew a stop id stops."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in slots]
    for _ in range(steps):
        logits = torch.randn(len(slots), sampler.vocab_size, generator=gen) * 4
        live = [i for i in range(len(slots)) if not (out[i] and out[i][-1] in stop)]
        if not live:
            break
        drawn = sampler.sample(logits[live], [slots[i] for i in live], [params[i] for i in live])
        for i, d in zip(live, drawn, strict=True):
            out[i].append(d.token_id)
    return out


def test_constrained_rows_follow_the_schema_and_free_rows_are_untouched(
    tok: Tokenizer, compiler: GrammarCompiler
) -> None:
    constraint = compiler.constraint(compiler.json_schema(SCHEMA), len(PROMPT))
    free = SamplingParams(temperature=1.0, seed=7)
    bound = SamplingParams(temperature=1.0, seed=11, constraint=constraint)
    sampler = Sampler(num_slots=4, vocab_size=tok.vocab_size, device=CPU)
    mixed = run(sampler, [0, 1, 2], [bound, free, bound], 40, seed=3, stop=tok.eos_token_ids)
    for tokens in (mixed[0], mixed[2]):
        assert tokens[-1] in tok.eos_token_ids  # the grammar finished and allowed only end of turn
        jsonschema.validate(json.loads(tok.decode(tokens[:-1])), SCHEMA)
    unconstrained = Sampler(num_slots=4, vocab_size=tok.vocab_size, device=CPU)
    same_batch = run(unconstrained, [0, 1, 2], [free, free, free], len(mixed[1]), seed=3, stop=frozenset())
    assert (
        mixed[1] == same_batch[1][: len(mixed[1])]
    )  # the free row drew what it draws with no grammar near it


def test_a_resumed_sequence_replays_its_output_into_a_new_matcher(
    tok: Tokenizer, compiler: GrammarCompiler
) -> None:
    constraint = compiler.constraint(compiler.json_schema(SCHEMA), len(PROMPT))
    params = SamplingParams(temperature=0.0, constraint=constraint)
    whole = Sampler(num_slots=2, vocab_size=tok.vocab_size, device=CPU)
    whole.observe_prompt(0, PROMPT)
    expected = run(whole, [0], [params], 40, seed=5, stop=tok.eos_token_ids)[0]

    resumed = Sampler(num_slots=2, vocab_size=tok.vocab_size, device=CPU)
    resumed.observe_prompt(0, PROMPT)
    gen = torch.Generator().manual_seed(5)
    got: list[int] = []
    for step in range(len(expected)):
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 4
        if step == 4:  # preempted and resumed in another slot: fed prompt + output again
            resumed.reset([0])
            resumed.observe_prompt(1, PROMPT + got)
        got.append(resumed.sample(logits, [0 if step < 4 else 1], [params])[0].token_id)
    assert got == expected


def test_logit_bias_moves_tokens_and_logprobs_stay_the_models() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0]])
    sampler = Sampler(num_slots=2, vocab_size=4, device=CPU)
    [plain] = sampler.sample(logits, [0], [SamplingParams(temperature=0.0, logprobs=0)])
    [banned] = sampler.sample(
        logits, [1], [SamplingParams(temperature=0.0, logprobs=0, logit_bias=((1, -100.0),))]
    )
    [pushed] = sampler.sample(
        logits, [1], [SamplingParams(temperature=0.0, logit_bias=((3, 10.0), (1, -1.0)))]
    )
    assert (plain.token_id, banned.token_id, pushed.token_id) == (1, 2, 3)
    assert banned.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


def test_an_invalid_schema_is_a_grammar_error(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError):
        compiler.constraint(compiler.json_schema({"type": "object", "properties": {"a": {"type": "wat"}}}), 0)
    with pytest.raises(GrammarError):
        compiler.constraint(compiler.lark("start: undefined_rule"), 0)
