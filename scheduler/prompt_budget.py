"""How many prompt tokens a step may carry beside running decodes, from measured step times.

Every running stream waits for each step: a step that prefills a long prompt chunk is an inter-token
gap for all of them (the 80B at 32 streams: ITL p99 ~340 ms where a decode step is 20 ms). So a
step's prompt tokens are sized so that the step stays within `max_itl_s`: the step time is modelled
as base + cost x prompt tokens, from the scheduler's one measure of step times (`StepCosts`, which
the queue-wait estimate projects with too): the base is a decode step of the rows the step carries
(measured at that row count, or between the nearest measured ones: more exact than one average
over all batch sizes, since a CPU step grows with its rows), the cost that of a prompt token beyond
a step's base. Until both are measured there is nothing to go by, and the step takes the whole busy
chunk: it measures them. A prompt always advances by at least `floor` tokens, even when the decodes
alone exceed the target: starving prompts would only move the wait from ITL to TTFT without bound.
Budgets are powers of two, so prompt steps meet a handful of shapes (the compiled and captured
ones), not one per measurement.
"""

from __future__ import annotations

from ballast.scheduler.service_rate import StepCosts


class PromptBudget:
    def __init__(self, max_itl_s: float, costs: StepCosts, floor: int = 64) -> None:
        """max_itl_s: the longest a step beside decodes should take; 0 = no limit (the engine's
        busy chunk). costs: the measured step times. floor: the least prompt tokens such a step carries."""
        if max_itl_s < 0 or floor < 1:
            raise ValueError(f"need max_itl_s >= 0 and floor >= 1, got {max_itl_s}, {floor}")
        self.max_itl_s = max_itl_s
        self.floor = floor
        self._costs = costs

    def tokens(self, ceiling: int, rows: int) -> int:
        """Prompt tokens for the next step beside `rows` decodes: at most `ceiling` (the engine's
        busy chunk), at least the floor (or the ceiling, if lower)."""
        base, per_token = self._costs.decode_s(rows), self._costs.prefill_token_s
        if self.max_itl_s <= 0 or base is None or not per_token:
            return ceiling
        fit = int((self.max_itl_s - base) / per_token)
        if fit < self.floor:
            return min(self.floor, ceiling)
        return min(1 << (fit.bit_length() - 1), ceiling)
