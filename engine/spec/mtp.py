"""Drafts from the model's multi-token-prediction layer (`--speculative-config` method "mtp").

After each step, once its tokens are known, the MTP layer runs over the positions the step kept,
each with the token that followed it (what the step fed next, and at the last kept position the
token the step emitted) and the target's hidden state there; that writes the layer's KV for those
positions, and its logits at the last one give the first draft. Each further draft is one more
pass, one position on, fed the draft before it and the layer's own output in place of the
target's hidden state. Drafts are greedy (one token proposed with certainty), which the verifier
accepts with exactly the target's probability of it, so sampled outputs keep their distribution.

A prompt chunk that does not end its prompt leaves its last position for the next chunk (the
token after it is that chunk's first). The drafts go back with the step's result as proposals for
the slot's next decode (`StepResult.proposals`); the planner uses them while the governor drafts.
A step of more emitting slots than may draft (verify rows: none from `max_streams` on) runs the
first pass alone, for the layer's KV: k heads and k - 1 passes would be drafts no step verifies.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from ballast.engine.plan import SlotOutput
from ballast.models.base import StepBatch
from ballast.models.layers.state import LayerState
from torch import Tensor


class DraftingModel(Protocol):
    last_hidden: Tensor | None

    def mtp_forward(
        self, batch: StepBatch, hidden: Tensor, states: list[LayerState], depth: int = 0
    ) -> Tensor: ...

    def mtp_logits(self, normed: Tensor) -> Tensor: ...


# (slot, position of the token its next decode feeds, drafts for the positions after it)
Proposal = tuple[int, int, tuple[int, ...]]


class MTPDrafter:
    """Engine thread only. `ensure(slot, n)`: the slot's KV blocks cover n positions (False: no
    blocks to be had: it drafts fewer); `place(batch)`: a batch marked for its KV store and put
    on the device."""

    def __init__(
        self,
        model: DraftingModel,
        states: list[LayerState],
        k: int,
        ensure: Callable[[int, int], bool],
        place: Callable[[StepBatch], StepBatch],
        max_len: int,
        max_rows: int = 0,
    ) -> None:
        self._model = model
        self._max_rows = max_rows  # the most emitting slots a step drafts for (0: any number)
        self._states = states
        self.k = k
        self._ensure = ensure
        self._place = place
        self._max_len = max_len
        self._step: tuple[StepBatch, Tensor] | None = None
        # slot -> (position, hidden state) of a prompt chunk's last position, whose next token
        # is the next chunk's first
        self._pending: dict[int, tuple[int, Tensor]] = {}

    def ran(self, batch: StepBatch | None) -> None:
        """A step's forward ran over `batch`: keep its hidden states for `propose`."""
        hidden = self._model.last_hidden
        self._step = None if batch is None or hidden is None else (batch, hidden)

    def forget(self) -> None:
        """A step failed: nothing of it drafts."""
        self._step = None

    def drop(self, slots: Sequence[int]) -> None:
        """The slots' sequences ended or were dropped: nothing of theirs waits for a next chunk."""
        for slot in slots:
            self._pending.pop(slot, None)

    def propose(self, outputs: Sequence[SlotOutput], drafting: frozenset[int]) -> tuple[Proposal, ...]:
        """After the step's tokens are known (`outputs`, in order per slot; `drafting`: the slots
        that verified drafts, which keep only the positions their outputs stand for): the MTP
        layer's pass over what each slot kept, and k drafts for every slot that emitted a token."""
        step, self._step = self._step, None
        if step is None:
            return ()
        batch, hidden = step
        emitted: dict[int, list[int]] = {}
        for out in outputs:
            emitted.setdefault(out.slot, []).append(out.token_id)
        rows: list[tuple[int, list[int], int]] = []  # (slot, the token after each position, first position)
        parts: list[Tensor] = []
        offset = 0
        for slot, start, n in zip(batch.slots_list, batch.starts_list, batch.lens_list, strict=True):
            fed = list(batch.tokens[offset : offset + n])
            own = hidden[offset : offset + n]
            offset += n
            first, nexts = start, fed[1:]  # positions start .. start + n - 2 know their next token
            pending = self._pending.pop(slot, None)
            if pending is not None and pending[0] == start - 1:  # the last chunk's last position
                first, nexts, own = start - 1, fed, torch.cat([pending[1][None], own])
            tokens = emitted.get(slot)
            if tokens is None:  # a prompt chunk before its prompt's end: its last position waits
                self._pending[slot] = (start + n - 1, own[-1].clone())
            else:  # a drafting row keeps the positions its outputs stand for; others all they fed
                kept = len(tokens) if slot in drafting else n
                nexts = nexts[: start - first + kept - 1] + [tokens[-1]]
            if nexts:
                rows.append((slot, nexts, first))
                parts.append(own[: len(nexts)])
        if not rows:
            return ()
        return self._draft(rows, torch.cat(parts), set(emitted))

    def _draft(
        self, rows: list[tuple[int, list[int], int]], hidden: Tensor, emitting: set[int]
    ) -> tuple[Proposal, ...]:
        model = self._model
        drafts: dict[int, list[int]] = {slot: [] for slot, _, _ in rows if slot in emitting}
        ends = {slot: start + len(tokens) for slot, tokens, start in rows}  # next decode's position
        with torch.inference_mode():
            normed = model.mtp_forward(self._batch(rows), hidden, self._states)
            if 0 < self._max_rows < len(drafts):
                return ()  # the layer's KV is written; no step verifies drafts at this batch
            last = torch.cumsum(torch.tensor([len(t) for _, t, _ in rows]), 0) - 1
            normed = normed.index_select(0, last.to(normed.device))
            keep = [i for i, (slot, _, _) in enumerate(rows) if slot in drafts]
            slots = [rows[i][0] for i in keep]
            if len(keep) < len(rows):
                normed = normed.index_select(0, torch.tensor(keep, dtype=torch.long, device=normed.device))
            for depth in range(self.k):
                if not slots:
                    break
                picked = model.mtp_logits(normed).argmax(dim=-1).tolist()
                for slot, token in zip(slots, picked, strict=True):
                    drafts[slot].append(int(token))
                if depth + 1 == self.k:
                    break
                # one position on: each slot's draft at its next position, where blocks allow
                go = [
                    i
                    for i, s in enumerate(slots)
                    if ends[s] + depth < self._max_len and self._ensure(s, ends[s] + depth + 1)
                ]
                slots = [slots[i] for i in go]
                if not slots:
                    break
                normed = normed.index_select(0, torch.tensor(go, dtype=torch.long, device=normed.device))
                step = [(s, [drafts[s][-1]], ends[s] + depth) for s in slots]
                normed = model.mtp_forward(self._batch(step), normed, self._states, depth + 1)
        return tuple((slot, ends[slot], tuple(d)) for slot, d in drafts.items())

    def _batch(self, rows: list[tuple[int, list[int], int]]) -> StepBatch:
        tokens = array("q", [t for _, ts, _ in rows for t in ts])
        return self._place(
            StepBatch.of_lists(
                [s for s, _, _ in rows], [p for _, _, p in rows], [len(t) for _, t, _ in rows], tokens
            )
        )
