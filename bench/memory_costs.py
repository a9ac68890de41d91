"""What the memory layer costs: one host poll, one admission decision, one ladder plan, pool
get/put, the page-fault cost the pool saves (and on CUDA the device-to-host copy into a fresh
pageable buffer against a pooled pinned one), and the CPU share of a running MemWatch thread.

Polls read this machine's real /proc and cgroup files. Micro-costs are medians over batches of
calls (microseconds per call); the MemWatch share is the poll thread's own CPU time (from the
kernel's per-thread accounting) over the wall time it ran. Table on stdout, JSON to
bench/results/memory_costs.json.

    python -m ballast.bench.memory_costs [--watch-seconds 5] [--poll-s 0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from ballast.memory.admission import admit_request
from ballast.memory.config import MemoryConfig
from ballast.memory.host import HostReader, read_host
from ballast.memory.ladder import LadderConfig, plan_for
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import CostModel, DieState, Level, MemState, MiB
from ballast.memory.watch import MemWatch

RESULTS = Path(__file__).parent / "results" / "memory_costs.json"

# A cost shaped like a small hybrid model: bf16 KV of 8 attention layers x 2 KV heads x 128 dims,
# 24 linear-attention layers of float32 recurrent state, and measured-looking activations.
COST = CostModel(
    kv_bytes_per_token=8 * 2 * 2 * 128 * 2,
    state_bytes_per_slot=24 * 16 * 128 * 128 * 4,
    activation_bytes_per_prefill_token=64 * 1024,
    quantized_kv_bytes_per_token=8 * 2 * 2 * (128 + 4),
)


def per_call_us(fn: Callable[[], object], calls: int, batches: int) -> dict[str, float]:
    """Median and p90 of per-call microseconds over `batches` batches of `calls` calls."""
    fn()  # warm caches and lazy imports outside the measurement
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / calls / 1000.0)
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "p90_us": samples[int(0.9 * (len(samples) - 1))],
        "calls": calls * batches,
    }


def watch_cpu_share(seconds: float, poll_s: float) -> dict[str, float]:
    """Run a real MemWatch for `seconds` and read its thread's CPU time from the kernel."""
    watch = MemWatch(MemoryConfig(poll_interval_s=poll_s))
    proc = psutil.Process()
    with watch:
        thread = next(t for t in threading.enumerate() if t.name == "ballast-memwatch")

        def thread_cpu() -> float:
            # The thread's own CPU clock (ns resolution); psutil's per-thread times tick at 10 ms,
            # too coarse for a thread that runs ~1 ms per poll.
            if hasattr(time, "pthread_getcpuclockid") and thread.ident is not None:
                return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            return next(t.user_time + t.system_time for t in proc.threads() if t.id == thread.native_id)

        seq0, cpu0, proc0, t0 = watch.seq, thread_cpu(), proc.cpu_times(), time.monotonic()
        time.sleep(seconds)
        seq1, cpu1, proc1, t1 = watch.seq, thread_cpu(), proc.cpu_times(), time.monotonic()
    wall = t1 - t0
    polls = seq1 - seq0
    return {
        "poll_interval_s": poll_s,
        "wall_s": wall,
        "polls": polls,
        "thread_cpu_s": cpu1 - cpu0,
        "thread_cpu_share_pct": 100.0 * (cpu1 - cpu0) / wall,
        "process_cpu_share_pct": 100.0 * ((proc1.user + proc1.system) - (proc0.user + proc0.system)) / wall,
        "thread_cpu_us_per_poll": 1e6 * (cpu1 - cpu0) / polls if polls else float("nan"),
    }


def fill_costs(nbytes: int, reps: int) -> dict[str, float]:
    """Writing a checkpoint into a fresh buffer (pages faulted in on first touch) against a pooled
    one (pages already resident): the cost the pool exists to remove."""
    pool = CheckpointPool(lambda: psutil.virtual_memory().total, 0.25, 4, MiB, pin=False)
    fresh, pooled = [], []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        fresh.append((time.perf_counter_ns() - t0) / 1e6)
        buf = pool.get(nbytes)
        t0 = time.perf_counter_ns()
        buf.fill_(1)
        pooled.append((time.perf_counter_ns() - t0) / 1e6)
        pool.put(buf)
    return {
        "bytes": nbytes,
        "fresh_fill_ms": statistics.median(fresh),
        "pooled_fill_ms": statistics.median(pooled[1:] or pooled),
    }


def d2h_costs(nbytes: int, reps: int) -> dict[str, float] | None:
    """On CUDA: a checkpoint save (device -> host) into a fresh pageable buffer (the slow case:
    pages not yet resident) against a pooled pinned one, and the restore (host -> device)
    from each. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device_buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    pool = CheckpointPool(lambda: psutil.virtual_memory().total, 0.25, 4, MiB, pin=True)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        dst.copy_(src)
        torch.cuda.synchronize()
        return (time.perf_counter_ns() - t0) / 1e6

    save_fresh, save_pooled, restore_fresh, restore_pooled = [], [], [], []
    for _ in range(reps):
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        save_fresh.append(timed(fresh, device_buf))
        restore_fresh.append(timed(device_buf, fresh))
        buf = pool.get(nbytes)
        save_pooled.append(timed(buf[:nbytes], device_buf))
        restore_pooled.append(timed(device_buf, buf[:nbytes]))
        pool.put(buf)
    return {
        "bytes": nbytes,
        "fresh_pageable_ms": statistics.median(save_fresh),
        "pooled_pinned_ms": statistics.median(save_pooled[1:] or save_pooled),
        "restore_fresh_pageable_ms": statistics.median(restore_fresh),
        "restore_pooled_pinned_ms": statistics.median(restore_pooled[1:] or restore_pooled),
        "pinned": float(pool.pinned),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watch-seconds", type=float, default=5.0)
    parser.add_argument("--poll-s", type=float, default=0.25)
    parser.add_argument("--fill-mib", type=int, default=150, help="checkpoint size for the fill comparison")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    config = MemoryConfig()
    reader = HostReader("/")
    watch = MemWatch(config)
    state = watch.poll_now()
    die = DieState(
        index=0,
        total_bytes=80 << 30,
        free_bytes=60 << 30,
        budget_bytes=79 << 30,
        ledger_bytes=20 << 30,
        ceiling_bytes=54 << 30,
    )
    gpu_state = MemState(
        host=state.host, dies=(die,), host_reserve_bytes=state.host_reserve_bytes, level=state.level
    )
    ladder = LadderConfig(max_slots=32, context_window=8192)
    pool = CheckpointPool(lambda: state.host.effective_total_bytes, 0.05, 16, MiB, pin=False)
    pool.put(torch.empty(64 * MiB, dtype=torch.uint8))

    def pool_round_trip() -> None:
        pool.put(pool.get(48 * MiB))

    def host_admit() -> object:
        return admit_request(
            4000,
            512,
            state,
            COST,
            max_window=1 << 20,
            gpu_die=None,
            quantized_kv=False,
            psi_full_reject_pct=config.psi_full_reject_pct,
        )

    def gpu_admit() -> object:
        return admit_request(
            4000,
            512,
            gpu_state,
            COST,
            max_window=8192,
            gpu_die=0,
            quantized_kv=False,
            psi_full_reject_pct=config.psi_full_reject_pct,
        )

    rows = {
        "host poll, cached cgroup lookup (HostReader.read)": per_call_us(reader.read, 20, 50),
        "host poll, cold (read_host)": per_call_us(lambda: read_host("/"), 10, 30),
        "MemWatch.poll_now (host + GPUs + publish)": per_call_us(watch.poll_now, 20, 50),
        "admit_request, host path": per_call_us(host_admit, 200, 50),
        "admit_request, GPU path": per_call_us(gpu_admit, 200, 50),
        "plan_for (CRITICAL)": per_call_us(lambda: plan_for(Level.CRITICAL, ladder), 500, 50),
        "pool get+put (hit, 48 MiB of 64 MiB)": per_call_us(pool_round_trip, 200, 50),
    }
    fill = fill_costs(args.fill_mib * MiB, reps=9)
    d2h = d2h_costs(args.fill_mib * MiB, reps=9)
    share = watch_cpu_share(args.watch_seconds, args.poll_s)

    print(f"{'operation':52s} {'median us':>11s} {'p90 us':>10s} {'calls':>7s}")
    for name, r in rows.items():
        print(f"{name:52s} {r['median_us']:11.2f} {r['p90_us']:10.2f} {r['calls']:7d}")
    print(
        f"\ncheckpoint write, {args.fill_mib} MiB: fresh buffer {fill['fresh_fill_ms']:.1f} ms, pooled "
        f"buffer {fill['pooled_fill_ms']:.1f} ms"
    )
    if d2h is not None:
        print(
            f"checkpoint save (device-to-host), {args.fill_mib} MiB: fresh pageable "
            f"{d2h['fresh_pageable_ms']:.1f} ms, pooled pinned {d2h['pooled_pinned_ms']:.1f} ms"
        )
        print(
            f"checkpoint restore (host-to-device), {args.fill_mib} MiB: pageable "
            f"{d2h['restore_fresh_pageable_ms']:.1f} ms, "
            f"pooled pinned {d2h['restore_pooled_pinned_ms']:.1f} ms"
        )
    print(
        f"MemWatch at {share['poll_interval_s']} s over {share['wall_s']:.1f} s: {share['polls']} polls, "
        f"thread CPU {share['thread_cpu_share_pct']:.3f}% ({share['thread_cpu_us_per_poll']:.0f} us/poll), "
        f"whole process {share['process_cpu_share_pct']:.3f}%"
    )

    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "host": {
            "total_bytes": state.host.total_bytes,
            "effective_total_bytes": state.host.effective_total_bytes,
            "cgroup_version": state.host.cgroup_version,
            "level": state.level.name,
        },
        "micro": rows,
        "checkpoint_fill": fill,
        "checkpoint_d2h": d2h,
        "memwatch": share,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
