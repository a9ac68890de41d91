"""Multi-turn chat with the prefix cache on and off: TTFT per turn, wall time, reused tokens.

    python -m ballast.bench.gpu_prefix [--model DIR | --shape qwen3-next-6b] [--quick]
    python -m ballast.bench.gpu_prefix --shape tiny-qwen3-next --device cpu --conversations 4 \\
        --user-tokens 40 --reply-tokens 8                      # a check of the plumbing on the CPU

N conversations (default 32) run at once, each for T turns (default 4): a turn sends the whole
conversation so far through the model's chat template (the previous answers as text, as a chat
client resends them), with a new user message of ~--user-tokens tokens, and streams a reply of
--reply-tokens tokens (greedy). The conversations share only the template's system prompt. Both
arms load the same random-weight directory (written by bench/checkpoint_dir when --model is not
given) with the server's defaults through the real scheduler and engine in this process: "off"
with --prefix-cache-fraction 0, "on" with the default cache and the default checkpoint pool.
TTFT is from submit to the first streamed token. Each arm runs --passes times (the cache emptied
between passes, its pool kept, as on a server that has been up); the table shows the last pass.
Table on stdout, JSON to bench/results/gpu_prefix.json.

The aim (issue 10): with the cache on no turn's TTFT p50 is above the cache-off one, and the run
takes at most 2/3 of the cache-off wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
from ballast.bench.checkpoint_dir import write_dir
from ballast.bench.http_load import pct
from ballast.bench.paged_decode import free_device_memory
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import SamplingParams
from ballast.memory.config import MemoryConfig
from ballast.memory.pool import CheckpointPool
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest, TokenEvent
from ballast.scheduler.scheduler import Scheduler

RESULTS = Path(__file__).parent / "results" / "gpu_prefix.json"
WORDS = [
    "memory",
    "server",
    "request",
    "token",
    "cache",
    "layer",
    "state",
    "block",
    "model",
    "prompt",
    "answer",
    "queue",
    "level",
    "limit",
    "stream",
    "batch",
    "device",
    "kernel",
    "graph",
    "chunk",
    "window",
    "budget",
    "pool",
    "buffer",
    "pressure",
    "ladder",
    "slot",
    "reply",
    "engine",
    "latency",
    "throughput",
    "figure",
    "measure",
    "table",
    "context",
    "weight",
    "expert",
    "router",
    "attention",
]


def user_message(conversation: int, turn: int, tokens: int) -> str:
    rng = random.Random(conversation * 1000 + turn)
    words = " ".join(rng.choice(WORDS) for _ in range(max(1, int(tokens * 0.9))))
    return f"Conversation {conversation}, question {turn + 1}: {words}?"


async def conversation(
    s: Scheduler, engine: Engine, c: int, args: argparse.Namespace, rows: list[dict[str, Any]]
) -> None:
    tok = engine.tokenizer
    messages: list[dict[str, str]] = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": user_message(c, turn, args.user_tokens)})
        prompt = tuple(tok.apply_chat_template(messages))
        req = GenerationRequest(
            f"c{c}t{turn}",
            prompt,
            SamplingParams(temperature=0.0),
            max_tokens=args.reply_tokens,
            resent_as_text=True,  # the next turn renders this answer's text, as a chat client sends it
        )
        t0 = time.perf_counter()
        ttft, ids = 0.0, []
        async for event in s.submit(req):
            if isinstance(event, TokenEvent) and event.token_ids:
                ttft = ttft or time.perf_counter() - t0
                ids += event.token_ids
        rows.append(
            {"conversation": c, "turn": turn + 1, "prompt_tokens": len(prompt), "ttft_s": ttft, "tokens": ids}
        )
        messages.append({"role": "assistant", "content": tok.decode(ids)})


async def one_pass(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    s = Scheduler(engine, SchedulerConfig(max_num_seqs=args.conversations))
    await s.start()
    rows: list[dict[str, Any]] = []
    prefilled, reused = engine.prefilled_tokens, engine.reused_tokens
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(s, engine, c, args, rows) for c in range(args.conversations)))
        wall = time.perf_counter() - t0
    finally:
        await s.stop()
    turns = []
    for t in range(1, args.turns + 1):
        ttfts = [r["ttft_s"] for r in rows if r["turn"] == t]
        turns.append({"turn": t, "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90)})
    return {
        "wall_s": wall,
        "turns": turns,
        "prefilled_tokens": engine.prefilled_tokens - prefilled,
        "reused_tokens": engine.reused_tokens - reused,
        "rows": sorted(rows, key=lambda r: (r["conversation"], r["turn"])),
    }


def run_arm(model: str, on: bool, args: argparse.Namespace) -> dict[str, Any]:
    mem = MemoryConfig()
    pool = CheckpointPool(
        lambda: mem_total(), mem.pool_fraction, mem.pool_max_buffers, mem.pool_min_buffer_bytes
    )
    cfg = EngineConfig(
        model=model, device=args.device, max_num_seqs=args.conversations, max_model_len=args.max_model_len
    )
    t0 = time.perf_counter()
    engine = Engine.load(
        cfg,
        prefix_cache=PrefixCacheConfig(max_bytes=args.prefix_cache_bytes)
        if on
        else PrefixCacheConfig(fraction=0.0),
        pool=pool,
    )
    load_s = time.perf_counter() - t0
    passes = []
    try:
        asyncio.run(warm_up(engine))
        for _ in range(args.passes):
            if engine.prefix_cache is not None:
                engine.prefix_cache.shed()
            passes.append(asyncio.run(one_pass(engine, args)))
        stats = pool.stats()
        arm = {
            "cache": "on" if on else "off",
            "load_s": load_s,
            "checkpoint_interval": engine.checkpoint_interval,
            "pool": {"hits": stats.hits, "misses": stats.misses, "high_water_bytes": stats.high_water_bytes},
            # saves, restores, evictions, declined saves: why reuse is what it is
            "cache_stats": dataclasses.asdict(engine.prefix_cache.stats()) if engine.prefix_cache else None,
            "passes": passes,
        }
    finally:
        engine.shutdown()
        del engine
        free_device_memory()
    return arm


async def warm_up(engine: Engine) -> None:
    """One short request: compiled kernels and graphs are ready before anything is timed."""
    s = Scheduler(engine, SchedulerConfig(max_num_seqs=1))
    await s.start()
    try:
        await s.submit(
            GenerationRequest("warm-up", (1, 2, 3, 4), SamplingParams(temperature=0.0), 4)
        ).collect()
    finally:
        await s.stop()


def mem_total() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def print_table(report: dict[str, Any]) -> None:
    off, on = (report["arms"][k]["passes"][-1] for k in ("off", "on"))
    print(
        f"\n{report['conversations']} conversations x {report['turns']} turns, ~{report['user_tokens']} "
        f"new prompt tokens per turn, {report['reply_tokens']}-token replies ({report['model']})"
    )
    print("| turn | TTFT p50 off / on (ms) | TTFT p90 off / on (ms) |")
    print("| --- | --- | --- |")
    for a, b in zip(off["turns"], on["turns"], strict=True):
        print(
            f"| {a['turn']} | {1e3 * a['ttft_p50_s']:.0f} / {1e3 * b['ttft_p50_s']:.0f} | "
            f"{1e3 * a['ttft_p90_s']:.0f} / {1e3 * b['ttft_p90_s']:.0f} |"
        )
    print(
        f"| wall | {off['wall_s']:.2f} s / {on['wall_s']:.2f} s ({on['wall_s'] / off['wall_s']:.2f}x) | "
        f"reused {on['reused_tokens']} of {on['reused_tokens'] + on['prefilled_tokens']} prompt tokens |"
    )
    pool = report["arms"]["on"]["pool"]
    print(f"checkpoint pool (cache on): {pool['hits']} hits, {pool['misses']} misses")
    cache = report["arms"]["on"].get("cache_stats")
    if cache:
        print(
            f"prefix cache: {cache['saves']} saves ({cache['declined']} declined, {cache['duplicates']} "
            f"duplicates), {cache['restores']} restores, {cache['evictions']} evictions, "
            f"{cache['bytes_held'] / 2**30:.2f} GiB held in {cache['entries']} entries"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face directory (default: write --shape's)")
    parser.add_argument("--shape", default="qwen3-next-6b", help="bench/checkpoint_dir shape to write")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/ballast-bench-models"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-tokens", type=int, default=220)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=0,
        help="cap the cache's bytes (0: the server's default budget)",
    )
    parser.add_argument("--passes", type=int, default=2, help="passes per arm (--quick: 1)")
    parser.add_argument("--quick", action="store_true", help="one pass per arm")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.passes = 1
    model = args.model or str(ensure_dir(args.shape, args.work_dir, args.device))
    arms = {"off": run_arm(model, False, args), "on": run_arm(model, True, args)}
    off_rows = [r["tokens"] for r in arms["off"]["passes"][-1]["rows"]]
    on_rows = [r["tokens"] for r in arms["on"]["passes"][-1]["rows"]]
    report = {
        "bench": "gpu_prefix",
        "model": args.model or args.shape,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "conversations": args.conversations,
        "turns": args.turns,
        "user_tokens": args.user_tokens,
        "reply_tokens": args.reply_tokens,
        # Greedy both ways; in bfloat16 two logits that round alike may pick differently, so this
        # is a figure, not a check (the float32 CPU tests check identity).
        "same_tokens_fraction": sum(a == b for a, b in zip(off_rows, on_rows, strict=True)) / len(off_rows),
        "arms": arms,
    }
    for arm in arms.values():
        for p in arm["passes"]:
            for r in p["rows"]:
                del r["tokens"]
    print_table(report)
    print(f"same tokens with the cache on and off: {100 * report['same_tokens_fraction']:.0f}% of turns")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def ensure_dir(shape: str, work: Path, device: str) -> Path:
    """The shape's random-weight directory under work, written once."""
    out = work / shape
    if not (out / "tokenizer.json").exists():  # written last
        info = write_dir(shape, out, torch.device(device))
        print(
            f"wrote {shape} ({info['parameters'] / 1e9:.2f}B parameters) in {info['seconds']:.0f}s",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
