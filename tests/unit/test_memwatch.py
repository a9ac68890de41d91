"""MemWatch: real first read, start/stop, listeners on level change, no torn snapshots under load."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.device import (
    DieReading,
    NvmlReader,
    NvmlUnavailable,
    StaticDeviceReader,
    SystemDeviceReader,
    map_visible_entry,
)
from ballast.memory.levels import die_level, host_level, worst
from ballast.memory.report import render
from ballast.memory.types import GiB, LadderPlan, Level, MemState
from ballast.memory.watch import MemWatch
from memfixtures import level_tree, write_tree


def make_watch(root: Path, *, poll_s: float = 0.25, reader: StaticDeviceReader | None = None) -> MemWatch:
    return MemWatch(
        MemoryConfig(root=str(root), poll_interval_s=poll_s), device_reader=reader or StaticDeviceReader()
    )


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Wait for a condition the poll thread brings about (a bound against hangs, not a timing test)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def watcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ballast-memwatch"]


def test_first_read_is_real(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        mem_total=32 * GiB,
        mem_available=7 * GiB,
        psi_some=2.5,
        cgroup="v2",
        cg_usage=GiB,
        cg_max=16 * GiB,
    )
    watch = make_watch(tmp_path, poll_s=60.0)  # the thread will not poll during this test
    assert watch.read().seq == 0  # placeholder before start: no host figures
    watch.start()
    try:
        state = watch.read()
        assert state.seq == 1 and state.taken_at > 0
        assert (state.host.total_bytes, state.host.available_bytes, state.host.cgroup_max_bytes) == (
            32 * GiB,
            7 * GiB,
            16 * GiB,
        )
        assert state.host.psi_some_avg10 == 2.5 and state.level == Level.WATCH
        assert state.host_reserve_bytes == int(0.15 * 16 * GiB)  # sized on the cgroup-limited total
    finally:
        watch.stop()


def test_start_stop_idempotent_and_restartable(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK)
    before = len(watcher_threads())
    watch = make_watch(tmp_path, poll_s=0.01)
    watch.stop()  # stop before start is a no-op
    watch.start()
    watch.start()
    assert watch.running and len(watcher_threads()) == before + 1
    assert all(t.daemon for t in watcher_threads())
    seq = watch.seq
    assert wait_for(lambda: watch.seq > seq + 3)  # the thread polls on its own
    watch.stop()
    watch.stop()
    assert not watch.running and len(watcher_threads()) == before
    stopped_at = watch.seq
    time.sleep(0.05)
    assert watch.seq == stopped_at  # nothing publishes after stop() returned
    with watch:  # and it starts again
        assert watch.running and watch.seq == stopped_at + 1
    assert not watch.running


def test_poll_thread_sees_a_rewritten_tree(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK, cgroup="v1")
    with make_watch(tmp_path, poll_s=0.01) as watch:
        assert watch.read().level == Level.OK
        level_tree(tmp_path, Level.CRITICAL, cgroup="v1")
        assert wait_for(lambda: watch.read().level == Level.CRITICAL)


def test_listener_on_level_change(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK, cgroup="v2")
    reader = StaticDeviceReader()
    watch = make_watch(tmp_path, poll_s=60.0, reader=reader)
    heard: list[tuple[Level, Level, int]] = []
    watch.add_listener(lambda old, new, state: heard.append((old, new, state.level)))
    watch.start()
    try:
        assert heard == []  # OK at start: no change
        level_tree(tmp_path, Level.TIGHT, cgroup="v2")
        state = watch.poll_now()
        assert state.level == Level.TIGHT
        assert heard == [(Level.OK, Level.TIGHT, Level.TIGHT)]
        write_tree(
            tmp_path,
            mem_total=64 * GiB,
            mem_available=60 * GiB,
            cgroup="v2",
            cg_max=8 * GiB,
            cg_usage=8 * GiB - 1_342_177_280,
        )
        watch.poll_now()  # different bytes, same level (TIGHT): no call
        assert len(heard) == 1
        level_tree(tmp_path, Level.OK, cgroup="v2")
        watch.poll_now()
        assert heard[-1] == (Level.TIGHT, Level.OK, Level.OK)
        watch.ledger.register_die(0, 9 * GiB, 9 * GiB)  # a die of ours, budget 8 GiB...
        reader.set(DieReading(index=0, name="gpu", total_bytes=9 * GiB, free_bytes=0))
        watch.poll_now()  # ...found full changes the level too
        assert heard[-1] == (Level.OK, Level.CRITICAL, Level.CRITICAL)
    finally:
        watch.stop()


def test_listener_errors_are_logged_not_propagated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    level_tree(tmp_path, Level.OK)
    watch = make_watch(tmp_path)
    heard: list[Level] = []

    def broken(old: Level, new: Level, state: MemState) -> None:
        raise RuntimeError("listener bug")

    watch.add_listener(broken)
    watch.add_listener(lambda old, new, state: heard.append(new))
    watch.poll_now()
    level_tree(tmp_path, Level.WATCH)
    with caplog.at_level(logging.ERROR, logger="ballast.memory.watch"):
        assert watch.poll_now().level == Level.WATCH
    assert heard == [Level.WATCH]
    assert "listener bug" in caplog.text


def test_listener_may_publish_without_deadlock(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK)
    watch = make_watch(tmp_path)
    heard: list[tuple[Level, Level]] = []

    def relieve(old: Level, new: Level, state: MemState) -> None:
        heard.append((old, new))
        if new == Level.CRITICAL:  # e.g. a listener that frees memory and re-polls at once
            level_tree(tmp_path, Level.OK)
            watch.poll_now()

    watch.add_listener(relieve)
    watch.poll_now()
    level_tree(tmp_path, Level.CRITICAL)
    assert watch.poll_now().level == Level.CRITICAL
    assert watch.read().level == Level.OK
    assert heard == [(Level.OK, Level.CRITICAL), (Level.CRITICAL, Level.OK)]  # a consistent chain


class FlakyReader:
    """A device reader whose driver fails the next `fail_next` calls, as NVML can after a GPU reset."""

    def __init__(self, fail_next: int) -> None:
        self.fail_next = fail_next

    def read(self) -> tuple[DieReading, ...]:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("driver hiccup")
        return (DieReading(index=0, name="gpu", total_bytes=16 * GiB, free_bytes=8 * GiB),)


def test_poll_thread_survives_a_failing_poll(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    level_tree(tmp_path, Level.OK)
    reader = FlakyReader(fail_next=1)
    watch = MemWatch(MemoryConfig(root=str(tmp_path), poll_interval_s=0.01), device_reader=reader)
    with pytest.raises(RuntimeError):
        watch.start()  # the synchronous first poll reports its failure to the caller
    assert not watch.running and watch.read().seq == 0
    watch.start()
    try:
        assert len(watch.read().dies) == 1
        with caplog.at_level(logging.ERROR, logger="ballast.memory.watch"):
            reader.fail_next = 2  # the thread's next two polls fail...
            assert wait_for(lambda: watch.poll_failures == 2)
            seq = watch.seq
            assert wait_for(lambda: watch.seq > seq)  # ...and it goes on polling
        assert watch.running and "driver hiccup" in caplog.text
    finally:
        watch.stop()


def test_device_figures_and_the_ledger_merge(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK)
    reader = StaticDeviceReader(
        [DieReading(index=0, name="H200", total_bytes=141 * GiB, free_bytes=100 * GiB)]
    )
    watch = make_watch(tmp_path, reader=reader)
    die = watch.poll_now().dies[0]
    assert (die.name, die.free_bytes, die.budget_bytes, die.level) == ("H200", 100 * GiB, 0, Level.OK)
    watch.ledger.register_die(0, 141 * GiB, 141 * GiB)  # ours now: budget 140 GiB
    lease = watch.ledger.lease(0, 90 * GiB, "weights")
    reader.set(DieReading(index=0, name="H200", total_bytes=141 * GiB, free_bytes=10 * GiB))
    die = watch.poll_now().dies[0]
    # 10 GiB free of the 50 GiB our 90 GiB of leases leave: no pressure (>= 50/8).
    assert (die.free_bytes, die.budget_bytes, die.ledger_bytes, die.level) == (
        10 * GiB,
        140 * GiB,
        90 * GiB,
        Level.OK,
    )
    reader.set(DieReading(index=0, name="H200", total_bytes=141 * GiB, free_bytes=3 * GiB))
    die = watch.poll_now().dies[0]
    assert (die.free_bytes, die.budget_bytes, die.level) == (3 * GiB, 140 * GiB, Level.TIGHT)  # < 50/16
    lease.release()


def test_readers_never_see_a_torn_snapshot(tmp_path: Path) -> None:
    """Two writers publish snapshots whose fields all derive from one counter each (die figures
    from the device reader and the ledger, host figures from an atomically rewritten meminfo);
    readers check every snapshot is internally consistent and that seq never goes backwards."""
    config = MemoryConfig(root=str(tmp_path), die_reserve_bytes=0)
    reader = StaticDeviceReader()
    watch = MemWatch(config, device_reader=reader)
    write_tree(tmp_path, mem_total=2 * GiB, mem_available=GiB)
    watch.poll_now()
    stop = threading.Event()
    problems: list[str] = []
    seen_seqs: list[int] = []

    def push_dies() -> None:
        k = 1
        while not stop.is_set():  # a die of 2k + 1 KiB, k KiB free
            watch.ledger.register_die(0, 2 * k * 1024 + 1, 2 * k * 1024 + 1)
            reader.set(DieReading(index=0, name="gpu", total_bytes=2 * k * 1024 + 1, free_bytes=k * 1024))
            watch.poll_now()
            k = k % 4096 + 1

    def rewrite_host() -> None:
        k = 1
        while not stop.is_set():
            write_tree(tmp_path, mem_total=2 * k * GiB, mem_available=k * GiB)
            watch.poll_now()
            k = k % 64 + 1

    def check(state: MemState) -> str | None:
        h = state.host
        if h.total_bytes != 2 * h.available_bytes:
            return f"host torn: {h.total_bytes} vs {h.available_bytes}"
        if state.host_level != host_level(h, config):
            return "host level does not match host figures"
        for d in state.dies:
            k = d.free_bytes // 1024
            if (d.total_bytes, d.level) != (2 * k * 1024 + 1, die_level(d.free_bytes, d.budget_bytes)):
                return f"die torn: {d}"
        if state.level != worst([state.host_level, *(d.level for d in state.dies)]):
            return "overall level does not match its parts"
        return None

    def read_hard() -> None:
        last = 0
        distinct = 0
        reads = 0
        # At least 20,000 reads, and on until 30 publishes were seen (a busy machine schedules
        # these threads less often); 30 s at most.
        deadline = time.monotonic() + 30
        while (reads < 20_000 or distinct <= 30) and time.monotonic() < deadline:
            reads += 1
            state = watch.read()
            if state.seq < last:
                problems.append(f"seq went back {last} -> {state.seq}")
            if state.seq != last:
                distinct += 1
            last = state.seq
            problem = check(state)
            if problem:
                problems.append(problem)
        seen_seqs.append(distinct)

    writers = [threading.Thread(target=push_dies), threading.Thread(target=rewrite_host)]
    readers = [threading.Thread(target=read_hard) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so reads land between writers' steps
    try:
        for t in writers + readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
        for t in writers:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert problems == []
    assert min(seen_seqs) > 20  # readers really ran during publishes


def test_render_shows_every_signal(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        mem_total=64 * GiB,
        mem_available=60 * GiB,
        psi_some=3.25,
        cgroup="v2",
        cg_usage=5 * GiB,
        cg_max=8 * GiB,
    )
    reader = StaticDeviceReader(
        [DieReading(index=0, name="NVIDIA H200", total_bytes=141 * GiB, free_bytes=100 * GiB)]
    )
    watch = make_watch(tmp_path, reader=reader)
    assert "no snapshot yet" in render(watch.read(), None)
    watch.ledger.register_die(0, total_bytes=141 * GiB, free_bytes=100 * GiB)
    watch.ledger.lease(0, 20 * GiB, "weights")
    plan = LadderPlan(
        level=Level.TIGHT,
        max_slots=4,
        context_window=1024,
        force_quantized_kv=True,
        kv_evict=True,
        degraded=True,
        note="halved",
    )
    text = render(watch.poll_now(), plan)
    for expected in (
        "level WATCH",  # 3 GiB free over a 1.2 GiB reserve in an 8 GiB cgroup (OK), PSI some 3.25%
        "64.00 GiB",
        "60.00 GiB",
        "8.00 GiB",
        "cgroup v2",
        "some 3.25%",
        "NVIDIA H200",
        "100.00 GiB",
        "140.00 GiB",
        "20.00 GiB",
        "90.00 GiB",
        "max slots 4",
        "context window 1024",
        "quantized KV forced",
        "KV eviction on",
        "halved",
    ):
        assert expected in text, expected
    assert "ladder" not in render(watch.read(), None)


def test_visible_devices_map_to_nvml_handles() -> None:
    handles = ["h0", "h1", "h2"]
    uuids = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-bbbc-3333"]
    assert map_visible_entry("2", handles, uuids) == "h2"
    assert map_visible_entry("GPU-aaaa", handles, uuids) == "h0"  # CUDA accepts a unique UUID prefix
    for bad in ("3", "GPU-bbb", "MIG-aaaa", "gpu0"):  # out of range, ambiguous, MIG, garbage
        with pytest.raises(NvmlUnavailable):
            map_visible_entry(bad, handles, uuids)


@pytest.mark.skipif(NvmlReader().available, reason="this box has NVML GPUs")
def test_cpu_box_reports_no_gpus(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK)
    assert SystemDeviceReader().read() == ()
    watch = MemWatch(MemoryConfig(root=str(tmp_path)))  # the default, real device reader
    assert watch.poll_now().dies == ()
