"""The CPU engine's thread policy (engine/threads.py) on real cgroup trees in a temp dir (v2
`cpu.max` with a tighter parent, v1 CFS quota, none, garbled files), and a real engine that sizes
its pool by it and says so in its start-up log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.threads import CpuShare, decode_threads, describe, intra_op_threads, read_cpu_share
from memfixtures import write_file

from ballast.settings import ConfigError

V2_MOUNTINFO = (
    "22 1 0:21 / / rw,relatime - overlay overlay rw\n"
    "31 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
)
V1_MOUNTINFO = (
    "22 1 0:21 / / rw,relatime - overlay overlay rw\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)


def v2_tree(root: Path, own: str | None, parent: str | None) -> None:
    write_file(root, "proc/self/mountinfo", V2_MOUNTINFO)
    write_file(root, "proc/self/cgroup", "0::/kube.slice/pod.scope\n")
    if parent is not None:
        write_file(root, "sys/fs/cgroup/kube.slice/cpu.max", parent)
    if own is not None:
        write_file(root, "sys/fs/cgroup/kube.slice/pod.scope/cpu.max", own)
    (root / "sys/fs/cgroup/kube.slice/pod.scope").mkdir(parents=True, exist_ok=True)


def v1_tree(root: Path, quota: str, period: str = "100000\n") -> None:
    write_file(root, "proc/self/mountinfo", V1_MOUNTINFO)
    write_file(root, "proc/self/cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    write_file(root, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", quota)
    write_file(root, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", period)


def test_v2_quota_binds_and_a_tighter_parent_wins(tmp_path: Path) -> None:
    v2_tree(tmp_path, own="400000 100000\n", parent="max 100000\n")
    share = read_cpu_share(str(tmp_path), affinity=16)
    assert share.quota == 4.0 and share.usable == 4
    assert intra_op_threads(share) == 3  # one left to the event loop
    v2_tree(tmp_path, own="400000 100000\n", parent="250000 100000\n")
    share = read_cpu_share(str(tmp_path), affinity=16)
    assert share.quota == 2.5 and share.usable == 2  # half a CPU of quota keeps no thread busy
    assert share.cgroup.endswith("kube.slice/pod.scope")
    assert intra_op_threads(share) == 1


def test_affinity_binds_below_the_quota(tmp_path: Path) -> None:
    v2_tree(tmp_path, own="800000 100000\n", parent=None)
    assert read_cpu_share(str(tmp_path), affinity=2).usable == 2


def test_v1_cfs_quota(tmp_path: Path) -> None:
    v1_tree(tmp_path, "300000\n")
    assert read_cpu_share(str(tmp_path), affinity=8).quota == 3.0
    v1_tree(tmp_path, "-1\n")  # v1's "no quota"
    share = read_cpu_share(str(tmp_path), affinity=8)
    assert share.quota is None and share.cgroup == "" and intra_op_threads(share) == 7


@pytest.mark.parametrize("text", ["", "garbage\n", "max\n", "-5 100000\n", "100000 0\n"])
def test_a_garbled_or_absent_quota_is_no_quota(tmp_path: Path, text: str) -> None:
    v2_tree(tmp_path, own=text, parent=None)
    assert read_cpu_share(str(tmp_path), affinity=4).quota is None
    assert read_cpu_share(str(tmp_path / "nowhere"), affinity=4) == CpuShare(4, None, "")


def test_one_cpu_still_runs_one_thread_and_a_setting_overrides() -> None:
    assert intra_op_threads(CpuShare(1, None, "")) == 1
    assert intra_op_threads(CpuShare(1, 0.5, "x")) == 1
    assert intra_op_threads(CpuShare(8, None, ""), configured=6) == 6


def test_cpu_threads_setting_is_validated() -> None:
    with pytest.raises(ConfigError, match="cpu-threads"):
        EngineConfig(cpu_threads=-1)


def test_engine_sizes_its_pool_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ballast.engine.startup"):
        eng = Engine.load(
            EngineConfig(
                model="builtin:tiny-llama", device="cpu", max_num_seqs=1, max_model_len=64, cpu_threads=1
            )
        )
    try:
        seen = eng._executor.submit(torch.get_num_threads).result()  # the engine thread's pool
        assert seen == 1
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU threads:")]
        assert lines == [describe(read_cpu_share(), 1, configured=1)]
        assert lines[0].startswith("CPU threads: 1 (--cpu-threads; affinity ")
    finally:
        eng.shutdown()


def test_the_block_decode_step_may_use_every_usable_cpu() -> None:
    # its extra threads step aside while another process holds their cores (cpu_blocks.DecodeThreads)
    assert decode_threads(CpuShare(affinity=4, quota=None, cgroup="")) == 4
    assert decode_threads(CpuShare(affinity=4, quota=2.5, cgroup="/x")) == 2  # the quota binds
    assert decode_threads(CpuShare(affinity=4, quota=None, cgroup=""), configured=3) == 3
    assert intra_op_threads(CpuShare(affinity=4, quota=None, cgroup="")) == 3  # torch's pool: one fewer
