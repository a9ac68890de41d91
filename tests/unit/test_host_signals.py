"""Host signal readers against real files in temp trees: meminfo, PSI, cgroup v1/v2, degraded reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ballast.memory.host import HostReader, locate_cgroup, read_host
from ballast.memory.types import GiB, MiB
from memfixtures import V1_CGROUP, V2_CGROUP, write_file, write_tree


def test_meminfo_without_cgroup(tmp_path: Path) -> None:
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=5 * GiB, psi_some=1.5, psi_full=0.25)
    s = read_host(str(tmp_path))
    assert (s.total_bytes, s.available_bytes) == (16 * GiB, 5 * GiB)
    assert (s.psi_some_avg10, s.psi_full_avg10) == (1.5, 0.25)
    assert s.cgroup_version == 0 and s.cgroup_limit_bytes == 0
    assert s.effective_total_bytes == 16 * GiB and s.effective_available_bytes == 5 * GiB


def test_cgroup_v2_limits_and_page_cache(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        mem_total=64 * GiB,
        mem_available=60 * GiB,
        cgroup="v2",
        cg_usage=7 * GiB,
        cg_high=6 * GiB,
        cg_max=8 * GiB,
        inactive_file=3 * GiB,
    )
    s = read_host(str(tmp_path))
    assert s.cgroup_version == 2
    # Reclaimable page cache (inactive_file) is not counted as used.
    assert s.cgroup_usage_bytes == 4 * GiB
    assert (s.cgroup_high_bytes, s.cgroup_max_bytes) == (6 * GiB, 8 * GiB)
    assert s.effective_total_bytes == 6 * GiB  # memory.high binds before memory.max
    assert s.effective_available_bytes == 2 * GiB


def test_cgroup_v2_max_means_no_limit(tmp_path: Path) -> None:
    write_tree(tmp_path, mem_total=32 * GiB, mem_available=20 * GiB, cgroup="v2", cg_usage=GiB)
    s = read_host(str(tmp_path))
    assert s.cgroup_version == 2 and s.cgroup_high_bytes == 0 and s.cgroup_max_bytes == 0
    assert s.effective_total_bytes == 32 * GiB and s.effective_available_bytes == 20 * GiB


def test_cgroup_v2_parent_limit_binds(tmp_path: Path) -> None:
    # A Kubernetes pod or systemd slice limit sits on the parent; our own cgroup says "max".
    write_tree(tmp_path, mem_total=64 * GiB, mem_available=60 * GiB, cgroup="v2", cg_usage=GiB)
    parent = str(Path(V2_CGROUP).parent)
    write_file(tmp_path, f"{parent}/memory.max", f"{4 * GiB}\n")
    write_file(tmp_path, f"{parent}/memory.current", f"{3 * GiB}\n")
    write_file(tmp_path, f"{parent}/memory.stat", f"inactive_file {512 * MiB}\n")
    s = read_host(str(tmp_path))
    assert s.cgroup_max_bytes == 4 * GiB
    assert s.cgroup_usage_bytes == 3 * GiB - 512 * MiB
    assert s.effective_available_bytes == GiB + 512 * MiB


def test_cgroup_psi_takes_the_worse_of_host_and_cgroup(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        mem_total=16 * GiB,
        mem_available=8 * GiB,
        psi_some=4.0,
        psi_full=0.0,
        cgroup="v2",
        cg_psi_some=2.0,
        cg_psi_full=3.0,
    )
    s = read_host(str(tmp_path))
    assert (s.psi_some_avg10, s.psi_full_avg10) == (4.0, 3.0)


def test_cgroup_v1_limit_usage_and_unlimited(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        mem_total=64 * GiB,
        mem_available=60 * GiB,
        cgroup="v1",
        cg_usage=5 * GiB,
        cg_max=8 * GiB,
        inactive_file=2 * GiB,
    )
    s = read_host(str(tmp_path))
    assert s.cgroup_version == 1  # hybrid host: v1 memory controller wins over the unified mount
    assert (s.cgroup_usage_bytes, s.cgroup_max_bytes, s.cgroup_high_bytes) == (3 * GiB, 8 * GiB, 0)
    assert s.effective_total_bytes == 8 * GiB and s.effective_available_bytes == 5 * GiB
    write_tree(tmp_path, mem_total=64 * GiB, mem_available=60 * GiB, cgroup="v1", cg_usage=GiB)
    s = read_host(str(tmp_path))
    assert s.cgroup_version == 1 and s.cgroup_max_bytes == 0  # 9223372036854771712 is no limit
    assert s.effective_total_bytes == 64 * GiB


def test_cgroup_v1_hierarchical_limit_binds(tmp_path: Path) -> None:
    write_tree(tmp_path, mem_total=64 * GiB, mem_available=60 * GiB, cgroup="v1", cg_usage=GiB)
    write_file(
        tmp_path, f"{V1_CGROUP}/memory.stat", f"total_inactive_file 0\nhierarchical_memory_limit {3 * GiB}\n"
    )
    assert read_host(str(tmp_path)).cgroup_max_bytes == 3 * GiB


@pytest.mark.parametrize(
    ("mount_root", "cg_path", "expect"),
    [
        ("/", "/kubepods/pod1/ctr", "sys/fs/cgroup/kubepods/pod1/ctr"),  # host view
        ("/docker/abc", "/docker/abc", "sys/fs/cgroup"),  # container without a cgroup namespace
        ("/", "/", "sys/fs/cgroup"),  # container with a cgroup namespace
        ("/", "/../../outside", "sys/fs/cgroup"),  # path outside the namespace's visible tree
        ("/", "/gone/away", "sys/fs/cgroup"),  # directory missing: the mount itself
    ],
)
def test_locate_cgroup_v2_paths(tmp_path: Path, mount_root: str, cg_path: str, expect: str) -> None:
    write_file(
        tmp_path, "proc/self/mountinfo", f"31 22 0:26 {mount_root} /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    )
    write_file(tmp_path, "proc/self/cgroup", f"0::{cg_path}\n")
    (tmp_path / "sys/fs/cgroup/kubepods/pod1/ctr").mkdir(parents=True)
    loc = locate_cgroup(str(tmp_path))
    assert loc is not None and loc.version == 2
    assert Path(loc.path) == tmp_path / expect
    assert Path(loc.mount) == tmp_path / "sys/fs/cgroup"


def test_locate_cgroup_unescapes_mount_point(tmp_path: Path) -> None:
    write_file(tmp_path, "proc/self/mountinfo", "31 22 0:26 / /my\\040cgroups rw - cgroup2 cgroup2 rw\n")
    write_file(tmp_path, "proc/self/cgroup", "0::/\n")
    loc = locate_cgroup(str(tmp_path))
    assert loc is not None and Path(loc.path) == tmp_path / "my cgroups"


def test_reader_follows_a_cgroup_change(tmp_path: Path) -> None:
    reader = HostReader(str(tmp_path))
    write_tree(
        tmp_path, mem_total=64 * GiB, mem_available=60 * GiB, cgroup="v2", cg_usage=GiB, cg_max=4 * GiB
    )
    assert reader.read().cgroup_max_bytes == 4 * GiB
    write_tree(
        tmp_path, mem_total=64 * GiB, mem_available=60 * GiB, cgroup="v1", cg_usage=GiB, cg_max=2 * GiB
    )
    s = reader.read()
    assert (s.cgroup_version, s.cgroup_max_bytes) == (1, 2 * GiB)
    write_tree(tmp_path, mem_total=64 * GiB, mem_available=60 * GiB)
    assert reader.read().cgroup_version == 0 and reader.location is None


# --- degraded reads: every bad value means "not known", never a huge budget ---


@pytest.mark.parametrize(
    ("meminfo", "total", "available"),
    [
        (None, 0, 0),  # file missing
        ("garbage\n\x00\x01", 0, 0),
        ("MemTotal: lots kB\nMemAvailable: 1024 kB\n", 0, 1 << 20),
        ("MemTotal: -16 kB\nMemAvailable: 1024 kB\n", 0, 1 << 20),
        (f"MemTotal: {1 << 60} kB\nMemAvailable: 1024 kB\n", 0, 1 << 20),  # absurd total
        ("MemTotal: 1048576 kB\nMemAvailable: 4194304 kB\n", GiB, GiB),  # available capped at total
        ("MemTotal: 1048576 kB\nMemFree: 524288 kB\n", GiB, GiB // 2),  # pre-3.14 kernel
        ("MemTotal: 1048576 kB\n", GiB, 0),
    ],
)
def test_degraded_meminfo(tmp_path: Path, meminfo: str | None, total: int, available: int) -> None:
    if meminfo is not None:
        write_file(tmp_path, "proc/meminfo", meminfo)
    s = read_host(str(tmp_path))
    assert (s.total_bytes, s.available_bytes) == (total, available)


@pytest.mark.parametrize(
    "psi",
    [
        None,
        "",
        "some avg10=abc avg60=0 avg300=0 total=0\nfull avg10=x\n",
        "some avg10=-3.0 avg60=0\nfull avg10=-1\n",
        "some avg10=250.0\nfull avg10=nan\n",
        "some avg10=inf\nfull\n",
    ],
)
def test_degraded_psi_is_no_pressure(tmp_path: Path, psi: str | None) -> None:
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=8 * GiB)
    if psi is None:
        (tmp_path / "proc/pressure/memory").unlink()
    else:
        write_file(tmp_path, "proc/pressure/memory", psi)
    s = read_host(str(tmp_path))
    assert (s.psi_some_avg10, s.psi_full_avg10) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("current", "limit", "usage", "max_bytes"),
    [
        ("garbage", "also garbage", 0, 0),
        ("-5", "-1", 0, 0),
        (str(2 * GiB), str(1 << 62), 2 * GiB, 0),  # absurd limit: none
        (str(1 << 62), str(4 * GiB), 0, 4 * GiB),  # absurd usage: unknown
        (str(2 * GiB), "0", 2 * GiB, 0),  # a 0 limit is unset, not "nothing allowed"
        (None, str(4 * GiB), 0, 4 * GiB),  # usage file missing
    ],
)
def test_degraded_cgroup_v2(
    tmp_path: Path, current: str | None, limit: str, usage: int, max_bytes: int
) -> None:
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=8 * GiB, cgroup="v2")
    write_file(tmp_path, f"{V2_CGROUP}/memory.stat", "inactive_file banana\n")
    write_file(tmp_path, f"{V2_CGROUP}/memory.max", limit)
    if current is None:
        (tmp_path / V2_CGROUP / "memory.current").unlink()
    else:
        write_file(tmp_path, f"{V2_CGROUP}/memory.current", current)
    s = read_host(str(tmp_path))
    assert (s.cgroup_version, s.cgroup_usage_bytes, s.cgroup_max_bytes) == (2, usage, max_bytes)
    assert s.effective_available_bytes <= 8 * GiB


def test_degraded_cgroup_v1_garbage(tmp_path: Path) -> None:
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=8 * GiB, cgroup="v1", cg_usage=GiB, cg_max=4 * GiB)
    write_file(tmp_path, f"{V1_CGROUP}/memory.limit_in_bytes", "unlimited?")
    write_file(tmp_path, f"{V1_CGROUP}/memory.usage_in_bytes", "-12")
    write_file(
        tmp_path, f"{V1_CGROUP}/memory.stat", "total_inactive_file NaN\nhierarchical_memory_limit -1\n"
    )
    s = read_host(str(tmp_path))
    assert (s.cgroup_version, s.cgroup_usage_bytes, s.cgroup_max_bytes) == (1, 0, 0)
    assert s.effective_total_bytes == 16 * GiB


@pytest.mark.parametrize("broken", ["no-mountinfo", "garbage-cgroup", "garbage-mountinfo"])
def test_unlocatable_cgroup_is_no_cgroup(tmp_path: Path, broken: str) -> None:
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=8 * GiB, cgroup="v2", cg_max=GiB)
    if broken == "no-mountinfo":
        (tmp_path / "proc/self/mountinfo").unlink()
    elif broken == "garbage-cgroup":
        write_file(tmp_path, "proc/self/cgroup", "this is not a cgroup file\n")
    else:
        write_file(tmp_path, "proc/self/mountinfo", "1 2 3\n - - -\n")
    s = read_host(str(tmp_path))
    assert s.cgroup_version == 0 and s.effective_total_bytes == 16 * GiB


@pytest.mark.skipif(sys.platform != "linux", reason="reads this box's /proc")
def test_real_host_reads_sane_figures() -> None:
    s = read_host("/")
    assert s.total_bytes > 0 and 0 < s.available_bytes <= s.total_bytes
    assert 0.0 <= s.psi_some_avg10 <= 100.0
