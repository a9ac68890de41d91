"""Pressure levels from signals: pure functions over the tables below.

Host bytes: reserve = max(1 GiB, 15% of the effective total), or a fixed reserve if configured.

    available <= reserve              CRITICAL
    slack above reserve < reserve/4   TIGHT
    slack above reserve < reserve     WATCH
    otherwise                         OK

PSI escalation (avg10, percent) only ever raises the level:

    full >= psi_full_reject (15)  CRITICAL
    full > 0                      at least TIGHT
    some >= psi_some_tight (10)   at least TIGHT
    some > 0                      at least WATCH

Die (GPU) VRAM, budget = total - die reserve, room = budget - our own leases (planned memory is
no pressure); a die with budget 0 is not tracked:

    free == 0         CRITICAL
    free < room/16    TIGHT
    free < room/8     WATCH

Overall = the worst of the host level and every die level.
"""

from __future__ import annotations

from collections.abc import Iterable

from ballast.memory.config import MemoryConfig
from ballast.memory.types import HostSample, Level


def host_reserve_bytes(effective_total_bytes: int, config: MemoryConfig) -> int:
    """Bytes of host memory that must stay free. Derived from the *effective* total, so inside a
    4 GiB container the reserve is sized for 4 GiB, not for the 512 GiB host."""
    if config.host_reserve_bytes:
        return config.host_reserve_bytes
    return max(config.host_reserve_min_bytes, int(config.host_reserve_fraction * effective_total_bytes))


def bytes_level(available_bytes: int, reserve_bytes: int) -> Level:
    """The host byte table: how far available memory sits above the reserve."""
    if available_bytes <= reserve_bytes:
        return Level.CRITICAL
    slack = available_bytes - reserve_bytes
    if slack < reserve_bytes / 4:
        return Level.TIGHT
    if slack < reserve_bytes:
        return Level.WATCH
    return Level.OK


def psi_level(some_avg10: float, full_avg10: float, config: MemoryConfig) -> Level:
    """The level PSI alone asks for.

    Full pressure (every task stalled on memory) above 0 is only TIGHT, not CRITICAL: avg10 is
    an exponentially decaying average that stays slightly above 0 for about a minute after a
    burst (a model load's dequant/staging spike), long after the box recovered. Refusing work on
    that tail would turn a healthy box away; only a stall at the reject threshold is CRITICAL.
    """
    if full_avg10 >= config.psi_full_reject_pct:
        return Level.CRITICAL
    if full_avg10 > 0.0 or some_avg10 >= config.psi_some_tight_pct:
        return Level.TIGHT
    if some_avg10 > 0.0:
        return Level.WATCH
    return Level.OK


def host_level(sample: HostSample, config: MemoryConfig) -> Level:
    """Worst of the byte table (on cgroup-aware figures) and PSI.

    When no total is known at all (MemTotal unreadable and no cgroup limit) the byte table is
    skipped unless MemAvailable was read, in which case it runs against the configured minimum
    reserve: an unknown box is judged by what is known (PSI, available bytes), and a box where
    nothing is known is OK rather than CRITICAL, because refusing everything on a read failure
    would take the server down with no memory pressure at all. Admission still fails closed on
    such a box: its host budget is 0.
    """
    total = sample.effective_total_bytes
    available = sample.effective_available_bytes
    pressure = psi_level(sample.psi_some_avg10, sample.psi_full_avg10, config)
    if total == 0 and available == 0:
        return pressure
    return max(bytes_level(available, host_reserve_bytes(total, config)), pressure)


def die_level(free_bytes: int, budget_bytes: int, ledger_bytes: int = 0) -> Level:
    """The die table; a die whose budget is 0 (unknown or all reserve) is skipped (OK).

    Free VRAM is judged against the part of the budget our own leases do not hold: what we
    leased is planned memory (the ledger refuses past its ceiling), so a KV pool grown to the
    ceiling, which leaves only the ceiling's cushion free, is no pressure; other processes and
    unplanned allocations eating into that remainder are. With nothing leased this is the plain
    table: free 0 CRITICAL, < budget/16 TIGHT, < budget/8 WATCH. (The seed judged free against
    the whole budget: on a die whose KV pool grows to the ledger's ceiling that reads TIGHT at
    rest, and the ladder would halve the slots of a server that is only full as planned.)"""
    if budget_bytes <= 0:
        return Level.OK
    if free_bytes <= 0:
        return Level.CRITICAL
    room = max(0, budget_bytes - ledger_bytes)
    if free_bytes < room / 16:
        return Level.TIGHT
    if free_bytes < room / 8:
        return Level.WATCH
    return Level.OK


def worst(levels: Iterable[Level]) -> Level:
    """Overall level: the worst of its parts (OK when there are none)."""
    return max(levels, default=Level.OK)
