"""Checkpoint copies of slot states, kept off the step's critical path.

On CUDA a checkpoint's device-to-host copy runs on a side stream and the host never waits:
- Staged (usual): the step's stream copies the slot's state into a device staging buffer laid out
  like the host one, and the side stream, after an event behind that copy, moves it to the pinned
  buffer in one transfer and records `done`; the slot is free for the next step at once. Staging
  in flight is bounded by what the ledger granted at load (`checkpoint_orders.staging_bytes`).
- Direct (staging full): the side stream copies from the slot itself, after the forward that
  produced the state, so a later write to that slot must wait for `done`: `settle(slots)` makes
  the step's stream wait for those slots' copies only.
A restore from the buffer, and the buffer's return to the pool, order themselves after `done` on
the device; the buffer goes back with a `fence` behind that wait, so the pool frees it only once
no copy can touch it. On the CPU the copies are plain synchronous copies and there is no event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

MiB = 1 << 20
STAGING_BYTES = 256 * MiB  # default staging in flight at once (always room for one checkpoint; 0: off)


class StateCopies:
    """The side stream and the copies in flight of one device (engine thread only)."""

    def __init__(self, device: torch.device, staging_bytes: int = STAGING_BYTES) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._staging_bytes = staging_bytes
        self._staged: deque[tuple[torch.cuda.Event, int]] = deque()  # (done, bytes) in flight
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> `done` of its latest direct copy

    def copy_out(
        self, slot: int, pairs: Sequence[tuple[Tensor, Tensor]], buf: Tensor, nbytes: int
    ) -> torch.cuda.Event | None:
        """Copy each (device source, host view into `buf`'s first `nbytes`) of the slot's state;
        returns the event that marks them done (None on the CPU: done on return)."""
        if self._stream is None:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        main = torch.cuda.current_stream(self.device)
        staging = self._stage(pairs, buf, nbytes) if self._staging_room(nbytes) else None
        ready = torch.cuda.Event()
        ready.record(main)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            if staging is not None:
                buf[:nbytes].copy_(staging, non_blocking=True)
            else:
                for src, dst in pairs:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self._stream)  # freed states are not reused under the copy
            done = torch.cuda.Event()
            done.record(self._stream)
        if staging is not None:
            staging.record_stream(self._stream)  # its memory is not reused before the copy has run
            self._staged.append((done, nbytes))
        else:
            # The side stream runs in order: the latest copy's event covers the slot's earlier ones.
            self._pending[slot] = done
        return done

    def _staging_room(self, nbytes: int) -> bool:
        if self._staging_bytes <= 0:  # staging off: every copy is direct
            return False
        while self._staged and self._staged[0][0].query():  # a host query, not a wait
            self._staged.popleft()
        in_flight = sum(n for _, n in self._staged)
        return not self._staged or in_flight + nbytes <= self._staging_bytes

    def _stage(self, pairs: Sequence[tuple[Tensor, Tensor]], buf: Tensor, nbytes: int) -> Tensor:
        """The state copied (on the step's stream) into a device buffer laid out like `buf`."""
        staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        base = buf.data_ptr()
        srcs, views = [], []
        for src, dst in pairs:
            off = dst.data_ptr() - base
            srcs.append(src)
            views.append(
                staging[off : off + dst.numel() * dst.element_size()].view(dst.dtype).view(dst.shape)
            )
        torch._foreach_copy_(views, srcs)  # a few kernels for all the layers
        return staging

    def settle(self, slots: Iterable[int]) -> None:
        """The step's stream is about to write these slots' states: it waits for their direct
        copies (staged ones read the staging buffer, not the slot)."""
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

    def fence(self) -> torch.cuda.Event | None:
        """An event behind everything the step's stream has queued (the copies `after` waited for,
        every restore that read a buffer). A buffer given back with it is freed only once it
        completes: unpinning one a copy still uses would block the engine thread. None on the CPU."""
        if not self._cuda:
            return None
        fence = torch.cuda.Event()
        fence.record(torch.cuda.current_stream(self.device))
        return fence

    def pending_slots(self) -> frozenset[int]:
        """Slots whose state a direct copy may still be reading (no write may reach them unsettled)."""
        return frozenset(self._pending)
