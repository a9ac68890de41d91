"""The ladder walked by a real memory cgroup on the CPU: what the KV pools, the prefix cache and the
checkpoint pool hold at each level while 8 greedy streams of the default model run.

The script makes a child of its own memory cgroup (v1 or v2, where it may), with a limit, moves
itself into it, and starts a memory hog beside the engine in the same cgroup. It sizes the hog so
the cgroup sits at OK, WATCH, TIGHT, CRITICAL and OK again (from MemWatch's own reading of the
cgroup), a few seconds each, and records what ballast holds at the end of each phase. Every
request must complete; the tokens are those of a calm run for requests whose format did not change.

    python -m ballast.bench.ladder_walk [--limit-gib 4] [--phase-s 6] [--streams 8]

Needs permission to create a cgroup (root on a cgroup v1 memory hierarchy or a delegated v2
subtree); says why and exits otherwise. Table on stdout, JSON to bench/results/ladder_walk.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ballast.memory.types import GiB, Level, MiB

RESULTS = Path(__file__).parent / "results" / "ladder_walk.json"
HOG = ("import sys\nheld = []\nfor line in sys.stdin:\n    want = int(line)\n    have = sum(len(b) for b in held)\n"
       "    while have < want:\n        n = min(64 << 20, want - have); b = bytearray(n)\n"
       "        b[::4096] = b'x' * len(b[::4096]); held.append(b); have += n\n"
       "    while held and have - len(held[-1]) >= want:\n        have -= len(held.pop())\n"
       "    print(have, flush=True)\n")


def own_memory_cgroup() -> Path:
    """This process's memory cgroup directory (v1 memory controller, else the v2 unified one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    raise SystemExit("ladder_walk: no memory cgroup found for this process")


def make_child(limit: int) -> tuple[Path, Path]:
    parent = own_memory_cgroup()
    child = parent / f"ballast-ladder-{os.getpid()}"
    try:
        child.mkdir()
        limit_file = child / ("memory.limit_in_bytes" if (parent / "memory.limit_in_bytes").exists() else "memory.max")
        limit_file.write_text(str(limit))
        (child / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise SystemExit(f"ladder_walk: cannot make a memory cgroup under {parent}: {e}") from e
    return parent, child


def remove_child(parent: Path, child: Path) -> None:
    (parent / "cgroup.procs").write_text(str(os.getpid()))
    for _ in range(50):
        try:
            child.rmdir()
            return
        except OSError:
            time.sleep(0.1)


async def walk(args: argparse.Namespace) -> dict[str, Any]:
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine
    from ballast.engine.plan import SamplingParams
    from ballast.memory.config import MemoryConfig
    from ballast.memory.pool import CheckpointPool
    from ballast.memory.watch import MemWatch
    from ballast.scheduler.config import SchedulerConfig
    from ballast.scheduler.request import GenerationRequest
    from ballast.scheduler.scheduler import Scheduler

    watch = MemWatch(MemoryConfig())
    watch.start()
    pool = CheckpointPool(lambda: watch.read().host.effective_total_bytes, 0.25, 64, 1 << 20)
    slots = args.streams + args.late
    engine = Engine.load(EngineConfig(model="default", device="cpu", max_num_seqs=slots, max_model_len=2048,
                                      prefill_chunk_tokens=512), watch, pool=pool)
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=slots), memwatch=watch)
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert hog.stdin is not None and hog.stdout is not None
    hog_bytes = 0

    def set_hog(n: int) -> None:
        nonlocal hog_bytes
        assert hog.stdin is not None and hog.stdout is not None
        hog.stdin.write(f"{max(0, n)}\n")
        hog.stdin.flush()
        hog_bytes = int(hog.stdout.readline())

    def hold(level: Level) -> None:
        """Size the hog so the cgroup's available memory sits in the level's band."""
        state = watch.poll_now()
        reserve, limit = state.host_reserve_bytes, state.host.effective_total_bytes
        target = {Level.OK: 3 * reserve, Level.WATCH: reserve * 3 // 2, Level.TIGHT: reserve * 11 // 10,
                  Level.CRITICAL: reserve * 9 // 10}[level]
        others = state.host.cgroup_usage_bytes - hog_bytes
        set_hog(limit - target - others)

    def figures(level: Level) -> dict[str, Any]:
        state = watch.poll_now()
        main, int8 = engine.runner.kv, engine.runner.kv_int8
        cache = engine.prefix_cache
        return {"asked": level.name, "level": state.level.name, "cgroup_usage_mib": state.host.cgroup_usage_bytes / MiB,
                "hog_mib": hog_bytes / MiB, "kv_main_mib": (main.bytes_held if main else 0) / MiB,
                "kv_int8_mib": (int8.bytes_held if int8 else 0) / MiB,
                "int8_blocks": int8.figures().used_blocks if int8 else 0,
                "prefix_cache_mib": (cache.bytes_held if cache else 0) / MiB,
                "checkpoint_pool_mib": pool.stats().bytes_held / MiB, "preemptions": engine.preemptions,
                "running": sched.active_slots, "queued": sched.queue_depth}

    rows: list[dict[str, Any]] = []
    greedy = SamplingParams(temperature=0.0)
    await sched.start()
    try:
        base = tuple(engine.tokenizer.encode("The history of memory in computing, told slowly and in detail. " * 60))
        # Staggered lengths: some streams end in every phase, so the rungs that give free memory
        # back have some to give.
        handles = [sched.submit(GenerationRequest(f"r{i}", base[: 500 + 40 * i] + (i + 7,), greedy,
                                                  max_tokens=args.new_tokens * (i + 1) // args.streams))
                   for i in range(args.streams)]
        tasks = [asyncio.ensure_future(h.collect()) for h in handles]
        for level in (Level.OK, Level.WATCH, Level.TIGHT, Level.CRITICAL, Level.OK):
            end = time.monotonic() + args.phase_s
            late = level is Level.WATCH
            while time.monotonic() < end:
                hold(level)
                if late and watch.read().level is Level.WATCH:  # arrivals at WATCH start in int8 blocks
                    tasks += [asyncio.ensure_future(sched.submit(GenerationRequest(
                        f"late{i}", base[: 300 + 20 * i] + (i + 3,), greedy, max_tokens=args.new_tokens)).collect())
                        for i in range(args.late)]
                    late = False
                await asyncio.sleep(0.25)
            rows.append(figures(level))
            print(f"  {rows[-1]}", flush=True)
        set_hog(0)
        done = await asyncio.gather(*tasks)
        rows.append(figures(Level.OK) | {"asked": "end"})
    finally:
        await sched.stop()
        engine.shutdown()
        watch.stop()
        hog.kill()
    return {"rows": rows, "finished": [fin.reason for _, _, fin in done],
            "tokens": [len(t) for _, t, _ in done]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, default=4.0)
    parser.add_argument("--phase-s", type=float, default=6.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=480, help="the longest stream's; stream i gets (i+1)/streams of it")
    parser.add_argument("--late", type=int, default=4, help="requests that arrive at WATCH (their KV is int8)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    parent, child = make_child(int(args.limit_gib * GiB))
    try:
        report = asyncio.run(walk(args))
    finally:
        remove_child(parent, child)
    print(f"\nladder walk in a {args.limit_gib:g} GiB memory cgroup, {args.streams} streams of the default model")
    print("asked     level     cgroup MiB  hog MiB  KV main MiB  KV int8 MiB  int8 blocks  prefix MiB  pool MiB  "
          "preempted  running")
    for r in report["rows"]:
        print(f"{r['asked']:<9} {r['level']:<9} {r['cgroup_usage_mib']:10.0f} {r['hog_mib']:8.0f} {r['kv_main_mib']:12.1f} "
              f"{r['kv_int8_mib']:12.1f} {r['int8_blocks']:12} {r['prefix_cache_mib']:11.1f} "
              f"{r['checkpoint_pool_mib']:9.1f} {r['preemptions']:10} {r['running']:8}")
    print(f"finished: {report['finished']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
