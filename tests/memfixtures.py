"""Fixture /proc + cgroup trees for memory tests: real files in a temp dir, read by the real readers.

Point `MemoryConfig(root=str(tmp_path))` (or `HostReader(str(tmp_path))`) at the tree.

    write_tree(root, mem_total=16 * GiB, mem_available=12 * GiB)               # no cgroup
    write_tree(root, mem_total=..., mem_available=..., cgroup="v2",
               cg_usage=3 * GiB, cg_max=4 * GiB, inactive_file=1 * GiB)        # usage counted: 2 GiB
    level_tree(root, Level.TIGHT, cgroup="v1")                                  # host level TIGHT

Both can be called again on the same root to rewrite it while a MemWatch polls: every file is
written to a temp name and `os.replace`d, so a concurrent reader sees the old or the new file,
never half of one. Switching cgroup mode removes the old mode's pointer (/proc/self/cgroup).
Byte figures land in /proc/meminfo in kB, so pass multiples of 1 KiB.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

from ballast.memory.config import MemoryConfig
from ballast.memory.ledger import VramLedger
from ballast.memory.levels import host_reserve_bytes
from ballast.memory.types import GiB, Level

CgroupMode = Literal["v1", "v2"] | None

# Where each mode's cgroup directory lies inside the tree (as on a real host).
V2_CGROUP = "sys/fs/cgroup/ballast.slice/app.scope"
V1_CGROUP = "sys/fs/cgroup/memory/ballast/app"
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit" on 4 KiB pages

_V2_MOUNTINFO = (
    "22 1 0:21 / / rw,relatime - overlay overlay rw\n"
    "31 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
)
_V1_MOUNTINFO = (
    "22 1 0:21 / / rw,relatime - overlay overlay rw\n"
    "31 22 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


def write_file(root: Path, rel: str, text: str) -> Path:
    """Atomically write `text` at root/rel (parents created). Use it to plant garbage files."""
    path = Path(root) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def _psi(some: float, full: float) -> str:
    return (
        f"some avg10={some:.2f} avg60={some:.2f} avg300={some:.2f} total=1000\n"
        f"full avg10={full:.2f} avg60={full:.2f} avg300={full:.2f} total=500\n"
    )


def write_tree(
    root: Path,
    *,
    mem_total: int,
    mem_available: int,
    psi_some: float = 0.0,
    psi_full: float = 0.0,
    cgroup: CgroupMode = None,
    cg_usage: int = 0,
    cg_high: int = 0,
    cg_max: int = 0,
    inactive_file: int = 0,
    cg_psi_some: float = 0.0,
    cg_psi_full: float = 0.0,
) -> None:
    """Write (or rewrite) a host tree under `root`.

    `cg_usage` is the raw cgroup usage (memory.current / memory.usage_in_bytes), page cache
    included; `inactive_file` is the reclaimable part the reader subtracts. A limit of 0 is
    written as "no limit" ("max" on v2, the unlimited sentinel on v1); v1 has no memory.high.
    `cg_psi_*` go to the cgroup's own memory.pressure (v2 only).
    """
    root = Path(root)
    write_file(
        root,
        "proc/meminfo",
        f"MemTotal:       {mem_total // 1024} kB\n"
        f"MemFree:        {mem_available // 2048} kB\n"
        f"MemAvailable:   {mem_available // 1024} kB\n"
        "Buffers:           1024 kB\n",
    )
    write_file(root, "proc/pressure/memory", _psi(psi_some, psi_full))
    if cgroup is None:
        (root / "proc/self/cgroup").unlink(missing_ok=True)
        return
    if cgroup == "v2":
        write_file(root, "proc/self/mountinfo", _V2_MOUNTINFO)
        write_file(root, "proc/self/cgroup", "0::/" + V2_CGROUP.removeprefix("sys/fs/cgroup/") + "\n")
        write_file(root, f"{V2_CGROUP}/memory.current", f"{cg_usage}\n")
        write_file(root, f"{V2_CGROUP}/memory.high", f"{cg_high or 'max'}\n")
        write_file(root, f"{V2_CGROUP}/memory.max", f"{cg_max or 'max'}\n")
        write_file(
            root,
            f"{V2_CGROUP}/memory.stat",
            f"anon {cg_usage - inactive_file}\nfile {inactive_file}\ninactive_file "
            f"{inactive_file}\nactive_file 0\n",
        )
        write_file(root, f"{V2_CGROUP}/memory.pressure", _psi(cg_psi_some, cg_psi_full))
    elif cgroup == "v1":
        if cg_high:
            raise ValueError("cgroup v1 has no memory.high")
        write_file(root, "proc/self/mountinfo", _V1_MOUNTINFO)
        write_file(
            root,
            "proc/self/cgroup",
            "2:cpu:/\n4:memory:/" + V1_CGROUP.removeprefix("sys/fs/cgroup/memory/") + "\n0::/\n",
        )
        write_file(root, f"{V1_CGROUP}/memory.usage_in_bytes", f"{cg_usage}\n")
        write_file(root, f"{V1_CGROUP}/memory.limit_in_bytes", f"{cg_max or V1_UNLIMITED}\n")
        write_file(
            root,
            f"{V1_CGROUP}/memory.stat",
            f"cache {inactive_file}\nrss {cg_usage - inactive_file}\ninactive_file {inactive_file}\n"
            f"hierarchical_memory_limit {cg_max or V1_UNLIMITED}\ntotal_inactive_file {inactive_file}\n",
        )
    else:
        raise ValueError(f"cgroup must be 'v1', 'v2' or None, not {cgroup!r}")


# Headroom above the reserve, as a multiple of the reserve, that lands inside each level's band.
_SLACK = {Level.OK: 2.0, Level.WATCH: 0.5, Level.TIGHT: 0.125, Level.CRITICAL: -0.5}


def level_tree(
    root: Path, level: Level, *, cgroup: CgroupMode = None, config: MemoryConfig | None = None
) -> None:
    """Write a tree whose host level is `level` under `config` (default MemoryConfig), from bytes
    alone (no PSI). Without a cgroup the host has 16 GiB; with one, a 64 GiB host holds an 8 GiB
    cgroup whose usage sets the level."""
    config = config or MemoryConfig()
    total = 8 * GiB if cgroup else 16 * GiB
    reserve = host_reserve_bytes(total, config)
    available = (int(reserve * (1 + _SLACK[level])) // 1024) * 1024
    if cgroup is None:
        write_tree(root, mem_total=total, mem_available=available)
    else:
        write_tree(
            root,
            mem_total=64 * GiB,
            mem_available=60 * GiB,
            cgroup=cgroup,
            cg_usage=total - available,
            cg_max=total,
        )


def limited_grants(grants: int) -> Callable[[int], Callable[[], None] | None]:
    """A memory layer that grants at most `grants` KV segments at a time (a KV pool's `_acquire`):
    the levels a test cannot cause on its machine, as a grant function."""
    held = [0]

    def acquire(nbytes: int) -> Callable[[], None] | None:
        if held[0] >= grants:
            return None
        held[0] += 1
        return lambda: held.__setitem__(0, held[0] - 1)

    return acquire


def ledger_watch(room: int) -> SimpleNamespace:
    """What graph capture reads of a MemWatch: `.ledger`, a real VRAM ledger of one die (0) with
    `room` bytes, all of them free and usable."""
    ledger = VramLedger(die_reserve_bytes=0, usable_fraction=1.0)
    ledger.register_die(0, total_bytes=room, free_bytes=room)
    return SimpleNamespace(ledger=ledger)
