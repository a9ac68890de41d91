"""The memory layer's configuration: one frozen dataclass, validated when built.

Values come from CLI flags and `BALLAST_*` variables in one place (`ballast.server.config`); the
field metadata names the variable and its accepted range so a bad value is reported precisely.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from ballast.memory.types import GiB, MiB


def _env(name: str, lo: float, hi: float, doc: str) -> dict[str, object]:
    return {"env": name, "range": (lo, hi), "doc": doc}


@dataclass(frozen=True)
class MemoryConfig:
    poll_interval_s: float = field(default=0.25, metadata=_env("BALLAST_MEMWATCH_POLL_S", 0.01, 60.0, "MemWatch poll period, seconds"))
    host_reserve_min_bytes: int = field(default=GiB, metadata=_env("BALLAST_HOST_RESERVE_MIN_BYTES", 0, 1 << 50, "floor of the host reserve"))
    host_reserve_fraction: float = field(default=0.15, metadata=_env("BALLAST_HOST_RESERVE_FRACTION", 0.0, 0.9, "host reserve as a fraction of the effective total"))
    host_reserve_bytes: int = field(default=0, metadata=_env("BALLAST_HOST_RESERVE_BYTES", 0, 1 << 50, "fixed host reserve; 0 = derive from min and fraction"))
    psi_full_reject_pct: float = field(default=15.0, metadata=_env("BALLAST_PSI_FULL_REJECT", 0.01, 100.0, "PSI full avg10 (%) at which the level is CRITICAL and admission refuses"))
    psi_some_tight_pct: float = field(default=10.0, metadata=_env("BALLAST_PSI_SOME_TIGHT", 0.01, 100.0, "PSI some avg10 (%) at which the level is at least TIGHT"))
    die_reserve_bytes: int = field(default=GiB, metadata=_env("BALLAST_DIE_RESERVE_BYTES", 0, 1 << 50, "VRAM kept back per GPU"))
    vram_usable_fraction: float = field(default=0.90, metadata=_env("BALLAST_VRAM_USABLE_FRACTION", 1e-6, 1.0, "ledger ceiling as a fraction of free VRAM measured at load"))
    load_spike_bytes: int = field(default=512 * MiB, metadata=_env("BALLAST_LOAD_SPIKE_BYTES", 0, 1 << 50, "host headroom a model load's staging burst needs beyond the weights"))
    die_scratch_bytes: int = field(default=512 * MiB, metadata=_env("BALLAST_DIE_SCRATCH_BYTES", 0, 1 << 50, "per-GPU scratch kept free when a model is split over GPUs"))
    pool_fraction: float = field(default=0.05, metadata=_env("BALLAST_POOL_FRACTION", 0.0, 0.5, "checkpoint pool byte cap as a fraction of effective host memory"))
    pool_max_buffers: int = field(default=16, metadata=_env("BALLAST_POOL_MAX_BUFFERS", 0, 4096, "checkpoint pool count cap"))
    pool_min_buffer_bytes: int = field(default=MiB, metadata=_env("BALLAST_POOL_MIN_BUFFER_BYTES", 0, 1 << 40, "buffers smaller than this are not pooled"))
    pool_max_idle_s: float = field(default=30.0, metadata=_env("BALLAST_POOL_MAX_IDLE_S", 0.0, 86400.0, "idle trim age for pooled buffers"))
    ladder_disable: bool = field(default=False, metadata=_env("BALLAST_LADDER_DISABLE", 0, 1, "1 turns the degradation ladder off"))
    # A container that mounts the host's /proc and /sys elsewhere points this there (as node
    # exporter's --path.rootfs does); tests point it at a temp tree.
    root: str = field(default="/", metadata={"env": "BALLAST_MEMORY_ROOT", "doc": "filesystem root under which proc/ and sys/fs/cgroup are read"})

    def __post_init__(self) -> None:
        if not os.path.isdir(self.root):
            raise ValueError(f"BALLAST_MEMORY_ROOT={self.root!r} is not a directory (the root under which proc/ is read)")
        for f in fields(self):
            rng = f.metadata.get("range")
            if rng is None:
                continue
            value = getattr(self, f.name)
            lo, hi = rng
            if isinstance(value, bool):
                continue
            if not isinstance(value, int | float) or not (lo <= value <= hi):
                raise ValueError(f"{f.metadata['env']}={value!r} is out of range: accepted {lo}..{hi} ({f.metadata['doc']})")
