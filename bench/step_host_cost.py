"""The engine's host cost of one decode step, the model's forward stubbed out: each step submitted
alone and waited for (plan -> batch -> runner -> sampler -> result), on the CPU, so two trees can be
compared without a GPU and without the forward's own time in the figure.

    python -m ballast.bench.step_host_cost [--model tiny-qwen3-next] [--batches 1 32] [--steps 200]

The forward returns a fixed [rows, vocab] of zeros (greedy then samples token 0: the tokens are
not the point). Run it from each tree's root with PYTHONPATH set to that root to compare them; it
uses only `Engine.load`, `Engine.submit` and the plan types, which the older trees have too.
Medians of --rounds rounds of --steps steps; table on stdout, JSON to
bench/results/step_host_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, cast

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from torch import Tensor, nn

try:
    from ballast.engine.config import PrefixCacheConfig
except ImportError:  # trees before the rebuild kept it beside the cache
    from ballast.engine.kv.prefix_cache import PrefixCacheConfig  # type: ignore[no-redef,attr-defined,unused-ignore]

RESULTS = Path(__file__).parent / "results" / "step_host_cost.json"
GREEDY = SamplingParams(temperature=0.0)
PROMPT = 16


class StubForward(nn.Module):
    """Zeros for every row asked, in the model's place (its config kept for the runner)."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        super().__init__()
        config = cast(Any, model).config
        self.config = config
        self._logits = torch.zeros(rows, int(config.vocab_size))

    def forward(self, batch: object, states: object) -> Tensor:
        return self._logits[: batch.num_seqs]  # type: ignore[attr-defined]


def host_cost_us(engine: Engine, batch: int, steps: int, rounds: int) -> list[float]:
    """Per-step microseconds of `rounds` rounds, after a warm-up, over `batch` prefilled slots."""
    sampling = dict.fromkeys(range(batch), GREEDY)
    chunks = tuple(PrefillChunk(s, tuple(range(1, PROMPT + 1)), 0, True) for s in range(batch))
    result = engine.submit(StepPlan(prefills=chunks, sampling=sampling)).result()
    last = {o.slot: o.token_id for o in result.outputs}
    model = engine.runner.model
    engine.runner.model = StubForward(model, batch)
    pos = PROMPT

    def step() -> None:
        nonlocal pos
        plan = StepPlan(decodes=tuple(DecodeToken(s, last[s], pos) for s in range(batch)), sampling=sampling)
        for o in engine.submit(plan).result().outputs:
            last[o.slot] = o.token_id
        pos += 1

    try:
        for _ in range(steps // 4):
            step()
        out = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(steps):
                step()
            out.append((time.perf_counter() - t) / steps * 1e6)
        return out
    finally:
        engine.runner.model = model
        engine.submit(StepPlan(release=tuple(range(batch)))).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen3-next", help="a built-in model name")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    positions = PROMPT + args.steps // 4 + args.rounds * args.steps + 8
    engine = Engine.load(
        EngineConfig(
            model="builtin:" + args.model,
            device="cpu",
            max_num_seqs=max(args.batches),
            max_model_len=positions,
        ),
        prefix_cache=PrefixCacheConfig(fraction=0.0),
    )
    rows = []
    try:
        for batch in args.batches:
            us = host_cost_us(engine, batch, args.steps, args.rounds)
            median = statistics.median(us)
            rows.append({"model": args.model, "batch": batch, "median_us": median, "rounds_us": us})
    finally:
        engine.shutdown()
    print("| model | batch | host us a step, median | min |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['median_us']:.0f} | {min(r['rounds_us']):.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
