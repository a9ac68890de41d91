"""The executor's drafting half of a step: which rows verify drafts, their states kept before the
forward, and after it the verdicts, the outputs and the rollback of what was rejected."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ballast.engine.plan import DecodeToken, SamplingParams, SlotOutput, StepPlan
from ballast.engine.spec.rollback import StateRollback
from ballast.engine.spec.verify import verify
from ballast.engine.step.sampler import Sampler
from ballast.engine.workspace import VerifySize
from ballast.models.base import LayerState, StepBatch
from torch import Tensor


class DraftVerifier:
    """Engine thread only. `truncate(slot, n)`: the slot keeps its first n positions (fed record
    and KV blocks); size: the verify steps the recurrent states keep per-position states for."""

    def __init__(
        self,
        sampler: Sampler,
        states: Sequence[LayerState],
        truncate: Callable[[int, int], None],
        max_model_len: int,
        size: VerifySize,
    ) -> None:
        self._sampler = sampler
        self._rollback = StateRollback(states, size)
        self._truncate = truncate
        self._max_model_len = max_model_len
        self._rows: list[DecodeToken] = []

    def before(self, plan: StepPlan, skip: frozenset[int], batch: StepBatch | None) -> None:
        """Before the forward: the plan's drafting rows that run; the batch marked to keep their
        per-position states."""
        self._rows = [d for d in plan.decodes if d.draft and d.slot not in skip]
        self._rollback.save({d.slot: len(d.draft) for d in self._rows}, batch)

    def after(self, logits: dict[int, Tensor], sampling: dict[int, SamplingParams]) -> tuple[SlotOutput, ...]:
        """The verdicts on this step's drafts (logits: per drafting slot, one row per position):
        one output per emitted token, in order; rejected positions rolled back."""
        rows, self._rows = self._rows, []
        if not rows:
            return ()
        verdicts = verify(
            self._sampler,
            [logits[d.slot] for d in rows],
            [d.slot for d in rows],
            [d.draft for d in rows],
            [sampling[d.slot] for d in rows],
        )
        cut: list[tuple[int, int]] = []
        outputs: list[SlotOutput] = []
        for d, v in zip(rows, verdicts, strict=True):
            kept = d.pos + 1 + v.accepted  # positions whose tokens stand: the fed one and the accepted drafts
            self._truncate(d.slot, kept)
            if v.accepted < v.drafts:
                cut.append((d.slot, v.accepted))
            outputs += [
                SlotOutput(
                    d.slot, t.token_id, t.logprob, t.top_logprobs, d.pos + 1 + j >= self._max_model_len
                )
                for j, t in enumerate(v.tokens)
            ]
        self._rollback.restore(cut)
        return tuple(outputs)

    def forget(self) -> None:
        """A step failed: nothing of it is verified (its sequences are dropped)."""
        self._rows = []
        self._rollback.save({}, None)
