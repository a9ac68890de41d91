"""How many intra-op threads a CPU engine runs: chosen from the CPUs the process may use.

torch's default, one thread per core of the machine, is wrong for a server: the process may use
fewer (an affinity mask, or a cgroup CPU quota, the tightest level up the tree binding), and
OpenMP's threads meet at a barrier after every op, so one thread that another process holds up
stalls every op of every step (2.9x slower on a 2-core box with one other core busy). The engine
takes the usable CPUs less one for the event loop (at least one); --cpu-threads overrides it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ballast.memory.host import CgroupLocation, locate_cgroup

# Cores left to the event loop, tokenizer and HTTP streaming when the engine sizes its pool.
EVENT_LOOP_CPUS = 1
_V2_UNLIMITED = "max"


@dataclass(frozen=True)
class CpuShare:
    """What this process may run on: `affinity` CPUs, and at most `quota` CPUs' worth of time
    (None: no cgroup quota)."""

    affinity: int
    quota: float | None
    cgroup: str  # the cgroup directory the quota came from, "" when none

    @property
    def usable(self) -> int:
        """Whole CPUs the process can keep busy: a fractional quota rounds down (1.5 CPUs of
        quota keep one thread busy, not two), but never below one."""
        cpus = self.affinity if self.quota is None else min(self.affinity, math.floor(self.quota))
        return max(1, cpus)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _v2_quota(path: str) -> float | None:
    """`cpu.max` of one v2 cgroup, "QUOTA PERIOD" or "max PERIOD", as CPUs (None: no limit or
    unreadable)."""
    text = _read(os.path.join(path, "cpu.max"))
    parts = text.split() if text else []
    if len(parts) != 2 or parts[0] == _V2_UNLIMITED:
        return None
    return _ratio(parts[0], parts[1])


def _v1_quota(path: str) -> float | None:
    """cfs_quota_us / cfs_period_us of one v1 cgroup (-1 quota: no limit)."""
    quota, period = (_read(os.path.join(path, f"cpu.cfs_{k}_us")) for k in ("quota", "period"))
    if quota is None or period is None:
        return None
    return _ratio(quota.strip(), period.strip())


def _ratio(quota: str, period: str) -> float | None:
    """quota / period, None for anything but two positive integers (a garbled file degrades to
    "no limit known", the state every process without a cgroup quota is in)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cgroup_quota(loc: CgroupLocation) -> float | None:
    """The tightest quota from the process's cgroup up to the hierarchy's root: a parent's quota
    binds every child."""
    read = _v2_quota if loc.version == 2 else _v1_quota
    best: float | None = None
    path = loc.path
    while True:
        quota = read(path)
        if quota is not None and (best is None or quota < best):
            best = quota
        if os.path.normpath(path) == os.path.normpath(loc.mount) or len(path) <= len(loc.mount):
            return best
        path = os.path.dirname(path)


def read_cpu_share(root: str = "/", affinity: int | None = None) -> CpuShare:
    """This process's CpuShare, cgroup files under `root` (tests pass a temp tree); affinity
    defaults to the process's own mask."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    loc = locate_cgroup(root, controller="cpu")
    quota = _cgroup_quota(loc) if loc is not None else None
    return CpuShare(affinity=max(1, affinity), quota=quota, cgroup=loc.path if loc and quota else "")


def intra_op_threads(share: CpuShare, configured: int = 0) -> int:
    """The engine's thread count: `configured` when set (> 0), else the usable CPUs less
    EVENT_LOOP_CPUS, at least one."""
    if configured > 0:
        return configured
    return max(1, share.usable - EVENT_LOOP_CPUS)


def decode_threads(share: CpuShare, configured: int = 0) -> int:
    """The most threads the CPU block kernel's decode step runs (models/cpu_blocks.DecodeThreads):
    every usable CPU, the extra ones only while no other process holds them; `configured` if set."""
    return configured if configured > 0 else share.usable


def describe(share: CpuShare, threads: int, configured: int) -> str:
    """The start-up log line: the choice and what it came from."""
    quota = f"cgroup quota {share.quota:g} CPUs ({share.cgroup})" if share.quota else "no cgroup CPU quota"
    how = "--cpu-threads" if configured > 0 else f"usable CPUs less {EVENT_LOOP_CPUS} for the event loop"
    decode = f"block decode steps up to {decode_threads(share, configured)}"
    return f"CPU threads: {threads} ({how}; affinity {share.affinity} CPUs, {quota}); {decode}"
