"""Host memory signals: /proc/meminfo, PSI, and the process's cgroup (v2 or v1).

Every read takes a root directory, so tests feed real files from a temp tree. A reader never
raises on a bad file: a missing, unreadable, negative or absurd value degrades to "not known"
(0 in `HostSample`), and a failed MemTotal is 0, never "huge" (a huge total would grant a huge
budget). Other operating systems read total/available through psutil; PSI and cgroup stay 0.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass

from ballast.memory.types import HostSample

# cgroup v1 writes "unlimited" as the largest page-aligned int64 (9223372036854771712); v2 writes
# "max". Anything this large is no limit, whatever the exact page size.
NO_LIMIT_FLOOR = 1 << 60
# No machine has 4 PiB of RAM: a larger total is a misread, and is treated as unknown.
MAX_SANE_BYTES = 1 << 52
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
_V2_STAT_KEYS = frozenset({"inactive_file"})
_V1_STAT_KEYS = frozenset({"total_inactive_file", "inactive_file", "hierarchical_memory_limit"})


@dataclass(frozen=True)
class CgroupLocation:
    """Where the process's memory cgroup lives in the (root-prefixed) filesystem."""

    version: int  # 1 or 2
    path: str  # the cgroup's own directory
    mount: str  # the hierarchy's mount point; v2 limits are read on every level up to it


def _read_text(path: str) -> str | None:
    """The file's text, or None when it is absent or unreadable (an expected state: old kernels
    have no PSI, most processes sit in no limited cgroup). Raw os.read: a poll reads about ten
    small files, and the text-mode file object costs more than the read itself."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("ascii", errors="replace")


def _parse_count(text: str | None) -> int | None:
    """A non-negative byte count, or None for garbage, negatives and "max"."""
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def _parse_limit(text: str | None) -> int:
    """A cgroup limit in bytes; 0 means no limit known ("max", unlimited, garbage or 0)."""
    value = _parse_count(text)
    if value is None or value >= NO_LIMIT_FLOOR:
        return 0
    return value


def _parse_stat(text: str | None, keys: frozenset[str]) -> dict[str, int]:
    """The wanted `key value` lines of memory.stat (40-odd lines); malformed lines are skipped."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, raw = line.partition(" ")
        if key in keys:
            value = _parse_count(raw)
            if value is not None:
                out[key] = value
    return out


def parse_meminfo(text: str | None) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; 0 for what cannot be trusted."""
    wanted = {"MemTotal", "MemFree", "MemAvailable"}
    fields: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, rest = line.partition(":")
        key = key.strip()
        parts = rest.split()
        if key not in wanted or not parts:
            continue
        value = _parse_count(parts[0])
        if value is None:
            continue
        fields[key] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
        if len(fields) == len(wanted):  # they lead the file: skip the other ~50 lines
            break
    total = fields.get("MemTotal", 0)
    if not 0 < total <= MAX_SANE_BYTES:
        total = 0
    # Kernels before 3.14 have no MemAvailable; MemFree under-counts (it ignores reclaimable
    # cache), which errs on the safe side.
    available = fields.get("MemAvailable", fields.get("MemFree", 0))
    if available > MAX_SANE_BYTES:
        available = 0
    if total:
        available = min(available, total)
    return total, available


def parse_psi(text: str | None) -> tuple[float, float]:
    """(some avg10, full avg10) in percent; 0.0 ("no pressure known") for anything unreadable."""
    values = {"some": 0.0, "full": 0.0}
    for line in (text or "").splitlines():
        parts = line.split()
        if not parts or parts[0] not in values:
            continue
        for item in parts[1:]:
            key, _, raw = item.partition("=")
            if key != "avg10":
                continue
            try:
                value = float(raw)
            except ValueError:
                break
            if math.isfinite(value) and 0.0 <= value <= 100.0:
                values[parts[0]] = value
            break
    return values["some"], values["full"]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_mounts(mountinfo: str, version: int, controller: str = "memory") -> list[tuple[str, str]]:
    """(mount root, mount point) of each mount of the controller's hierarchy of this cgroup version."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 2:
            continue
        fstype = fields[sep + 1]
        super_opts = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
        if (version == 2 and fstype == "cgroup2") or (
            version == 1 and fstype == "cgroup" and controller in super_opts
        ):
            out.append((_unescape(fields[3]), _unescape(fields[4])))
    return out


def _cgroup_dir(root: str, mounts: list[tuple[str, str]], cg_path: str) -> tuple[str, str] | None:
    """The cgroup directory for `cg_path` under the best matching mount, and that mount point.

    Outside a cgroup namespace the mount root is "/" and the directory is mount point + path. In
    a container without a cgroup namespace the mount root is the container's own cgroup (e.g.
    /docker/<id>) and the path starts with it. Inside a namespace the path may be "/" or point
    outside the visible tree ("/../.."): then the mount point itself is the process's cgroup.
    """
    if not mounts:
        return None
    for mount_root, mount_point in mounts:
        base = os.path.join(root, mount_point.lstrip("/"))
        if mount_root == "/":
            rel = cg_path
        elif cg_path == mount_root or cg_path.startswith(mount_root.rstrip("/") + "/"):
            rel = cg_path[len(mount_root) :]
        else:
            continue
        parts = [p for p in rel.split("/") if p]
        if ".." in parts:
            return base, base
        candidate = os.path.join(base, *parts)
        if os.path.isdir(candidate):
            return candidate, base
    base = os.path.join(root, mounts[0][1].lstrip("/"))
    return base, base


def locate_cgroup(
    root: str, proc_self_cgroup: str | None = None, controller: str = "memory"
) -> CgroupLocation | None:
    """Find the process's cgroup of a controller (memory, or cpu for the engine's thread count)
    from {root}/proc/self/cgroup and {root}/proc/self/mountinfo.

    A v1 line naming the controller wins over the v2 line: on a hybrid host the unified
    hierarchy exists but the controller is bound to v1, so v2 files would say nothing.
    """
    text = (
        proc_self_cgroup
        if proc_self_cgroup is not None
        else _read_text(os.path.join(root, "proc/self/cgroup"))
    )
    mountinfo = _read_text(os.path.join(root, "proc/self/mountinfo"))
    if not text or mountinfo is None:
        return None
    v1_path = v2_path = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier_id, controllers, path = parts
        if controller in controllers.split(","):
            v1_path = path
        elif hier_id == "0" and controllers == "":
            v2_path = path
    for version, cg_path in ((1, v1_path), (2, v2_path)):
        if cg_path is None:
            continue
        found = _cgroup_dir(root, _cgroup_mounts(mountinfo, version, controller), cg_path)
        if found is not None:
            return CgroupLocation(version=version, path=found[0], mount=found[1])
    return None


@dataclass(frozen=True)
class CgroupReading:
    usage_bytes: int  # usage minus reclaimable page cache; 0 when unknown
    high_bytes: int  # 0 = none
    max_bytes: int  # 0 = none
    psi_some: float
    psi_full: float


def _v2_level(path: str) -> tuple[int, int, int]:
    """(usage minus inactive_file, high, max) of one v2 cgroup directory."""
    current = _parse_count(_read_text(os.path.join(path, "memory.current")))
    if current is None or current >= NO_LIMIT_FLOOR:
        current = 0
    inactive = _parse_stat(_read_text(os.path.join(path, "memory.stat")), _V2_STAT_KEYS).get(
        "inactive_file", 0
    )
    high = _parse_limit(_read_text(os.path.join(path, "memory.high")))
    limit = _parse_limit(_read_text(os.path.join(path, "memory.max")))
    return max(0, current - inactive), high, limit


def read_cgroup_v2(loc: CgroupLocation) -> CgroupReading:
    """Usage and limits of the binding level: a limit set on a parent (a Kubernetes pod, a
    systemd slice) binds as hard as our own, so every level up to the mount is read, and the
    one with the least headroom is reported."""
    best: tuple[int, int, int] | None = None
    best_headroom = 0
    path = loc.path
    while True:
        usage, high, limit = _v2_level(path)
        bound = min(b for b in (high, limit, NO_LIMIT_FLOOR) if b > 0)
        if bound < NO_LIMIT_FLOOR and (best is None or bound - usage < best_headroom):
            best, best_headroom = (usage, high, limit), bound - usage
        if os.path.normpath(path) == os.path.normpath(loc.mount) or len(path) <= len(loc.mount):
            break
        path = os.path.dirname(path)
    if best is None:  # no limit anywhere: report our own usage for the operator
        best = (_v2_level(loc.path)[0], 0, 0)
    some, full = parse_psi(_read_text(os.path.join(loc.path, "memory.pressure")))
    return CgroupReading(
        usage_bytes=best[0], high_bytes=best[1], max_bytes=best[2], psi_some=some, psi_full=full
    )


def read_cgroup_v1(loc: CgroupLocation) -> CgroupReading:
    usage = _parse_count(_read_text(os.path.join(loc.path, "memory.usage_in_bytes")))
    if usage is None or usage >= NO_LIMIT_FLOOR:
        usage = 0
    stat = _parse_stat(_read_text(os.path.join(loc.path, "memory.stat")), _V1_STAT_KEYS)
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    limit = _parse_limit(_read_text(os.path.join(loc.path, "memory.limit_in_bytes")))
    # With use_hierarchy a parent's smaller limit binds too; the kernel reports the tightest.
    hier = stat.get("hierarchical_memory_limit", 0)
    if 0 < hier < NO_LIMIT_FLOOR and (not limit or hier < limit):
        limit = hier
    some, full = parse_psi(_read_text(os.path.join(loc.path, "memory.pressure")))
    return CgroupReading(
        usage_bytes=max(0, usage - inactive), high_bytes=0, max_bytes=limit, psi_some=some, psi_full=full
    )


class HostReader:
    """Reads one `HostSample` per call. The cgroup lookup (mountinfo can be long) is cached and
    redone only when /proc/self/cgroup changes, which also follows a process moved between
    cgroups at run time."""

    def __init__(self, root: str = "/") -> None:
        self.root = root
        self._use_psutil = sys.platform != "linux" and os.path.normpath(root) == os.sep
        self._cgroup_key: str | None = None
        self._location: CgroupLocation | None = None

    @property
    def location(self) -> CgroupLocation | None:
        """The memory cgroup found by the latest read (None: not in a known cgroup)."""
        return self._location

    def _locate(self) -> CgroupLocation | None:
        text = _read_text(os.path.join(self.root, "proc/self/cgroup"))
        if text != self._cgroup_key:
            self._cgroup_key = text
            self._location = locate_cgroup(self.root, text) if text else None
        return self._location

    def read(self) -> HostSample:
        if self._use_psutil:
            import psutil

            vm = psutil.virtual_memory()
            total = int(vm.total) if 0 < vm.total <= MAX_SANE_BYTES else 0
            return HostSample(total_bytes=total, available_bytes=min(int(vm.available), total))
        total, available = parse_meminfo(_read_text(os.path.join(self.root, "proc/meminfo")))
        some, full = parse_psi(_read_text(os.path.join(self.root, "proc/pressure/memory")))
        loc = self._locate()
        if loc is None:
            return HostSample(
                total_bytes=total, available_bytes=available, psi_some_avg10=some, psi_full_avg10=full
            )
        cg = read_cgroup_v2(loc) if loc.version == 2 else read_cgroup_v1(loc)
        # A container's own stall can be worse than the host's average: take the worse of the two.
        return HostSample(
            total_bytes=total,
            available_bytes=available,
            psi_some_avg10=max(some, cg.psi_some),
            psi_full_avg10=max(full, cg.psi_full),
            cgroup_version=loc.version,
            cgroup_usage_bytes=cg.usage_bytes,
            cgroup_high_bytes=cg.high_bytes,
            cgroup_max_bytes=cg.max_bytes,
        )


def read_host(root: str = "/") -> HostSample:
    """One uncached read of the host signals under `root` (MemWatch keeps a `HostReader`)."""
    return HostReader(root).read()
