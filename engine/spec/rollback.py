"""Undoing the rejected positions of a verify step, per slot, on the engine thread.

Attention KV can simply be cut: the positions past the accepted ones are never read (a sequence
attends to what it has been fed) and the blocks that only they reached go back to the pool. A
recurrent (gated-delta, convolution) state has consumed every drafted token and cannot be cut; but
the verify step computes the state after each of its positions anyway (the rule runs a verify row
token by token), so the batch marks its drafting rows (`StepBatch.verify`), the layers keep those
states in the workspace the engine was loaded with (`VerifySize`), and the rollback copies the one
after the last accepted token into the slot: no second forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ballast.engine.plan import PlanError
from ballast.engine.workspace import VerifySize
from ballast.models.base import LayerState, StepBatch


class StateRollback:
    """The drafting slots' way back to the state after their last accepted token."""

    def __init__(self, states: Sequence[LayerState], size: VerifySize) -> None:
        self._states = states
        self._recurrent = any(s.slot_views(0) for s in states) if states else False
        self._size = size
        self._rows: dict[int, int] = {}  # slot -> its verify row in the step that runs

    def save(self, drafts: dict[int, int], batch: StepBatch | None) -> None:
        """Before the forward, for the drafting slots (slot -> its drafts): mark the batch to keep
        their per-position states (nothing for a model of attention alone)."""
        self._rows = {}
        if not self._recurrent or not drafts or batch is None:
            return
        if len(drafts) > self._size.rows or max(drafts.values()) > self._size.drafts:
            raise PlanError(
                f"{len(drafts)} drafting rows of up to {max(drafts.values())} drafts; this engine keeps "
                f"the states of {self._size.rows} of {self._size.drafts} (Engine.load(verify=...))"
            )
        batch.verify = tuple(slot in drafts for slot in batch.slots_list)
        self._rows = {slot: i for i, slot in enumerate(s for s in batch.slots_list if s in drafts)}

    def restore(self, rows: Sequence[tuple[int, int]]) -> None:
        """After the verdicts: each (slot, accepted drafts) whose draft was cut gets the state its
        verify row kept after its last accepted position. Rows of an attention-only model need
        nothing here."""
        kept, self._rows = self._rows, {}
        if not kept:
            return
        with torch.inference_mode():
            for slot, accepted in rows:
                for state in self._states:
                    state.roll_back(slot, kept[slot], accepted)
