"""Checkpoint copies of slot states, kept off the step's critical path.

On CUDA a checkpoint's device-to-host copies run on a side stream: it waits (on the device) for an
event the step's stream records after the forward that produced the state, so it copies exactly
that state, then copies into the pinned buffer and records a `done` event. The host never waits.
Three later users order themselves after `done`, each on the device:
- a write to the slot's state (the next forward, a reset, a restore into the slot): `settle(slots)`
  makes the step's stream wait for those slots' pending copies, and only theirs, so a finished
  request's save never holds up the other sequences;
- a restore from the buffer: the step's stream waits for that checkpoint's `done`;
- the buffer going back to the pool (eviction, shed): the step's stream waits for `done` first, so
  whoever takes the buffer next (a save on the side stream is ordered after the step's stream by
  its own event; a parked sequence's copy runs on the step's stream) finds the copy complete.
On the CPU the copies are plain synchronous copies and there is no event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


class StateCopies:
    """The side stream and the per-slot pending copies of one device (engine thread only)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> `done` of its latest save

    def copy_out(self, slot: int, pairs: Sequence[tuple[Tensor, Tensor]]) -> torch.cuda.Event | None:
        """Copy each (device source, host destination) of the slot's state; returns the event that
        marks them done (None on the CPU, where they are done on return)."""
        if self._stream is None:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        # The side stream runs in order, so the latest save's event covers the slot's earlier ones.
        self._pending[slot] = done
        return done

    def settle(self, slots: Iterable[int]) -> None:
        """The step's stream is about to write these slots' states: it waits for their copies."""
        if not self._pending:
            return
        stream = torch.cuda.current_stream(self.device)
        for slot in slots:
            done = self._pending.pop(slot, None)
            if done is not None:
                stream.wait_event(done)

    def after(self, done: torch.cuda.Event | None) -> None:
        """The step's stream waits for one save's copies (its buffer is read or given back next)."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def pending_slots(self) -> frozenset[int]:
        """Slots whose state a save may still be reading (no write may reach them unsettled)."""
        return frozenset(self._pending)
