"""How the drafting governor treats each request of a mixed sequence, in process on the default
model (CPU): one scheduler with `--speculative-config` ngram k=4, greedy, a free story (200 tokens)
then a paragraph copy (150), twice. For each request, the governor's counters over it: steps with
and without drafts, drafts proposed and kept, declines by reason; and tokens/s after the first.
A copy after a story is the case a per-batch-size verdict got wrong (it inherited "loses").

    python -m ballast.bench.spec_story_copy [--k 4] [--out bench/results/spec_story_copy.json]

Counts, not timings, are the result: on a shared machine tokens/s swing several-fold.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time
from pathlib import Path
from typing import Any

from ballast.bench.spec_decode import COPY, STORY
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest, TokenEvent
from ballast.scheduler.scheduler import Scheduler

RESULTS = Path(__file__).resolve().parent / "results" / "spec_story_copy.json"
ORDER = (("story", STORY, 200), ("copy", COPY, 150), ("story", STORY, 200), ("copy", COPY, 150))


async def run(k: int) -> list[dict[str, Any]]:
    engine = Engine.load(EngineConfig(max_num_seqs=2, max_model_len=2048))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4})
    s = Scheduler(engine, SchedulerConfig(max_num_seqs=2, speculative_config=spec, stale_snapshot_s=0.0))
    await s.start()
    rows = []
    try:
        for name, text, n in ORDER:
            ids = tuple(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            before = copy.deepcopy(s._planner.drafts.stats)
            got, first = 0, 0.0
            req = GenerationRequest(name, ids, SamplingParams(temperature=0.0), max_tokens=n)
            async for event in s.submit(req):
                if isinstance(event, TokenEvent):
                    got += len(event.token_ids)
                    first = first or time.perf_counter()
            after = s._planner.drafts.stats
            rows.append(
                {
                    "request": name,
                    "tokens": got,
                    "tok_s": round((got - 1) / (time.perf_counter() - first), 1),
                    "steps_drafting": after.steps_drafting - before.steps_drafting,
                    "steps_plain": after.steps_plain - before.steps_plain,
                    "drafted": after.drafted - before.drafted,
                    "accepted": after.accepted - before.accepted,
                    "declined": {r: c - before.declined.get(r, 0) for r, c in after.declined.items()},
                }
            )
    finally:
        await s.stop()
        engine.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = asyncio.run(run(args.k))
    head = ("tokens", 8), ("tok/s", 8), ("drafting", 10), ("plain", 7), ("drafted", 9), ("kept", 6)
    print(f"{'request':10s}" + "".join(f"{h:>{w}s}" for h, w in head) + "  declined")
    for r in rows:
        print(
            f"{r['request']:10s}{r['tokens']:8d}{r['tok_s']:8.1f}{r['steps_drafting']:10d}{r['steps_plain']:7d}"
            f"{r['drafted']:9d}{r['accepted']:6d}  {r['declined']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"k": args.k, "requests": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
