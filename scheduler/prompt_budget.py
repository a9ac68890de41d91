"""How many prompt tokens a step may carry beside running decodes, from measured step times.

Every running stream waits for each step: a step that prefills a long prompt chunk is an inter-token
gap for all of them (the 80B at 32 streams: ITL p99 ~340 ms where a decode step is 20 ms). So a
step's prompt tokens are sized so that the step stays within `max_itl_s`: the step time is modelled
as base + cost x prompt tokens, base measured on decode-only steps and the cost of a prompt token
on steps that carried both (each an exponential average, so the model follows the batch as it
grows and prompts as they lengthen). Before a mixed step has been measured there is no cost to go
by, and the step takes the whole busy chunk: the first such step measures it. A prompt always
advances by at least `floor` tokens, even when the decodes alone exceed the target: starving
prompts would only move the wait from ITL to TTFT without bound. Budgets are powers of two, so
prompt steps meet a handful of shapes (the compiled and captured ones), not one per measurement.
"""

from __future__ import annotations

# Weight of the newest measurement in each average: a few steps' memory, since a step's cost moves
# as the batch and the prompts change.
SMOOTHING = 0.25
# Mixed steps with fewer prompt tokens than this are not used for the per-token cost: their
# difference from a decode step is mostly noise.
MIN_MEASURED_TOKENS = 16


class PromptBudget:
    def __init__(self, max_itl_s: float, floor: int = 64) -> None:
        """max_itl_s: the longest a step beside decodes should take; 0 = no limit (the engine's
        busy chunk). floor: the least prompt tokens such a step carries."""
        if max_itl_s < 0 or floor < 1:
            raise ValueError(f"need max_itl_s >= 0 and floor >= 1, got {max_itl_s}, {floor}")
        self.max_itl_s = max_itl_s
        self.floor = floor
        self.decode_s: float | None = None  # a decode-only step
        self.token_s: float | None = None  # what one prompt token adds to a step with decodes

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """A step of `decodes` decode rows and `prompt_tokens` prompt tokens took `seconds` on the
        engine (from its start, or the end of the step before, to its result)."""
        if decodes == 0 or seconds <= 0:
            return
        if prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif prompt_tokens >= MIN_MEASURED_TOKENS and self.decode_s is not None:
            per_token = max(0.0, seconds - self.decode_s) / prompt_tokens
            self.token_s = _average(self.token_s, per_token)

    def tokens(self, ceiling: int) -> int:
        """Prompt tokens for the next step with decodes: at most `ceiling` (the engine's busy
        chunk), at least the floor (or the ceiling, if lower)."""
        if self.max_itl_s <= 0 or self.decode_s is None or not self.token_s:
            return ceiling
        fit = int((self.max_itl_s - self.decode_s) / self.token_s)
        if fit < self.floor:
            return min(self.floor, ceiling)
        return min(1 << (fit.bit_length() - 1), ceiling)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
