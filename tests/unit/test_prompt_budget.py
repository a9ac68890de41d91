"""The rule that sizes a step's prompt tokens beside running decodes from measured step times."""

from __future__ import annotations

import pytest
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.prompt_budget import PromptBudget
from ballast.scheduler.service_rate import StepCosts

from ballast.settings import ConfigError


def measured(*steps: tuple[int, int, float]) -> StepCosts:
    """Step costs fed these (decode rows, prompt tokens, seconds) steps."""
    costs = StepCosts()
    for rows, prompt, seconds in steps:
        costs.stepped(seconds, rows, prompt)
    return costs


def test_unmeasured_or_off_it_takes_the_whole_busy_chunk() -> None:
    costs = StepCosts()
    budget = PromptBudget(0.060, costs)
    assert budget.tokens(2048, 32) == 2048  # nothing measured yet
    costs.stepped(0.020, 32, 0)
    assert budget.tokens(2048, 32) == 2048  # no step with prompt tokens yet: no cost per prompt token
    off = PromptBudget(0.0, measured((32, 0, 0.020), (32, 1024, 0.120)))
    assert off.tokens(2048, 32) == 2048


def test_the_budget_fills_the_target_left_by_the_decodes_in_powers_of_two() -> None:
    """Decode-only steps 20 ms; a step with 1,024 prompt tokens 120 ms: 0.098 ms a token. A 60 ms
    target leaves 40 ms: 408 tokens, 256 as a power of two; 100 ms leaves 816 -> 512."""
    costs = measured((32, 0, 0.020), (32, 1024, 0.120))
    assert costs.decode_s(32) == pytest.approx(0.020)
    assert costs.prefill_token_s == pytest.approx(0.1 / 1024)
    budget = PromptBudget(0.060, costs)
    assert budget.tokens(2048, 32) == 256
    assert budget.tokens(128, 32) == 128  # never past the engine's busy chunk
    assert PromptBudget(0.100, costs).tokens(2048, 32) == 512


def test_decodes_over_the_target_still_let_prompts_advance_by_the_floor() -> None:
    budget = PromptBudget(0.030, measured((128, 0, 0.043), (128, 512, 0.090)), floor=64)
    assert budget.tokens(2048, 128) == 64
    assert budget.tokens(32, 128) == 32


def test_the_base_is_a_decode_step_of_the_rows_beside_and_too_few_prompt_tokens_measure_nothing() -> None:
    costs = StepCosts()
    budget = PromptBudget(0.060, costs)
    costs.stepped(0.5, 32, 8)  # too few prompt tokens to tell from a decode step
    costs.stepped(0.020, 32, 0)
    assert costs.prefill_token_s == 0.0 and budget.tokens(4096, 32) == 4096
    for _ in range(40):  # a bigger batch: its decode steps take 40 ms
        costs.stepped(0.040, 96, 0)
    assert costs.decode_s(96) == pytest.approx(0.040) and costs.decode_s(32) == pytest.approx(0.020)
    costs.stepped(0.140, 96, 1000)  # 0.1 ms a prompt token beyond the 96 rows' 40 ms
    assert budget.tokens(4096, 96) == 128  # 20 ms left at 0.1 ms a token: 200 -> 128
    assert budget.tokens(4096, 32) == 256  # beside 32 rows 40 ms left: 400 -> 256
    # A prompt alone costs a token what it costs beside decodes, beyond a step's base: it measures too.
    alone = measured((1, 0, 0.010), (0, 1000, 0.110))
    assert PromptBudget(0.060, alone).tokens(4096, 1) == 256  # 50 ms left at 0.1 ms: 500 -> 256


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError):
        PromptBudget(-1.0, StepCosts())
    with pytest.raises(ValueError):
        PromptBudget(0.05, StepCosts(), floor=0)
    with pytest.raises(ConfigError):
        SchedulerConfig(max_itl_ms=-5)
