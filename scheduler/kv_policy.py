"""The scheduler's KV decisions under the ladder, from the pools' figures after the last step:
which pool a new sequence starts in, whether the queue head waits for blocks about to be freed,
whether a preempted request can come back, what the pools keep when the ladder evicts KV.

A running request was charged its whole window (prompt + max_tokens, in whole blocks); what the
pool has not yet given it is promised: blocks it will still take.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ballast.engine.kv.blocks import blocks_for
from ballast.engine.plan import KVFigures, KVKeep, StepResult
from ballast.memory.types import Level, PoolRoom, VerdictKind
from ballast.scheduler.governor import Governor
from ballast.scheduler.sequence import Seq


@dataclass(frozen=True)
class Charge:
    """One running request as its pool sees it."""

    total_tokens: int  # positions it may reach: what admission charged
    held_tokens: int  # positions the pool held for it after the last step
    int8: bool  # it lives in the int8 pool


class KVRoom:
    def __init__(
        self,
        main: KVFigures | None,
        int8: KVFigures | None,
        keep_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.main = main
        self.int8 = int8
        self._keep_s, self._clock = keep_s, clock
        # (when, blocks sequences held) after each step, each pool: the window's peak first
        self._held: dict[bool, deque[tuple[float, int]]] = {False: deque(), True: deque()}

    def update(self, result: StepResult) -> None:
        if result.kv is not None:
            self.main = result.kv
        if result.kv_int8 is not None:
            self.int8 = result.kv_int8
        now = self._clock()
        for int8, kv in ((False, result.kv), (True, result.kv_int8)):
            if kv is not None and self._keep_s > 0:
                held, n = self._held[int8], kv.used_blocks - kv.evictable_blocks
                while held and held[-1][1] <= n:  # a later, larger figure outlives it in the window
                    held.pop()
                held.append((now, n))

    def recent_peak(self, int8: bool) -> int:
        """The most blocks the pool's sequences held after any step of the last keep_s seconds."""
        held, since = self._held[int8], self._clock() - self._keep_s
        while held and held[0][0] < since:
            held.popleft()
        return held[0][1] if held else 0

    def pools(self) -> list[tuple[str, KVFigures]]:
        return [(name, f) for name, f in (("main", self.main), ("int8", self.int8)) if f is not None]

    def figures(self, int8: bool) -> KVFigures | None:
        return self.int8 if int8 else self.main

    def room(self, int8: bool, running: Iterable[Charge]) -> PoolRoom | None:
        """Spare blocks of the pool a new request would use, less what running requests there
        will still take and a watermark of one block each (the figures are one step old)."""
        kv = self.figures(int8)
        if kv is None:
            return None
        promised = self._promised(kv, int8, running, watermark=1)
        return PoolRoom(kv.free_bytes, promised * kv.block_bytes, kv.addable_bytes)

    def room_when_idle(self, int8: bool) -> PoolRoom | None:
        """The room once every block in use came back (running requests ended, cache evicted)."""
        kv = self.figures(int8)
        if kv is None:
            return None
        return PoolRoom((kv.free_blocks + kv.used_blocks) * kv.block_bytes, 0, kv.addable_bytes)

    def holds(self, int8: bool, n_tokens: int, running: Iterable[Charge]) -> bool:
        """The pool's spare blocks, beyond what running requests will still take, hold n_tokens."""
        kv = self.figures(int8)
        if kv is None:
            return True
        spare = kv.spare_blocks - self._promised(kv, int8, running, watermark=0)
        return spare >= blocks_for(n_tokens, kv.block_size)

    def keep(self, charges: Iterable[Charge]) -> KVKeep:
        """The free blocks each pool keeps when the ladder shrinks it: what `charges` will still
        take (with `room`'s watermark), and at least what brings the pool back to the most its
        sequences held in the last keep_s seconds (the working set new requests will take)."""
        charges = list(charges)

        def kept(kv: KVFigures | None, int8: bool) -> int:
            if kv is None:
                return 0
            # not the figures' used blocks: a step old, they count requests that ended in it
            held = sum(blocks_for(c.held_tokens, kv.block_size) for c in charges if c.int8 == int8)
            working = self.recent_peak(int8) - held
            return max(self._promised(kv, int8, charges, watermark=1), working)

        return KVKeep(kept(self.main, False), kept(self.int8, True))

    @staticmethod
    def _promised(kv: KVFigures, int8: bool, running: Iterable[Charge], watermark: int) -> int:
        bs = kv.block_size
        return sum(
            blocks_for(c.total_tokens, bs) - blocks_for(c.held_tokens, bs) + watermark
            for c in running
            if c.int8 == int8
        )


class KVPolicy:
    def __init__(self, gov: Governor, room: KVRoom) -> None:
        self._gov = gov
        self.room = room
        self._shrink_sent = False  # the engine was told to give free KV segments back
        self._keep = KVKeep()  # the free blocks the last plan's shrink would keep

    def in_int8(self, seq: Seq, n_tokens: int, running: list[Charge]) -> bool:
        """Whether `seq` (charged n_tokens) lives in int8 blocks: as decided at its first admission,
        else as it would start now. The quantized-KV rung (WATCH) puts new sequences in int8 to add
        fewer bytes, but free main-pool blocks cost no new memory, so a sequence they hold whole
        starts there (else the int8 pool grows just when memory is short: on an H200 a co-tenant's
        squeeze held every new request beside a main pool with blocks to spare). Nor does one the
        int8 pool cannot take whole now and the main pool can once running requests end: it waits."""
        if seq.int8_kv is not None:
            return seq.int8_kv
        if not self._gov.ladder.force_quantized_kv or self.room.int8 is None:
            return False
        n, asked, admit = len(seq.feed), n_tokens - len(seq.feed), VerdictKind.ADMIT
        if self.room.holds(False, n_tokens, running):
            return False
        if self._gov.verdict(n, asked, self.room.room(True, running), True).kind is admit:
            return True
        return self._gov.verdict(n, asked, self.room.room_when_idle(False), False).kind is not admit

    def waits_for_blocks(
        self, n_prompt: int, max_tokens: int, int8: bool, running: list[Charge], busy: bool
    ) -> bool:
        """The head would be admitted whole once running requests give their blocks back, but not
        now: it waits instead of being refused or cut short for work about to end (not pressure:
        nothing is counted, the level does not move). busy: something will come back."""
        room, idle = self.room.room(int8, running), self.room.room_when_idle(int8)
        if not busy or room is None or idle is None:
            return False  # nothing will come back: decide now
        if self._gov.verdict(n_prompt, max_tokens, room, int8).kind is VerdictKind.ADMIT:
            return False
        return self._gov.verdict(n_prompt, max_tokens, idle, int8).kind is VerdictKind.ADMIT

    def fits_after(self, running: list[Charge]) -> Callable[[int, int, bool, int], bool]:
        """For the queue-wait projection: whether a request (prompt, max_tokens, int8) is admitted
        whole once `gain` more blocks of its pool are spare than now (what running requests give
        back as they end, less what requests started ahead of it take). One that no wait makes
        whole fits at once: the gate admits it now, capped (or admission refuses it)."""
        rooms = {
            int8: (self.room.room(int8, running), self.room.room_when_idle(int8)) for int8 in (False, True)
        }

        def fits(n_prompt: int, max_tokens: int, int8: bool, gain: int) -> bool:
            room, idle = rooms[int8]
            kv = self.room.figures(int8)
            if room is None or idle is None or kv is None:
                return True
            shifted = PoolRoom(
                room.free_bytes + gain * kv.block_bytes, room.promised_bytes, room.addable_bytes
            )
            if self._gov.verdict(n_prompt, max_tokens, shifted, int8).kind is VerdictKind.ADMIT:
                return True
            return self._gov.verdict(n_prompt, max_tokens, idle, int8).kind is not VerdictKind.ADMIT

        return fits

    def blocks(self, n_tokens: int, int8: bool) -> int:
        """Blocks a request charged n_tokens takes of its pool, with `room`'s watermark of one."""
        kv = self.room.figures(int8)
        return 0 if kv is None else blocks_for(n_tokens, kv.block_size) + 1

    def resumable(self, n_tokens: int, int8: bool, running: list[Charge]) -> bool:
        """A preempted request (n_tokens: what it had and its next token) comes back only when its
        pool's free blocks, beyond what running requests will take, hold it: counting on new memory
        would preempt it again at once. With a snapshot, admission weighs new memory instead."""
        return self._gov.snapshot is not None or self.room.holds(int8, n_tokens, running)

    def shrink(self, releasing: bool, running: list[Charge], upcoming: Iterable[Seq]) -> tuple[bool, KVKeep]:
        """Whether the next plan asks the engine to give free KV segments back, and the blocks to
        keep: while the ladder evicts KV, once when the rung engages, then with every plan that
        frees blocks (`releasing`) or needs fewer kept. upcoming: the queue's next requests."""
        evict = self._gov.ladder.kv_evict
        keep = self._keep_now(running, upcoming) if evict else KVKeep()
        fewer = keep.main < self._keep.main or keep.int8 < self._keep.int8
        send = evict and (releasing or not self._shrink_sent or fewer)
        self._shrink_sent, self._keep = evict, keep
        return send, keep

    def _keep_now(self, running: list[Charge], upcoming: Iterable[Seq]) -> KVKeep:
        """At TIGHT the pools keep what running requests and the queue's next ones would still take,
        and their recent working set (`KVRoom.keep`); only the surplus goes back. More helps only if
        the pressure is ours: under a co-tenant, segments given back were taken by no one and the
        pool could not grow again (an H200: new requests stalled until the queue bound refused
        them; an H100 at s26, before the working set was kept: the 1 GiB given back while the server
        was idle left room for 3 of a burst's 192 requests). At CRITICAL all free blocks go back."""
        if self._gov.ladder.level >= Level.CRITICAL:
            return KVKeep()
        charges = list(running)
        window = self._gov.ladder.context_window
        for seq in upcoming:  # in the pool admission will put it in, charged as it will be
            int8 = self.in_int8(seq, seq.total_tokens, charges)
            n = seq.total_tokens if seq.preempted or not int8 else min(seq.total_tokens, window)
            charges.append(Charge(n, 0, int8))
        return self.room.keep(charges)
