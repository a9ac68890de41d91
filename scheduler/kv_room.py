"""What the engine's KV pools can give the next admission, seen from the scheduler.

The engine reports each pool's figures after every step; the scheduler knows what every running
request was charged (its whole window: prompt + max_tokens, in whole blocks) and what the pool
held for it at that step. The difference is promised: blocks those requests will still take.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ballast.engine.blocks import blocks_for
from ballast.engine.plan import KVFigures, KVKeep, StepResult
from ballast.memory.types import PoolRoom


@dataclass(frozen=True)
class Charge:
    """One running request as its pool sees it."""

    total_tokens: int  # positions it may reach: what admission charged
    held_tokens: int  # positions the pool held for it after the last step
    int8: bool  # it lives in the int8 pool


class KVRoom:
    def __init__(self, main: KVFigures | None, int8: KVFigures | None) -> None:
        self.main = main
        self.int8 = int8

    def update(self, result: StepResult) -> None:
        if result.kv is not None:
            self.main = result.kv
        if result.kv_int8 is not None:
            self.int8 = result.kv_int8

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
        """The free blocks each pool keeps when the ladder shrinks it: what the charged requests
        (running, and queued ones charged as if they started now) will still take, with the
        watermark of `room`."""
        charges = list(charges)
        main, int8 = self.main, self.int8
        return KVKeep(
            self._promised(main, False, charges, watermark=1) if main is not None else 0,
            self._promised(int8, True, charges, watermark=1) if int8 is not None else 0,
        )

    @staticmethod
    def _promised(kv: KVFigures, int8: bool, running: Iterable[Charge], watermark: int) -> int:
        bs = kv.block_size
        return sum(
            blocks_for(c.total_tokens, bs) - blocks_for(c.held_tokens, bs) + watermark
            for c in running
            if c.int8 == int8
        )
