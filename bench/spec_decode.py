"""Speculative decoding over HTTP on the default model (CPU), side by side in one run: `ballast
serve` without drafting and with `--speculative-config` ngram, each started once, every round
measuring both in turn (interleaved, so load from other processes hits both alike); medians.

    python -m ballast.bench.spec_decode [--rounds 3] [--k 4 7] [--copy-tokens 400] [--story-tokens 200]

(one ngram server per --k value, num_speculative_tokens = k, prompt_lookup_max 4)

Workloads, through the official `openai` client, streaming chat, greedy:
- copy: a ~300-token paragraph, "repeat it exactly" (prompt lookup drafts the paragraph back);
  the two sides' texts are compared;
- story: a free story (little to look up: the governor should keep it from costing);
- 8 streams: eight stories at once (the load rule: no drafts from 8 streams on).
tok/s: completion tokens after the first over the time after the first token (one stream), or
all completion tokens over the wall time (8 streams). Acceptance by draft position for each
workload comes from the ngram server's /metrics counters, read before and after it.
Table on stdout, JSON to bench/results/spec_decode.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from ballast.bench.http_load import free_port, one_stream, serve_command, server, story
from openai import AsyncOpenAI

RESULTS = Path(__file__).resolve().parent / "results" / "spec_decode.json"
PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass "
    "lamp and a notebook filled with observations about the weather, the passing ships, and the birds "
    "that nested in the rocks below. He had kept this routine for thirty-one years, and in that time he "
    "had seen storms that bent the iron railings, summers so calm that the sea looked like polished "
    "glass, and winters when ice formed on the inside of the windows. The village below depended on his "
    "light, though few of its people ever thought about him. Children sometimes waved from the harbor "
    "wall, and once a year the mayor sent a basket of bread, cheese, and apples with a short note of "
    "thanks. The keeper wrote down every ship he saw, its name if he could read it, its direction, and "
    "the time it passed the point. On quiet nights he read old letters from his sister, who lived in a "
    "city far to the south and wrote about trams, markets, and the theatre. He answered each one in "
    "careful handwriting, describing the colour of the water, the shape of the clouds, and the small "
    "repairs he had made to the lamp, the stairs, and the stubborn door that never quite closed."
)
COPY = "Repeat the following text exactly, word for word, and nothing else:\n\n" + PARAGRAPH
STORY = "Write a long story about a lighthouse keeper."
TOPICS = ["a lighthouse", "the ocean", "a robot", "autumn", "a train", "the moon", "a key", "a map"]
_POSITION = re.compile(r'^ballast_spec_position_(drafted|accepted)_total\{position="(\d+)"\} (\S+)$', re.M)


async def one(base: str, model: str, text: str, new_tokens: int) -> tuple[float, str, int]:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=900, max_retries=0)
    out = await one_stream(client, model, text, new_tokens)
    await client.close()
    if out.error or out.tokens < 2:
        raise RuntimeError(f"{base}: {out.tokens} tokens {out.error}")
    return (out.tokens - 1) / (out.wall_s - out.ttft_s), out.text, out.tokens


async def eight(base: str, model: str, new_tokens: int) -> float:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=900, max_retries=0)
    start = time.perf_counter()
    outs = await asyncio.gather(*(one_stream(client, model, story(t), new_tokens) for t in TOPICS))
    wall = time.perf_counter() - start
    await client.close()
    if failed := [o.error for o in outs if o.error]:
        raise RuntimeError(f"{base}: {failed[0]}")
    return sum(o.tokens for o in outs) / wall


def positions(base: str) -> dict[str, list[float]]:
    """The ngram server's drafted and accepted counters by draft position."""
    found: dict[str, list[float]] = {"drafted": [], "accepted": []}
    for kind, pos, value in _POSITION.findall(httpx.get(base + "/metrics", timeout=10).text):
        column = found[kind]
        while len(column) <= int(pos):
            column.append(0.0)
        column[int(pos)] = float(value)
    return found


def acceptance(before: dict[str, list[float]], after: dict[str, list[float]]) -> list[float]:
    def at(d: dict[str, list[float]], kind: str, j: int) -> float:
        return d[kind][j] if j < len(d[kind]) else 0.0

    out = []  # -1: nothing drafted at that position during the workload
    for j in range(len(after["drafted"])):
        drafted = at(after, "drafted", j) - at(before, "drafted", j)
        out.append(
            round((at(after, "accepted", j) - at(before, "accepted", j)) / drafted, 3) if drafted else -1.0
        )
    return out


def step_costs(rows: tuple[int, ...] = (1, 2, 3, 5, 8), reps: int = 12) -> dict[int, float]:
    """In this process: the default model's step of one sequence feeding `rows` tokens with logits
    at each (a verify row of rows - 1 drafts), median ms, the rows interleaved rep by rep."""
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine

    engine = Engine.load(EngineConfig(max_num_seqs=1, max_model_len=1024))
    runner = engine.runner
    assert runner.kv is not None and runner.kv.ensure(0, 600)
    prompt = list(range(100, 400))
    runner.forward([(0, prompt, 0)])
    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(reps):
        for n in rows:
            start = time.perf_counter()
            runner.forward([(0, prompt[:n], 300)], [n > 1])
            times[n].append(1000 * (time.perf_counter() - start))
    engine.shutdown()
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens, a server each")
    p.add_argument("--copy-tokens", type=int, default=400)
    p.add_argument("--story-tokens", type=int, default=200)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    costs = step_costs()
    print("one sequence's step, ms (median), by tokens fed with logits at each:", costs, flush=True)
    specs = {
        f"ngram k={k}": json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4})
        for k in args.k
    }
    rows: dict[str, dict[str, list[float]]] = {}
    accept: dict[str, list[list[float]]] = {}
    same_text: list[bool] = []
    loads: list[float] = []
    copied: dict[str, int] = {}
    with ExitStack() as stack:
        sides: dict[str, str] = {}
        for name, extra in [("off", []), *((n, ["--speculative-config", s]) for n, s in specs.items())]:
            port = free_port()
            common = ["--max-num-seqs", "8", "--max-model-len", "4096", "--max-queue-wait-s", "600"]
            sides[name] = stack.enter_context(
                server(serve_command("default", port, *common, *extra), {}, "/ready", port)
            )
        model = httpx.get(sides["off"] + "/v1/models", timeout=10).json()["data"][0]["id"]
        workloads = {
            "copy ~300-token paragraph": lambda base: asyncio.run(one(base, model, COPY, args.copy_tokens)),
            "free story": lambda base: asyncio.run(one(base, model, STORY, args.story_tokens)),
            "8 streams": lambda base: (asyncio.run(eight(base, model, args.story_tokens)), "", 0),
        }
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for workload, run in workloads.items():
                texts = {}
                for name, base in sides.items():
                    before = positions(base) if name != "off" else None
                    rate, text, tokens = run(base)
                    rows.setdefault(workload, {}).setdefault(name, []).append(rate)
                    texts[name] = text
                    if before is not None:
                        accept.setdefault(f"{workload}, {name}", []).append(
                            acceptance(before, positions(base))
                        )
                    if workload.startswith("copy"):
                        copied[name] = tokens
                if workload.startswith("copy"):
                    same_text.append(all(t == texts["off"] for t in texts.values()))
            print(f"round {r + 1}/{args.rounds}, load average {os.getloadavg()[0]:.1f}", flush=True)
    report: dict[str, Any] = {
        "model": model,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rounds": args.rounds,
        "speculative_configs": specs,
        "load_average": [min(loads), max(loads)],
        "copy_completion_tokens": copied,
        "copy_same_text": same_text,
        "tok_s": rows,
        "acceptance_by_position": accept,
        "verify_step_ms_by_rows": costs,
        "command": "python -m ballast.bench.spec_decode " + " ".join(argv or []),
    }
    print(
        f"\n{model} on CPU ({report['machine']}), median of {args.rounds} interleaved rounds, load average "
        f"{min(loads):.1f}-{max(loads):.1f}; ngram prompt_lookup_max 4"
    )
    print(f"{'workload':28s}{'side':>12s}{'tok/s':>9s}{'vs off':>8s}   acceptance by position (last round)")
    for workload, got in rows.items():
        off = statistics.median(got["off"])
        for name, rates in got.items():
            rate = statistics.median(rates)
            last = accept.get(f"{workload}, {name}", [[]])[-1]
            print(f"{workload:28s}{name:>12s}{rate:9.1f}{rate / off:7.2f}x   {last if name != 'off' else ''}")
    print("verify step cost: " + ", ".join(f"{n} rows {ms / costs[1]:.2f}x" for n, ms in costs.items()))
    print(f"copy: same text in every round: {all(same_text)}; completion tokens {copied}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
