"""The memory layer's configuration: one frozen dataclass, validated when built.

Each field's metadata declares its setting (variable, range, doc; see `ballast.settings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ballast.memory.types import GiB, MiB

from ballast.settings import ConfigError, check, setting


@dataclass(frozen=True)
class MemoryConfig:
    poll_interval_s: float = field(
        default=0.25, metadata=setting("BALLAST_MEMWATCH_POLL_S", "MemWatch poll period, seconds", 0.01, 60.0)
    )
    host_reserve_min_bytes: int = field(
        default=GiB,
        metadata=setting("BALLAST_HOST_RESERVE_MIN_BYTES", "floor of the host reserve", 0, 1 << 50),
    )
    host_reserve_fraction: float = field(
        default=0.15,
        metadata=setting(
            "BALLAST_HOST_RESERVE_FRACTION", "host reserve as a fraction of the effective total", 0.0, 0.9
        ),
    )
    host_reserve_bytes: int = field(
        default=0,
        metadata=setting(
            "BALLAST_HOST_RESERVE_BYTES", "fixed host reserve; 0 = derive from min and fraction", 0, 1 << 50
        ),
    )
    psi_full_reject_pct: float = field(
        default=15.0,
        metadata=setting(
            "BALLAST_PSI_FULL_REJECT",
            "PSI full avg10 (%) at which the level is CRITICAL and admission refuses",
            0.01,
            100.0,
        ),
    )
    psi_some_tight_pct: float = field(
        default=10.0,
        metadata=setting(
            "BALLAST_PSI_SOME_TIGHT", "PSI some avg10 (%) at which the level is at least TIGHT", 0.01, 100.0
        ),
    )
    die_reserve_bytes: int = field(
        default=GiB, metadata=setting("BALLAST_DIE_RESERVE_BYTES", "VRAM kept back per GPU", 0, 1 << 50)
    )
    vram_usable_fraction: float = field(
        default=0.90,
        metadata=setting(
            "BALLAST_VRAM_USABLE_FRACTION",
            "ledger ceiling as a fraction of free VRAM measured at load",
            1e-6,
            1.0,
        ),
    )
    # Below the seed's 2.4 GiB (a dequantize-and-stage burst measured on its K80 host): our load
    # states the host staging it knows (a GGUF dequantized whole, safetensors read ahead) on top
    # of this figure, so it covers only the rest (the allocator's and the runtime's overhead).
    load_spike_bytes: int = field(
        default=512 * MiB,
        metadata=setting(
            "BALLAST_LOAD_SPIKE_BYTES",
            "host headroom a model load's staging burst needs beyond the weights",
            0,
            1 << 50,
        ),
    )
    die_scratch_bytes: int = field(
        default=512 * MiB,
        metadata=setting(
            "BALLAST_DIE_SCRATCH_BYTES",
            "per-GPU scratch kept free when a model is split over GPUs",
            0,
            1 << 50,
        ),
    )
    # The seed's cap, total/16: the pool holds buffers that would otherwise be allocated anew
    # per checkpoint, so its cap is a bound on retention, not a share to fill; the seed's figure
    # had no reason to move (this once read 5%, with none given).
    pool_fraction: float = field(
        default=1 / 16,
        metadata=setting(
            "BALLAST_POOL_FRACTION",
            "checkpoint pool byte cap as a fraction of effective host memory",
            0.0,
            0.5,
        ),
    )
    pool_max_buffers: int = field(
        default=64, metadata=setting("BALLAST_POOL_MAX_BUFFERS", "checkpoint pool count cap", 0, 4096)
    )
    # Kept below the seed's 32 MiB (glibc's largest mmap threshold, below which a freed buffer
    # stays in malloc's heap and pooling saves nothing): on CUDA every buffer is pinned host
    # memory (cudaHostAlloc page-locks each page, at any size), which glibc never recycles, so
    # small recurrent states gain from the pool too; the byte and count caps still bound it.
    pool_min_buffer_bytes: int = field(
        default=MiB,
        metadata=setting(
            "BALLAST_POOL_MIN_BUFFER_BYTES", "buffers smaller than this are not pooled", 0, 1 << 40
        ),
    )
    pool_max_idle_s: float = field(
        default=30.0,
        metadata=setting("BALLAST_POOL_MAX_IDLE_S", "idle trim age for pooled buffers", 0.0, 86400.0),
    )
    ladder_disable: bool = field(
        default=False,
        metadata=setting(
            "BALLAST_LADDER_DISABLE",
            "1 turns the degradation ladder off (slots and window stay as configured)",
        ),
    )
    # A container that mounts the host's /proc and /sys elsewhere points this there (as node
    # exporter's --path.rootfs does); tests point it at a temp tree.
    root: str = field(
        default="/",
        metadata=setting(
            "BALLAST_MEMORY_ROOT", "filesystem root under which proc/ and sys/fs/cgroup are read"
        ),
    )

    def __post_init__(self) -> None:
        check(self)
        if not os.path.isdir(self.root):
            raise ConfigError(
                f"BALLAST_MEMORY_ROOT={self.root!r} is not a directory (the root under which proc/ is read)"
            )
