"""The rule that sizes a step's prompt tokens beside running decodes from measured step times."""

from __future__ import annotations

import pytest
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.prompt_budget import PromptBudget

from ballast.settings import ConfigError


def test_unmeasured_or_off_it_takes_the_whole_busy_chunk() -> None:
    budget = PromptBudget(0.060)
    assert budget.tokens(2048) == 2048  # nothing measured yet
    budget.observe(32, 0, 0.020)
    assert budget.tokens(2048) == 2048  # no mixed step yet: no cost per prompt token
    off = PromptBudget(0.0)
    off.observe(32, 0, 0.020)
    off.observe(32, 1024, 0.120)
    assert off.tokens(2048) == 2048


def test_the_budget_fills_the_target_left_by_the_decodes_in_powers_of_two() -> None:
    """Decode-only steps 20 ms; a step with 1,024 prompt tokens 120 ms: 0.098 ms a token. A 60 ms
    target leaves 40 ms: 408 tokens, 256 as a power of two; 100 ms leaves 816 -> 512."""
    budget = PromptBudget(0.060)
    budget.observe(32, 0, 0.020)
    budget.observe(32, 1024, 0.120)
    assert budget.decode_s == pytest.approx(0.020)
    assert budget.token_s == pytest.approx(0.1 / 1024)
    assert budget.tokens(2048) == 256
    assert budget.tokens(128) == 128  # never past the engine's busy chunk
    wide = PromptBudget(0.100)
    wide.observe(32, 0, 0.020)
    wide.observe(32, 1024, 0.120)
    assert wide.tokens(2048) == 512


def test_decodes_over_the_target_still_let_prompts_advance_by_the_floor() -> None:
    budget = PromptBudget(0.030, floor=64)
    budget.observe(128, 0, 0.043)
    budget.observe(128, 512, 0.090)
    assert budget.tokens(2048) == 64
    assert budget.tokens(32) == 32


def test_measurements_follow_the_batch_and_ignore_steps_without_decodes_or_signal() -> None:
    budget = PromptBudget(0.060)
    budget.observe(0, 4096, 0.5)  # a prompt alone: not a step any stream waits on
    budget.observe(32, 8, 0.5)  # too few prompt tokens to tell from a decode step
    assert budget.decode_s is None and budget.token_s is None
    budget.observe(32, 0, 0.020)
    for _ in range(40):  # the batch grew: decode steps now take 40 ms
        budget.observe(96, 0, 0.040)
    assert budget.decode_s == pytest.approx(0.040, rel=1e-3)
    budget.observe(96, 1000, 0.140)
    assert budget.tokens(4096) == 128  # 20 ms left at 0.1 ms a token: 200 -> 128


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError):
        PromptBudget(-1.0)
    with pytest.raises(ValueError):
        PromptBudget(0.05, floor=0)
    with pytest.raises(ConfigError):
        SchedulerConfig(max_itl_ms=-5)
