"""The admission ceiling under load (issue 31): the 8B shape on one GPU with a ledger budget that
holds a fraction of what 32 streams ask for, through the real Scheduler and Engine.

What it checks and records: the start-up capacity line (KV room, activations, the sampler and
prompt-logprob workspaces now leased), every ledger lease by tag, admission verdicts by kind, and
the KV pool's refused segment grants. An ADMIT charges the request's whole window against the
ledger as held now, so a segment grant refused while only admitted requests grow (a LedgerFull
after an ADMIT) would mean admission counted something twice; it must stay 0, the ledger's held
bytes at or under its ceiling, and every stream must end (completed, capped, or refused with a
retryable error), with the pool back to idle.

    python -m ballast.bench.admission_ceiling [--model builtin:llama-8b] [--streams 32]
        [--kv-room-gib 6] [--prompt-tokens 1024] [--new-tokens 3072]

Table on stdout, JSON to bench/results/admission_ceiling.json. Needs CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from ballast.memory.types import GiB, MiB

RESULTS = Path(__file__).resolve().parent / "results" / "admission_ceiling.json"


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Verdicts:
    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}

    def record(self, verdict: Any) -> None:
        self.kinds[verdict.kind.value] = self.kinds.get(verdict.kind.value, 0) + 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from ballast.bench.ladder_walk import TokenIdsEngine
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine
    from ballast.engine.plan import SamplingParams
    from ballast.memory.config import MemoryConfig
    from ballast.memory.watch import MemWatch
    from ballast.scheduler.config import SchedulerConfig
    from ballast.scheduler.errors import Refused
    from ballast.scheduler.request import GenerationRequest
    from ballast.scheduler.scheduler import Scheduler

    watch = MemWatch(MemoryConfig())
    watch.start()
    capture = _Capture()
    logging.getLogger("ballast").addHandler(capture)
    logging.getLogger("ballast").setLevel(logging.INFO)
    cfg = EngineConfig(
        model=args.model,
        device="cuda",
        max_num_seqs=args.streams,
        max_model_len=args.prompt_tokens + args.new_tokens,
    )
    engine = Engine.load(cfg, watch)
    die = engine.gpu_die
    assert die is not None
    # What loading left, less --kv-room-gib, is held back under a lease of its own: the ledger
    # then has that much room for everything served, far less than 32 whole windows.
    spare = watch.ledger.headroom(die) - int(args.kv_room_gib * GiB)
    held_back = watch.ledger.lease(die, max(0, spare), "bench-held-back")
    verdicts = _Verdicts()
    sched = Scheduler(
        TokenIdsEngine(engine),
        SchedulerConfig(max_num_seqs=args.streams, max_queue_wait_s=0),
        memwatch=watch,
        admission_metrics=verdicts,
    )
    held_peak = [0]
    done = asyncio.Event()

    async def watch_ledger() -> None:
        while not done.is_set():
            held_peak[0] = max(held_peak[0], watch.ledger.held(die))
            await asyncio.sleep(0.05)

    async def one(i: int) -> str:
        prompt = tuple((7 + 13 * i + 31 * k) % 40_000 + 10 for k in range(args.prompt_tokens))
        req = GenerationRequest(f"s{i}", prompt, SamplingParams(temperature=0.0), max_tokens=args.new_tokens)
        try:
            _, tokens, fin = await sched.submit(req).collect()
        except Refused as exc:
            return f"refused:{type(exc).__name__}"
        if fin.error is not None:
            return f"refused:{type(fin.error).__name__}"
        return "capped" if len(tokens) < args.new_tokens else "completed"

    await sched.start()
    t0 = time.perf_counter()
    poller = asyncio.get_running_loop().create_task(watch_ledger())
    try:
        outcomes = await asyncio.gather(*(one(i) for i in range(args.streams)))
    finally:
        done.set()
        await poller
        await sched.stop()
    wall = time.perf_counter() - t0
    kv = engine.runner.kv
    refused_grants = kv.refused if kv is not None else 0
    leases = [(tag, n / MiB) for tag, n in watch.ledger.leases(die)]
    result = {
        "model": args.model,
        "gpu": torch.cuda.get_device_name(),
        "streams": args.streams,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "ceiling_mib": watch.ledger.ceiling(die) / MiB,
        "held_peak_mib": held_peak[0] / MiB,
        "capacity_line": next((x for x in capture.lines if x.startswith("capacity:")), ""),
        "leases_mib": leases,
        "verdicts": verdicts.kinds,
        "outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
        "refused_segment_grants": refused_grants,
        "preemptions": engine.slot_kv.preemptions,
        "wall_s": round(wall, 1),
    }
    held_back.release()
    engine.shutdown()
    watch.stop()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:llama-8b")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--kv-room-gib", type=float, default=6.0)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=3072)
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(result["capacity_line"])
    print(f"{'lease':<40} {'MiB':>10}")
    for tag, mib in result["leases_mib"]:
        print(f"{tag:<40} {mib:>10.1f}")
    print(
        f"ceiling {result['ceiling_mib']:.0f} MiB, held peak {result['held_peak_mib']:.0f} MiB; verdicts "
        f"{result['verdicts']}; outcomes {result['outcomes']}; refused segment grants "
        f"{result['refused_segment_grants']}; preemptions {result['preemptions']}; {result['wall_s']} s"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    if result["held_peak_mib"] > result["ceiling_mib"] or result["refused_segment_grants"]:
        raise SystemExit("the ledger passed its ceiling, or a segment grant was refused after an ADMIT")


if __name__ == "__main__":
    main()
