"""Seed 000's level tables, row by row, from fixture trees read by the real readers (no cgroup, v1, v2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.device import DieReading, StaticDeviceReader
from ballast.memory.host import read_host
from ballast.memory.levels import bytes_level, die_level, host_level, host_reserve_bytes, psi_level, worst
from ballast.memory.types import GiB, Level, MiB
from ballast.memory.watch import MemWatch
from memfixtures import CgroupMode, level_tree, write_file, write_tree

KiB = 1024
CFG = MemoryConfig()
MODES: list[CgroupMode] = [None, "v1", "v2"]
# 20 GiB effective total: the default reserve is max(1 GiB, 15%) = exactly 3 GiB.
TOTAL = 20 * GiB
R = 3 * GiB


def tree_with_available(
    root: Path, mode: CgroupMode, available: int, psi_some: float = 0.0, psi_full: float = 0.0
) -> None:
    """A tree whose *effective* available bytes are `available` and effective total is TOTAL.

    Without a cgroup it is the host's MemAvailable; with one, a 64 GiB host holds a TOTAL-limited
    cgroup whose usage (plus 1 GiB of reclaimable cache, which must not count) leaves `available`.
    PSI goes to the host file, except on v2 where it goes to the cgroup's own memory.pressure.
    """
    if mode is None:
        write_tree(root, mem_total=TOTAL, mem_available=available, psi_some=psi_some, psi_full=psi_full)
        return
    on_v2 = mode == "v2"
    write_tree(
        root,
        mem_total=64 * GiB,
        mem_available=60 * GiB,
        cgroup=mode,
        cg_max=TOTAL,
        cg_usage=TOTAL - available + GiB,
        inactive_file=GiB,
        psi_some=0.0 if on_v2 else psi_some,
        psi_full=0.0 if on_v2 else psi_full,
        cg_psi_some=psi_some if on_v2 else 0.0,
        cg_psi_full=psi_full if on_v2 else 0.0,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("available", "expect"),
    [
        (0, Level.CRITICAL),
        (R - KiB, Level.CRITICAL),
        (R, Level.CRITICAL),  # avail <= reserve
        (R + KiB, Level.TIGHT),
        (R + R // 4 - KiB, Level.TIGHT),  # slack < reserve/4
        (R + R // 4, Level.WATCH),
        (2 * R - KiB, Level.WATCH),  # slack < reserve
        (2 * R, Level.OK),
        (TOTAL - GiB, Level.OK),
    ],
)
def test_host_byte_table(tmp_path: Path, mode: CgroupMode, available: int, expect: Level) -> None:
    tree_with_available(tmp_path, mode, available)
    sample = read_host(str(tmp_path))
    assert sample.effective_total_bytes == TOTAL
    assert sample.effective_available_bytes == available
    assert host_level(sample, CFG) == expect


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("some", "full", "expect"),
    [
        (0.0, 0.0, Level.OK),
        (0.01, 0.0, Level.WATCH),  # some > 0
        (9.99, 0.0, Level.WATCH),
        (10.0, 0.0, Level.TIGHT),  # some >= 10
        (0.0, 0.01, Level.TIGHT),  # full > 0: a decaying blip is only TIGHT
        (0.0, 14.99, Level.TIGHT),
        (0.0, 15.0, Level.CRITICAL),  # full >= 15: a stall
        (60.0, 40.0, Level.CRITICAL),
    ],
)
def test_psi_table(tmp_path: Path, mode: CgroupMode, some: float, full: float, expect: Level) -> None:
    tree_with_available(tmp_path, mode, TOTAL - GiB, psi_some=some, psi_full=full)
    assert host_level(read_host(str(tmp_path)), CFG) == expect


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("available", "some", "full", "expect"),
    [
        (2 * R - KiB, 10.0, 0.0, Level.TIGHT),  # bytes WATCH, PSI TIGHT
        (R + KiB, 0.5, 0.0, Level.TIGHT),  # bytes TIGHT, PSI WATCH
        (R, 0.5, 0.0, Level.CRITICAL),  # bytes CRITICAL, PSI WATCH
        (2 * R, 0.0, 20.0, Level.CRITICAL),  # bytes OK, PSI stall
    ],
)
def test_host_is_worst_of_bytes_and_psi(
    tmp_path: Path, mode: CgroupMode, available: int, some: float, full: float, expect: Level
) -> None:
    tree_with_available(tmp_path, mode, available, psi_some=some, psi_full=full)
    assert host_level(read_host(str(tmp_path)), CFG) == expect


@pytest.mark.parametrize(
    ("config", "effective_total", "reserve"),
    [
        (CFG, 4 * GiB, GiB),  # small box: the 1 GiB floor
        (CFG, 20 * GiB, 3 * GiB),  # 15%
        (MemoryConfig(host_reserve_bytes=512 * MiB), 20 * GiB, 512 * MiB),  # fixed reserve wins
        (MemoryConfig(host_reserve_min_bytes=0, host_reserve_fraction=0.25), 8 * GiB, 2 * GiB),
    ],
)
def test_host_reserve(config: MemoryConfig, effective_total: int, reserve: int) -> None:
    assert host_reserve_bytes(effective_total, config) == reserve


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_cgroup_full_of_page_cache_is_not_critical(tmp_path: Path, mode: CgroupMode) -> None:
    # After loading weights, a cgroup's usage is mostly reclaimable file cache.
    write_tree(
        tmp_path,
        mem_total=64 * GiB,
        mem_available=60 * GiB,
        cgroup=mode,
        cg_max=8 * GiB,
        cg_usage=8 * GiB - 64 * MiB,
        inactive_file=6 * GiB,
    )
    assert host_level(read_host(str(tmp_path)), CFG) == Level.OK
    write_tree(
        tmp_path,
        mem_total=64 * GiB,
        mem_available=60 * GiB,
        cgroup=mode,
        cg_max=8 * GiB,
        cg_usage=8 * GiB - 64 * MiB,
    )
    assert host_level(read_host(str(tmp_path)), CFG) == Level.CRITICAL  # the same usage without cache


def test_unknown_total_is_judged_by_what_is_known(tmp_path: Path) -> None:
    # Nothing readable: OK (refusing everything on a read failure would take the server down).
    assert host_level(read_host(str(tmp_path)), CFG) == Level.OK
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=8 * GiB, psi_full=20.0)
    write_file(tmp_path, "proc/meminfo", "MemTotal: garbage\n")
    assert host_level(read_host(str(tmp_path)), CFG) == Level.CRITICAL  # PSI still counts
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=8 * GiB)
    write_file(tmp_path, "proc/meminfo", f"MemTotal: garbage\nMemAvailable: {512 * 1024} kB\n")
    assert host_level(read_host(str(tmp_path)), CFG) == Level.CRITICAL  # 512 MiB < the 1 GiB floor
    write_file(tmp_path, "proc/meminfo", f"MemTotal: garbage\nMemAvailable: {4 * 1024 * 1024} kB\n")
    assert host_level(read_host(str(tmp_path)), CFG) == Level.OK


BUDGET = 16 * GiB


def die_watch(root: Path, frees: list[int], budget: int) -> MemWatch:
    """A MemWatch whose dies (ours: registered with the ledger) have `budget` and these frees."""
    config = MemoryConfig(root=str(root))
    total = budget + config.die_reserve_bytes
    watch = MemWatch(
        config, StaticDeviceReader([DieReading(i, "gpu", total, free) for i, free in enumerate(frees)])
    )
    for index in range(len(frees)):
        watch.ledger.register_die(index, total, total)
    return watch


@pytest.mark.parametrize(
    ("free", "budget", "expect"),
    [
        (0, BUDGET, Level.CRITICAL),
        (1, BUDGET, Level.TIGHT),
        (BUDGET // 16 - 1, BUDGET, Level.TIGHT),  # < budget/16
        (BUDGET // 16, BUDGET, Level.WATCH),
        (BUDGET // 8 - 1, BUDGET, Level.WATCH),  # < budget/8
        (BUDGET // 8, BUDGET, Level.OK),
        (BUDGET, BUDGET, Level.OK),
        (0, 0, Level.OK),  # budget 0: die not tracked, skipped
    ],
)
def test_die_table_through_memwatch(tmp_path: Path, free: int, budget: int, expect: Level) -> None:
    level_tree(tmp_path, Level.OK)
    state = die_watch(tmp_path, [free], budget).poll_now()
    assert state.dies[0].level == expect == die_level(free, budget)
    assert state.host_level == Level.OK and state.level == expect


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("host", "die_frees", "expect"),
    [
        (Level.OK, (BUDGET, BUDGET), Level.OK),
        (Level.WATCH, (BUDGET, 1), Level.TIGHT),  # a die is worse
        (Level.CRITICAL, (BUDGET,), Level.CRITICAL),  # the host is worse
        (Level.TIGHT, (BUDGET // 10, BUDGET), Level.TIGHT),  # die WATCH, host TIGHT
        (Level.OK, (BUDGET, BUDGET // 10, 0), Level.CRITICAL),  # worst die of three
    ],
)
def test_overall_is_worst_of_host_and_every_die(
    tmp_path: Path, mode: CgroupMode, host: Level, die_frees: tuple[int, ...], expect: Level
) -> None:
    level_tree(tmp_path, host, cgroup=mode)
    state = die_watch(tmp_path, list(die_frees), BUDGET).poll_now()
    assert state.host_level == host
    assert [d.level for d in state.dies] == [die_level(f, BUDGET) for f in die_frees]
    assert state.level == expect


def test_untracked_gpu_does_not_raise_the_level(tmp_path: Path) -> None:
    # Another tenant filling a GPU we never claimed is not our pressure.
    level_tree(tmp_path, Level.OK)
    reader = StaticDeviceReader([DieReading(index=0, name="gpu0", total_bytes=80 * GiB, free_bytes=0)])
    watch = MemWatch(MemoryConfig(root=str(tmp_path)), device_reader=reader)
    state = watch.poll_now()
    assert state.dies[0].budget_bytes == 0 and state.level == Level.OK
    # Once the engine claims it (registers it with the ledger), its level counts.
    watch.ledger.register_die(0, total_bytes=80 * GiB, free_bytes=70 * GiB)
    state = watch.poll_now()
    assert state.dies[0].budget_bytes == 79 * GiB and state.level == Level.CRITICAL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", list(Level))
def test_level_tree_fixture(tmp_path: Path, mode: CgroupMode, level: Level) -> None:
    level_tree(tmp_path, level, cgroup=mode)
    assert host_level(read_host(str(tmp_path)), CFG) == level


def test_pure_table_functions_agree() -> None:
    assert bytes_level(R, R) == Level.CRITICAL and bytes_level(2 * R, R) == Level.OK
    assert psi_level(0.0, 0.0, CFG) == Level.OK and psi_level(0.0, 15.0, CFG) == Level.CRITICAL
    assert psi_level(5.0, 0.0, MemoryConfig(psi_some_tight_pct=5.0)) == Level.TIGHT
    assert worst([]) == Level.OK and worst([Level.WATCH, Level.OK, Level.TIGHT]) == Level.TIGHT


@pytest.mark.parametrize(
    ("free", "ledger", "expect"),
    [
        (BUDGET // 10, 0, Level.WATCH),  # nothing of ours: 10% free of the whole budget is WATCH
        (
            BUDGET // 10,
            BUDGET * 9 // 10,
            Level.OK,
        ),  # our pool leased to the ceiling: the cushion left is no pressure
        (BUDGET // 100, BUDGET * 9 // 10, Level.WATCH),  # others ate into the remainder
        (BUDGET // 200, BUDGET * 9 // 10, Level.TIGHT),
        (0, BUDGET * 9 // 10, Level.CRITICAL),
    ],
)
def test_our_own_leases_do_not_raise_the_die_level(free: int, ledger: int, expect: Level) -> None:
    assert die_level(free, BUDGET, ledger) == expect
