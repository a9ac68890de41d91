"""Typed refusals raised by the memory layer.

Every refusal derives from `MemoryRefused`, so a caller that only wants to know "memory said no"
catches one type; the server maps it to a retryable HTTP error in one place.
"""

from __future__ import annotations


class MemoryRefused(Exception):
    """The memory layer refused work because it would not fit. Retryable once pressure eases."""


class LedgerFull(MemoryRefused):
    """A VRAM lease would take a die's ledger past its ceiling."""

    def __init__(self, die: int, asked: int, held: int, ceiling: int, tag: str) -> None:
        self.die = die
        self.asked = asked
        self.held = held
        self.ceiling = ceiling
        self.tag = tag
        super().__init__(
            f"VRAM ledger full on die {die}: lease {tag!r} asked {asked} bytes, "
            f"{held} held, ceiling {ceiling} ({max(0, ceiling - held)} left)"
        )


class UnknownDie(LookupError):
    """A die that was never registered with the ledger, or is not in a snapshot (a caller bug)."""

    def __init__(self, die: int) -> None:
        self.die = die
        super().__init__(f"die {die} is unknown: not registered with the VRAM ledger / not in the snapshot")
