"""Undoing the rejected positions of a verify step, per slot, on the engine thread.

Attention KV can simply be cut: the positions past the accepted ones are never read (a sequence
attends to what it has been fed) and the blocks that only they reached go back to the pool. A
recurrent (gated-delta, convolution) state has consumed every drafted token and cannot be cut, so
it is copied before the step and, where a draft was rejected, restored and run forward over the
accepted tokens only (a chunk of at most k + 1 tokens, no logits kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from ballast.models.base import LayerState
from torch import Tensor

Snapshot = list[tuple[Tensor, ...]]  # per layer, the slot's state tensors (none for attention)
# Runs the model over rows (slot, token ids, start position) and writes their states.
Recompute = Callable[[list[tuple[int, list[int], int]]], object]


class StateRollback:
    """Copies of the drafting slots' recurrent states, taken before a verify step."""

    def __init__(self, states: Sequence[LayerState]) -> None:
        self._states = states
        self._recurrent = any(s.slot_views(0) for s in states) if states else False
        self._saved: dict[int, Snapshot] = {}

    def save(self, slots: Sequence[int]) -> None:
        """Before the forward: keep each slot's state (nothing for a model of attention alone)."""
        self._saved = {}
        if not self._recurrent:
            return
        for slot in slots:
            self._saved[slot] = [tuple(t.clone() for t in s.slot_views(slot)) for s in self._states]

    def restore(self, rows: Sequence[tuple[int, list[int], int]], recompute: Recompute) -> None:
        """After the verdicts: each row (slot, accepted tokens fed from its start, start position)
        whose draft was cut gets back its state from before the step, then consumes the accepted
        tokens again. Rows of an attention-only model need nothing here."""
        if not self._saved or not rows:
            self._saved = {}
            return
        with torch.inference_mode():
            for slot, _, _ in rows:
                for state, saved in zip(self._states, self._saved[slot], strict=True):
                    if saved:
                        state.load(slot, saved)
        recompute(list(rows))
        self._saved = {}
