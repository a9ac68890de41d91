"""The one builder of a step's `StepBatch` from its plan (prefill chunks, then decodes, checked),
and the owner of decode rows fed from the device (`DecodeToken.from_device`): such a row holds
LAST_SAMPLED on the host, `fill_tokens` puts the slot's last draw in its place on the device, and
`DeviceFed` keeps the host's side."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Callable, Sequence

import torch
from ballast.engine.plan import PlanError, StepPlan
from ballast.engine.step.pipeline import DrawnRow
from ballast.engine.step.sampler import Sampler
from ballast.models.base import StepBatch
from torch import Tensor


def build_batch(
    plan: StepPlan, skip: frozenset[int], num_slots: int, max_model_len: int, sampler: Sampler
) -> StepBatch | None:
    """The batch of the plan's sequences but those of the slots in `skip` (None: none is left).
    A row fed from the device needs its slot to have drawn a token."""
    named = [p.slot for p in plan.prefills] + [d.slot for d in plan.decodes]
    check_slots(num_slots, [s for s in named if s not in skip])
    vocab = sampler.vocab_size
    slots: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    tokens = array("q")
    sampled: list[bool] = []
    every: list[bool] = []
    fed = False
    for p in plan.prefills:
        if p.slot in skip:
            continue
        if not p.token_ids:
            raise PlanError(f"slot {p.slot}: a prefill chunk of no tokens")
        if min(p.token_ids) < 0 or max(p.token_ids) >= vocab:
            raise PlanError(f"slot {p.slot}: token ids must be in 0..{vocab - 1}")
        slots.append(p.slot)
        starts.append(p.start_pos)
        lens.append(len(p.token_ids))
        tokens.extend(p.token_ids)
        sampled.append(p.sample)
        every.append(bool(p.logprob_targets))
    for d in plan.decodes:
        if d.slot in skip:
            continue
        if d.draft and (d.from_device or min(d.draft) < 0 or max(d.draft) >= vocab):
            raise PlanError(
                f"slot {d.slot}: a draft needs its last token on the host and ids in 0..{vocab - 1}"
            )
        if d.from_device:
            if not sampler.has_drawn(d.slot):
                raise PlanError(f"slot {d.slot}: a decode fed from the device, but it has drawn no token")
            fed = True
        elif not 0 <= d.token_id < vocab:
            raise PlanError(f"slot {d.slot}: token ids must be in 0..{vocab - 1}")
        slots.append(d.slot)
        starts.append(d.pos)
        lens.append(1 + len(d.draft))
        tokens.append(d.token_id)
        tokens.extend(d.draft)
        # A drafting row is verified position by position (engine.spec), not drawn with the rest.
        sampled.append(not d.draft)
        every.append(bool(d.draft))
    if not slots:
        return None
    if max(map(operator.add, starts, lens)) > max_model_len:
        slot, end = next(
            (s, a + n) for s, a, n in zip(slots, starts, lens, strict=True) if a + n > max_model_len
        )
        raise PlanError(f"slot {slot}: positions up to {end - 1} exceed max_model_len {max_model_len}")
    return StepBatch.of_lists(
        slots,
        starts,
        lens,
        tokens,
        all_logits=tuple(every) if any(every) else (),
        sampled=tuple(sampled),
        fill_tokens=_last_drawn(sampler.last_tokens) if fed else None,
    )


def _last_drawn(last_tokens: Tensor) -> Callable[[Tensor, Tensor], None]:
    """The fill of the rows fed from the device: each LAST_SAMPLED (negative) token id becomes the
    last token its slot drew (`last_tokens`, by slot), in stream order, with no host sync."""

    def fill(token_ids: Tensor, slots: Tensor) -> None:
        token_ids.copy_(torch.where(token_ids < 0, last_tokens[slots], token_ids))

    return fill


def check_slots(num_slots: int, slots: Sequence[int]) -> None:
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad:
        raise PlanError(f"slots {bad} out of range 0..{num_slots - 1}")


class DeviceFed:
    """The host's side of decode rows fed from the device: which of them a step skips, and when the
    slot's fed record (`SlotKV`, which parks by it) learns the token it holds a placeholder for.
    One owner, on the engine thread."""

    def __init__(self, fed_at: Callable[[int, int, int], None]) -> None:
        self._fed_at = fed_at
        # Slots whose sequence the last launched step preempted or dropped: a next plan built
        # before that step's result came back may still decode them from the device; skipped.
        self.gone: frozenset[int] = frozenset()
        # slot -> (position, token) of the last finished step's draws: a plan launched after that
        # finish feeds them from the device, and the slot's fed record takes the token at once.
        self._settled: dict[int, tuple[int, int]] = {}
        # slot -> position a launched step fed from the device before its token was collected.
        self._waiting: dict[int, int] = {}

    def skipped(self, plan: StepPlan) -> frozenset[int]:
        """The plan's device-fed decodes of slots the last step dropped."""
        return frozenset(d.slot for d in plan.decodes if d.from_device and d.slot in self.gone)

    def launched(self, plan: StepPlan, gone: frozenset[int]) -> None:
        """The plan's step runs without the slots in `gone` (preempted or skipped)."""
        self.gone = gone
        settled, self._settled = self._settled, {}
        for d in plan.decodes:
            if not d.from_device or d.slot in gone:
                continue
            drawn = settled.get(d.slot)
            if drawn is not None and drawn[0] == d.pos:
                self._fed_at(d.slot, d.pos, drawn[1])
            else:
                self._waiting[d.slot] = d.pos

    def finished(self, rows: Sequence[DrawnRow], tokens: Sequence[int]) -> None:
        """A step's draws reached the host: a step launched before fed them from the device."""
        waiting, self._waiting = self._waiting, {}
        self._settled = {}
        for (slot, pos, _), token in zip(rows, tokens, strict=True):
            if waiting.get(slot) == pos:
                self._fed_at(slot, pos, token)
            self._settled[slot] = (pos, token)

    def dropped(self, slots: frozenset[int]) -> None:
        """A failed step's slots lost their sequences."""
        self.gone = slots
        self._waiting = {s: p for s, p in self._waiting.items() if s not in slots}
