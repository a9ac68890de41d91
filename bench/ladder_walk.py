"""The ladder walked by real memory pressure: what the KV pools, the prefix cache and the checkpoint
pool hold at each level while greedy streams run through the real scheduler.

- CPU (default): the script makes a child of its own memory cgroup (v1 or v2, where it may), with
  a limit, moves itself into it, and starts a memory hog beside the engine in the same cgroup.
  Streams of the default model.
- CUDA (`--device cuda`): a second process takes VRAM on the engine's GPU. Streams of a
  Llama-3.2-1B-shaped model with random weights (built by transformers, saved, loaded by ballast).

Either way the hog is sized so the level (MemWatch's own reading of the cgroup or the die) sits at
OK, WATCH, TIGHT, CRITICAL and OK again, a few seconds each, and what ballast holds is recorded at
the end of each phase. On a die CRITICAL means no free VRAM at all, which a co-tenant reaches only
by exhausting the die (and then nobody on it can allocate): the CUDA walk stops at TIGHT. Every
request must complete.

    python -m ballast.bench.ladder_walk [--limit-gib 4] [--phase-s 6] [--streams 8]
    python -m ballast.bench.ladder_walk --device cuda --streams 32 --phase-s 5 --new-tokens 4000

The CPU walk needs permission to create a cgroup (root on a cgroup v1 memory hierarchy or a
delegated v2 subtree); it says why and exits otherwise. Table on stdout, JSON to
bench/results/ladder_walk[_cuda].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.memory.types import GiB, Level, MiB

RESULTS = Path(__file__).parent / "results"
VRAM_HOG = (
    "import sys, torch\nheld = []\nchunk = 64 << 20\nfor line in sys.stdin:\n    want = int(line)\n"
    "    while (len(held) + 1) * chunk <= want:\n        try:\n"
    "            held.append(torch.empty(chunk, dtype=torch.uint8, device='cuda'))\n"
    "        except torch.OutOfMemoryError:\n            break\n"
    "    while held and len(held) * chunk > want:\n        held.pop()\n"
    "    torch.cuda.empty_cache()\n    torch.cuda.synchronize()\n    print(len(held) * chunk, flush=True)\n"
)
# A Llama-3.2-1B-shaped model: 1.2 B parameters, 32 KiB of KV per token in bf16.
CUDA_MODEL = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 16384,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
HOG = (
    "import sys\nheld = []\nfor line in sys.stdin:\n    want = int(line)\n    have = sum(len(b) for b in "
    "held)\n"
    "    while have < want:\n        n = min(64 << 20, want - have); b = bytearray(n)\n"
    "        b[::4096] = b'x' * len(b[::4096]); held.append(b); have += n\n"
    "    while held and have - len(held[-1]) >= want:\n        have -= len(held.pop())\n"
    "    print(have, flush=True)\n"
)


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
        limit_file = child / (
            "memory.limit_in_bytes" if (parent / "memory.limit_in_bytes").exists() else "memory.max"
        )
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


class Hog:
    """A second process holding as many bytes as it is told (host RAM, or VRAM on the GPU)."""

    def __init__(self, program: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.bytes = 0

    def set(self, n: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{max(0, n)}\n")
        self.proc.stdin.flush()
        self.bytes = int(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def hog_target(state: Any, hog: Hog, level: Level, device: str) -> int:
    """Bytes the hog should hold for the level's band: in the cgroup, available memory against the
    host reserve; on the die, free VRAM against the room our own leases leave (levels.die_level)."""
    if device == "cpu":
        reserve, limit = state.host_reserve_bytes, state.host.effective_total_bytes
        target = {
            Level.OK: 3 * reserve,
            Level.WATCH: reserve * 3 // 2,
            Level.TIGHT: reserve * 11 // 10,
            Level.CRITICAL: reserve * 9 // 10,
        }[level]
        return int(limit - target - (state.host.cgroup_usage_bytes - hog.bytes))
    die = state.dies[0]
    room = max(0, die.budget_bytes - die.ledger_bytes)
    target = {Level.OK: room // 4, Level.WATCH: room * 3 // 32, Level.TIGHT: room // 24}[level]
    return int(hog.bytes + die.free_bytes - target)


def load_engine(args: argparse.Namespace, watch: Any, pool: Any, slots: int, work: Path | None) -> Any:
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine

    if args.device == "cpu":
        return Engine.load(
            EngineConfig(
                model="default",
                device="cpu",
                max_num_seqs=slots,
                max_model_len=2048,
                prefill_chunk_tokens=512,
            ),
            watch,
            pool=pool,
        )
    assert work is not None
    return Engine.load(
        EngineConfig(
            model=str(work),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=slots,
            max_model_len=8192,
            prefill_chunk_tokens=2048,
        ),
        watch,
        pool=pool,
    )


async def walk(args: argparse.Namespace, work: Path | None) -> dict[str, Any]:
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
    engine = load_engine(args, watch, pool, slots, work)
    cuda = args.device == "cuda"
    sched = Scheduler(
        engine if not cuda else TokenIdsEngine(engine), SchedulerConfig(max_num_seqs=slots), memwatch=watch
    )
    hog = Hog(VRAM_HOG if cuda else HOG)
    hog.set(0)  # waits until the hog is up (on CUDA: torch imported, a context made)
    slowest_set = 0.0

    def figures(level: Level) -> dict[str, Any]:
        state = watch.poll_now()
        main, int8 = engine.runner.kv, engine.runner.kv_int8
        cache = engine.prefix_cache
        row = {
            "asked": level.name,
            "level": state.level.name,
            "hog_mib": hog.bytes / MiB,
            "slowest_hog_step_s": slowest_set,
            "kv_main_mib": (main.bytes_held if main else 0) / MiB,
            "kv_int8_mib": (int8.bytes_held if int8 else 0) / MiB,
            "int8_blocks": int8.figures().used_blocks if int8 else 0,
            "prefix_cache_mib": (cache.bytes_held if cache else 0) / MiB,
            "checkpoint_pool_mib": pool.stats().bytes_held / MiB,
            "preemptions": engine.slot_kv.preemptions,
            "running": sched.active_slots,
            "queued": sched.queue_depth,
        }
        if cuda:
            die = state.dies[0]
            row |= {
                "free_mib": die.free_bytes / MiB,
                "ledger_mib": die.ledger_bytes / MiB,
                "budget_mib": die.budget_bytes / MiB,
            }
        else:
            row["cgroup_usage_mib"] = state.host.cgroup_usage_bytes / MiB
        return row

    rows: list[dict[str, Any]] = []
    greedy = SamplingParams(temperature=0.0)
    levels = (Level.OK, Level.WATCH, Level.TIGHT) + (() if cuda else (Level.CRITICAL,)) + (Level.OK,)
    await sched.start()
    try:
        if cuda:
            base = tuple(range(1000, 1000 + args.prompt_tokens + 60 * (args.streams + args.late)))
        else:
            base = tuple(
                engine.tokenizer.encode(
                    "The history of memory in computing, told slowly and in detail. " * 60
                )
            )
        # Staggered lengths: some streams end in every phase, so the rungs that give free memory
        # back have some to give.
        handles = [
            sched.submit(
                GenerationRequest(
                    f"r{i}",
                    base[: args.prompt_tokens + 40 * i] + (i + 7,),
                    greedy,
                    max_tokens=args.new_tokens * (i + 1) // args.streams,
                )
            )
            for i in range(args.streams)
        ]
        tasks = [asyncio.ensure_future(h.collect()) for h in handles]
        for level in levels:
            end = time.monotonic() + args.phase_s
            late = level is Level.WATCH
            slowest_set = 0.0
            while time.monotonic() < end:
                t0 = time.monotonic()
                # In a thread: the scheduler runs on this loop and must not wait for the hog.
                await asyncio.to_thread(hog.set, hog_target(watch.poll_now(), hog, level, args.device))
                slowest_set = max(slowest_set, time.monotonic() - t0)
                if late and watch.read().level is Level.WATCH:  # arrivals at WATCH start in int8 blocks
                    tasks += [
                        asyncio.ensure_future(
                            sched.submit(
                                GenerationRequest(
                                    f"late{i}",
                                    base[: args.prompt_tokens * 3 // 5 + 20 * i] + (i + 3,),
                                    greedy,
                                    max_tokens=args.new_tokens,
                                )
                            ).collect()
                        )
                        for i in range(args.late)
                    ]
                    late = False
                await asyncio.sleep(0.25)
            rows.append(figures(level))
            print(f"  {rows[-1]}", flush=True)
        hog.set(0)
        done = await asyncio.gather(*tasks)
        rows.append(figures(Level.OK) | {"asked": "end"})
    finally:
        await sched.stop()
        engine.shutdown()
        watch.stop()
        hog.kill()
    return {
        "device": args.device,
        "rows": rows,
        "finished": [fin.reason for _, _, fin in done],
        "tokens": [len(t) for _, t, _ in done],
    }


class TokenIdsEngine:
    """The engine as the scheduler sees it, emitting no text: a random-weight model has no
    tokenizer, and the walk counts bytes and tokens, not words."""

    class _NoText:
        stopped = False

        def add(self, token_id: int) -> str:
            return ""

        def flush(self) -> str:
            return ""

    class _NoTokenizer:
        eos_token_ids: tuple[int, ...] = ()  # streams end at max_tokens

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.tokenizer = self._NoTokenizer()

    def new_detokenizer(self, prompt_ids: object, stop: tuple[str, ...] = ()) -> Any:
        return self._NoText()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def build_cuda_model(work_dir: str | None) -> Path:
    """Random weights for CUDA_MODEL, written as a Hugging Face directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="ballast-ladder-", dir=work_dir))
    fields = {k: v for k, v in CUDA_MODEL.items() if k != "model_type"}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("llama", **fields), dtype=torch.bfloat16
        )
    model.save_pretrained(str(work))
    del model
    torch.cuda.empty_cache()
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--limit-gib", type=float, default=4.0, help="the CPU walk's cgroup limit")
    parser.add_argument("--phase-s", type=float, default=6.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument(
        "--prompt-tokens", type=int, default=500, help="the first stream's; stream i gets 40 i more"
    )
    parser.add_argument(
        "--new-tokens", type=int, default=480, help="the longest stream's; stream i gets (i+1)/streams of it"
    )
    parser.add_argument(
        "--late", type=int, default=4, help="requests that arrive at WATCH (their KV is int8)"
    )
    parser.add_argument("--work-dir", default=None, help="where the CUDA walk writes its random-weight model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = (
        Path(args.out)
        if args.out
        else RESULTS / ("ladder_walk.json" if args.device == "cpu" else "ladder_walk_cuda.json")
    )
    if args.device == "cpu":
        parent, child = make_child(int(args.limit_gib * GiB))
        try:
            report = asyncio.run(walk(args, None))
        finally:
            remove_child(parent, child)
        where = f"a {args.limit_gib:g} GiB memory cgroup, {args.streams} streams of the default model"
    else:
        work = build_cuda_model(args.work_dir)
        try:
            report = asyncio.run(walk(args, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        where = (
            f"VRAM taken by a second process, {args.streams} streams of a Llama-3.2-1B-shaped model (bf16)"
        )
    print(f"\nladder walk: {where}")
    first = "cgroup MiB" if args.device == "cpu" else "free MiB"
    print(
        f"asked     level     {first:>10}  hog MiB  KV main MiB  KV int8 MiB  int8 blocks  prefix MiB  pool "
        "MiB  "
        "preempted  running"
    )
    for r in report["rows"]:
        used = r.get("cgroup_usage_mib", r.get("free_mib", 0.0))
        print(
            f"{r['asked']:<9} {r['level']:<9} {used:10.0f} {r['hog_mib']:8.0f} {r['kv_main_mib']:12.1f} "
            f"{r['kv_int8_mib']:12.1f} {r['int8_blocks']:12} {r['prefix_cache_mib']:11.1f} "
            f"{r['checkpoint_pool_mib']:9.1f} {r['preemptions']:10} {r['running']:8}"
        )
    print(f"finished: {report['finished']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
