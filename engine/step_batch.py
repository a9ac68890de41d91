"""The one builder of a step's `StepBatch`, from its plan: the rows the step runs, in plan order
(prefill chunks, then decode tokens), with what each row asks (a sampled token, every token's
logits, its token fed from the device), checked against what the engine can run."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Callable, Sequence

from ballast.engine.graphs import PAD_TOKEN
from ballast.engine.plan import PlanError, StepPlan
from ballast.models.base import StepBatch


def build_batch(
    plan: StepPlan,
    skip: frozenset[int],
    num_slots: int,
    max_model_len: int,
    vocab: int,
    has_drawn: Callable[[int], bool],
) -> StepBatch | None:
    """The batch of the plan's sequences but those of the slots in `skip` (None: none is left).
    A row fed from the device holds PAD_TOKEN on the host; its slot must have drawn a token."""
    named = [p.slot for p in plan.prefills] + [d.slot for d in plan.decodes]
    check_slots(num_slots, [s for s in named if s not in skip])
    slots: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    tokens = array("q")
    sampled: list[bool] = []
    every: list[bool] = []
    fed: list[bool] = []
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
        fed.append(False)
    for d in plan.decodes:
        if d.slot in skip:
            continue
        if d.from_device:
            if not has_drawn(d.slot):
                raise PlanError(f"slot {d.slot}: a decode fed from the device, but it has drawn no token")
        elif not 0 <= d.token_id < vocab:
            raise PlanError(f"slot {d.slot}: token ids must be in 0..{vocab - 1}")
        slots.append(d.slot)
        starts.append(d.pos)
        lens.append(1)
        tokens.append(PAD_TOKEN if d.from_device else d.token_id)
        sampled.append(True)
        every.append(False)
        fed.append(d.from_device)
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
        from_device=tuple(fed) if any(fed) else (),
    )


def check_slots(num_slots: int, slots: Sequence[int]) -> None:
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad:
        raise PlanError(f"slots {bad} out of range 0..{num_slots - 1}")
