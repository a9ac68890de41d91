"""Prefill tokens saved by prefix reuse on a multi-turn chat, through the real scheduler and engine.

Each turn's prompt is the previous prompt + the model's answer + a new user message, as a chat
client sends it. Two arms per model on CPU: the prefix cache off (cold: every turn prefills its
whole prompt) and on (warm: a turn restores the previous turn's end-of-generation checkpoint and
prefills only the new message). Greedy, so both arms must produce the same tokens (checked). The
figures are the engine's own counters (prompt tokens prefilled vs restored) and each turn's wall
time. Table on stdout, JSON to bench/results/prefix_reuse.json.

    python -m ballast.bench.prefix_reuse [--models builtin:tiny-qwen3-next ...] [--turns 4]
        [--answer-tokens 48] [--interval 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler

RESULTS = Path(__file__).parent / "results" / "prefix_reuse.json"
MODELS = ("builtin:tiny-qwen3-next", "builtin:tiny-qwen3.5-moe", "builtin:tiny-llama")
SYSTEM = (
    "You are a careful assistant for a team that runs inference servers. Answer briefly, cite the "
    "configuration setting that matters, and say when a figure was measured rather than estimated. "
) * 4
USER = (
    "Our server restarts under load. The logs show the kernel killing it when many long prompts arrive "
    "together. What should we look at first, and which settings bound the memory a request may take?",
    "We set the context window lower and it helped, but now long documents are refused. Is there a way "
    "to keep them while staying safe?",
    "How does the prefix cache interact with that, and what happens to it when memory gets tight?",
    "Summarise the three changes we should make, in order, with the setting name for each.",
    "One more: what should our dashboard alert on?",
)


async def run_chat(engine: Engine, turns: int, answer_tokens: int) -> list[dict[str, Any]]:
    s = Scheduler(engine, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=engine.prefill_chunk_tokens))
    await s.start()
    tok = engine.tokenizer
    prompt = tuple(tok.encode(SYSTEM))
    rows: list[dict[str, Any]] = []
    answer: tuple[int, ...] = ()
    try:
        for i in range(turns):
            prompt = prompt + answer + tuple(tok.encode(USER[i % len(USER)]))
            prefilled, reused = engine.prefilled_tokens, engine.reused_tokens
            t0 = time.perf_counter()
            req = GenerationRequest(
                f"turn{i}", prompt, SamplingParams(temperature=0.0), max_tokens=answer_tokens
            )
            _, ids, _ = await s.submit(req).collect()
            rows.append(
                {
                    "turn": i + 1,
                    "prompt_tokens": len(prompt),
                    "prefilled": engine.prefilled_tokens - prefilled,
                    "reused": engine.reused_tokens - reused,
                    "seconds": time.perf_counter() - t0,
                    "tokens": list(ids),
                }
            )
            answer = tuple(ids)
    finally:
        await s.stop()
    return rows


def bench_model(model: str, turns: int, answer_tokens: int, interval: int) -> dict[str, Any]:
    cfg = EngineConfig(
        model=model, device="cpu", max_num_seqs=1, max_model_len=4096, prefill_chunk_tokens=512
    )
    arms: dict[str, list[dict[str, Any]]] = {}
    report: dict[str, Any] = {"model": model}
    for arm, fraction in (("cold", 0.0), ("warm", 0.05)):
        engine = Engine.load(
            cfg, prefix_cache=PrefixCacheConfig(fraction=fraction, checkpoint_interval=interval)
        )
        try:
            arms[arm] = asyncio.run(run_chat(engine, turns, answer_tokens))
            if engine.prefix_cache is not None:
                report["checkpoint_interval"] = engine.checkpoint_interval
                report["cache_bytes_held"] = engine.prefix_cache.bytes_held
        finally:
            engine.shutdown()
    same = [c["tokens"] == w["tokens"] for c, w in zip(arms["cold"], arms["warm"], strict=True)]
    if not all(same):
        raise SystemExit(
            f"{model}: reuse changed the output of turns {[i + 1 for i, ok in enumerate(same) if not ok]}"
        )
    for rows in arms.values():
        for r in rows:
            del r["tokens"]
    cold = sum(r["prefilled"] for r in arms["cold"])
    warm = sum(r["prefilled"] for r in arms["warm"])
    report.update(
        arms=arms,
        identical_output=True,
        prefilled_cold=cold,
        prefilled_warm=warm,
        saved_tokens=cold - warm,
        saved_fraction=(cold - warm) / cold if cold else 0.0,
    )
    return report


def print_table(r: dict[str, Any]) -> None:
    print(
        f"\n{r['model']}  (checkpoint interval {r.get('checkpoint_interval')}, cache held "
        f"{r.get('cache_bytes_held', 0) / 1024:.0f} KiB)"
    )
    print(
        f"{'turn':>4} {'prompt':>7} {'cold prefill':>13} {'warm prefill':>13} {'reused':>7} {'cold s':>7} "
        f"{'warm s':>7}"
    )
    for c, w in zip(r["arms"]["cold"], r["arms"]["warm"], strict=True):
        print(
            f"{c['turn']:>4} {c['prompt_tokens']:>7} {c['prefilled']:>13} {w['prefilled']:>13} "
            f"{w['reused']:>7} {c['seconds']:>7.3f} {w['seconds']:>7.3f}"
        )
    print(
        f"total prefilled: cold {r['prefilled_cold']}, warm {r['prefilled_warm']}: "
        f"{r['saved_tokens']} tokens saved ({100 * r['saved_fraction']:.1f}%), output identical"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument(
        "--interval",
        type=int,
        default=0,
        help="checkpoint interval; 0 = the engine's choice from the model's costs",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = [bench_model(m, args.turns, args.answer_tokens, args.interval) for m in args.models]
    for r in results:
        print_table(r)
    report = {
        "host": platform.node(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "turns": args.turns,
        "answer_tokens": args.answer_tokens,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
