"""MemWatch: polls host and GPU signals and publishes an immutable `MemState`.

Publishing is one reference assignment of a snapshot built completely beforehand (a frozen
dataclass), which is atomic under the GIL: `read()` never blocks and never sees a torn state.
Writers (the poll thread, `poll_now()`) serialise on a lock that readers never take.

Which dies count toward the level: a die the engine has claimed by registering it with the
ledger. A GPU that NVML sees but we never use is shown with budget 0 ("not tracked") and cannot
raise our level: another tenant filling it is not our pressure.

Where the seed pushed each die's figures from the engine after every step (set_die), this polls
NVML with the host, which needs no CUDA context and sees another process taking VRAM while we
idle; our own part, the ledger, is read live where it decides anything (`exact()`), so a push
would add nothing but a second path to the same figures.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ballast.memory.config import MemoryConfig
from ballast.memory.device import DeviceReader, DieReading, SystemDeviceReader
from ballast.memory.host import HostReader
from ballast.memory.host_book import HostBook
from ballast.memory.ledger import VramLedger
from ballast.memory.levels import die_level, host_level, host_reserve_bytes, worst
from ballast.memory.types import DieState, HostSample, Level, MemState

log = logging.getLogger(__name__)

Listener = Callable[[Level, Level, MemState], None]


def _with_held(die: DieState, held: int) -> DieState:
    """The die with the ledger's figure now; what was leased since the poll is not in the driver's
    free figure yet either."""
    since = max(0, held - die.ledger_bytes)
    return replace(die, ledger_bytes=held, free_bytes=max(0, die.free_bytes - since))


class MemWatch:
    """The memory layer's live view. `ledger` is the VRAM ledger whose totals flow into every
    snapshot. Until the first poll, `read()` returns a placeholder with seq 0 whose host figures
    are 0: admission on it finds no host budget and refuses (fails closed)."""

    def __init__(self, config: MemoryConfig, device_reader: DeviceReader | None = None) -> None:
        self.config = config
        self.ledger = VramLedger(config.die_reserve_bytes, config.vram_usable_fraction)
        self.host_book = HostBook()  # host bytes we took that a snapshot may not show yet
        self.poll_failures = 0  # polls of the background thread that raised (each one logged)
        self._host_reader = HostReader(config.root)
        self._device_reader: DeviceReader = (
            device_reader if device_reader is not None else SystemDeviceReader()
        )
        # Lock order: _poll_lock -> _write_lock; _notify_lock is taken with neither held, so a
        # listener may call poll_now(). Readers take none of them.
        self._poll_lock = threading.Lock()  # one poll's file and NVML reads at a time
        self._write_lock = threading.Lock()  # guards the inputs below and the publish
        self._notify_lock = threading.RLock()  # one notifier at a time, re-entrant for listeners
        self._notifying = False
        self._notified_level = Level.OK  # what listeners were last told (the placeholder's level)
        self._life_lock = threading.Lock()
        self._host = HostSample(total_bytes=0, available_bytes=0)
        self._host_epoch = 0
        self._driver: dict[int, DieReading] = {}
        self._free: dict[int, int] = {}  # latest free figure from the driver
        self._listeners: list[Listener] = []
        self._state = MemState(
            host=self._host, host_reserve_bytes=config.host_reserve_bytes or config.host_reserve_min_bytes
        )
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --- readers -------------------------------------------------------------------------

    def read(self) -> MemState:
        """The latest snapshot. Never blocks: a single attribute read of an immutable object."""
        return self._state

    @property
    def seq(self) -> int:
        return self._state.seq

    @property
    def running(self) -> bool:
        return self._thread is not None

    def exact(self, state: MemState | None = None) -> MemState:
        """A snapshot (default: the latest) with our own accounts as of now: each die's ledger figure is what
        the ledger holds now (its free figure lower by what was leased since the poll), and the
        host budget is lower by what the host book holds that the host read does not show.
        Admission and grants read this: our accounts are exact, a snapshot of them is up to a
        poll old, and a grant or a segment taken since then would otherwise be counted twice
        (once as headroom, once as a pool's spare blocks)."""
        state = state if state is not None else self._state
        unseen = self.host_book.unseen(state.host_epoch)  # relative to its read: no lock needed
        held = {b.die: b.held_bytes for b in self.ledger.dies()}
        dies = tuple(_with_held(d, held[d.index]) if d.index in held else d for d in state.dies)
        return replace(state, dies=dies, host_unseen_bytes=unseen)

    def add_listener(self, fn: Listener) -> None:
        """Call `fn(old_level, new_level, state)` after each publish that changes the level.

        It runs on the publishing thread (the poll thread, or whoever called `poll_now()`),
        outside the state lock; keep it short. An exception it raises is logged
        and does not stop the watcher or other listeners.
        """
        with self._notify_lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        with self._notify_lock:
            self._listeners.remove(fn)

    # --- writers -------------------------------------------------------------------------

    def poll_now(self) -> MemState:
        """Read host and device signals now and publish; returns the published snapshot."""
        with self._poll_lock:
            epoch = self.host_book.begin_read()  # before the read: what it shows is booked before
            host = self._host_reader.read()
            dies = self._device_reader.read()
            with self._write_lock:
                self._host, self._host_epoch = host, epoch
                self._driver = {d.index: d for d in dies}
                for d in dies:
                    self._free[d.index] = d.free_bytes
                new = self._publish()
        self._notify()
        return new

    def _publish(self) -> MemState:
        """Build the next snapshot from the current inputs and publish it. Holds _write_lock."""
        old = self._state
        host = self._host
        budgets = {b.die: b for b in self.ledger.dies()}
        dies = []
        for index in sorted(set(self._free) | set(budgets)):
            driver = self._driver.get(index)
            booked = budgets.get(index)
            free = self._free.get(index, 0)
            budget = booked.budget_bytes if booked else 0
            total = driver.total_bytes if driver else booked.total_bytes if booked else 0
            ours = booked.held_bytes if booked else 0
            dies.append(
                DieState(
                    index=index,
                    name=driver.name if driver else "",
                    total_bytes=total,
                    free_bytes=free,
                    budget_bytes=budget,
                    ledger_bytes=ours,
                    ceiling_bytes=booked.ceiling_bytes if booked else 0,
                    level=die_level(free, budget, ours),
                )
            )
        h_level = host_level(host, self.config)
        new = MemState(
            host=host,
            dies=tuple(dies),
            host_level=h_level,
            level=worst([h_level, *(d.level for d in dies)]),
            host_reserve_bytes=host_reserve_bytes(host.effective_total_bytes, self.config),
            seq=old.seq + 1,
            taken_at=time.monotonic(),
            host_epoch=self._host_epoch,
            host_unseen_bytes=self.host_book.unseen(self._host_epoch),
        )
        self._state = new  # the publish: one reference assignment
        return new

    def _notify(self) -> None:
        """Tell listeners about the latest level if it differs from the one they last heard.

        Notifying from the latest snapshot (not from each publish) keeps the chain consistent
        when two threads publish at once: `old` is always what listeners were last told, and a
        flap faster than the listeners run may be coalesced. A listener that publishes (calls
        `poll_now()`) is not re-entered; the loop below picks the new level up.
        """
        with self._notify_lock:
            if self._notifying:
                return
            self._notifying = True
            try:
                while (state := self._state).level != self._notified_level:
                    old, self._notified_level = self._notified_level, state.level
                    for fn in list(self._listeners):
                        try:
                            fn(old, state.level, state)
                        except Exception:
                            log.exception(
                                "MemWatch listener %r failed on %s -> %s", fn, old.name, state.level.name
                            )
            finally:
                self._notifying = False

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Poll once synchronously (so the first `read()` is real), then every poll interval on
        a daemon thread. Idempotent."""
        with self._life_lock:
            if self._thread is not None:
                return
            self.poll_now()
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name="ballast-memwatch", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the poll thread and wait for it. Idempotent; `start()` may follow."""
        with self._life_lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._stop.set()
        if thread is not threading.current_thread():  # a listener may stop the watcher
            thread.join()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.poll_interval_s):
            try:
                self.poll_now()
            except Exception:
                # The watcher must outlive a bad poll (a driver hiccup); the snapshot keeps its
                # last figures and its taken_at shows how old they are.
                self.poll_failures += 1
                log.exception("MemWatch poll failed; keeping the last snapshot")

    def __enter__(self) -> MemWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
