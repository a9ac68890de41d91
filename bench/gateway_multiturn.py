"""Replicas behind SGLang's gateway (`smg`): cache-aware routing against round-robin on the same
replicas, for a multi-turn chat load, and the time from one replica turning CRITICAL to the gateway
routing around it.

    python -m ballast.bench.gateway_multiturn [--replicas 3] [--chats 12] [--turns 4] [--new-tokens 16]

Starts the replicas once (the default model, CPU, each reading its own temp /proc tree for its
memory level); then, per policy, a fresh `smg` in front of them and the same chats (each chat's
turns in order, chats concurrently; a fresh opening per policy so no policy inherits the other's
cache). Reports the share of prompt tokens the replicas restored from their prefix caches
(usage.prompt_tokens_details.cached_tokens) and time to first token p50/p99 (streamed). Then writes
CRITICAL into replica 0's tree and times until smg no longer lists it as routable, and until a burst
of requests no longer reaches it. Prints a table and writes bench/results/gateway_multiturn.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from ballast.bench.fleet import Fleet, wait_until
from ballast.bench.http_load import write_meminfo
from openai import AsyncOpenAI

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 1 << 30
TOTAL = 16 * GiB
OK_AVAILABLE = 12 * GiB  # the default reserve is 15 % of 16 GiB: 12 GiB free is OK
CRITICAL_AVAILABLE = 1 * GiB  # inside the reserve
TOPICS = [
    "tides",
    "bees",
    "locomotives",
    "sourdough",
    "stars",
    "cats",
    "glass",
    "auroras",
    "volcanoes",
    "violins",
    "coral",
    "comets",
    "maps",
    "bridges",
    "owls",
    "salt",
]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def chat(
    client: AsyncOpenAI, opening: str, turns: int, new_tokens: int
) -> list[tuple[int, int, float]]:
    """One chat; per turn (prompt tokens, cached tokens, TTFT seconds)."""
    messages: list[dict[str, str]] = [{"role": "user", "content": opening}]
    out: list[tuple[int, int, float]] = []
    for t in range(turns):
        t0 = time.perf_counter()
        ttft: float | None = None
        text = ""
        usage = None
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model="default",
            messages=messages,
            max_tokens=new_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and ttft is not None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out.append((usage.prompt_tokens, cached or 0, ttft))
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Go on about part {t + 1}."},
        ]
    return out


async def load(url: str, tag: str, chats: int, turns: int, new_tokens: int) -> dict[str, object]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    # Each opening starts with its own topic: smg's cache-aware tree matches text from the first
    # character, and with a shared lead ("[tag k] Tell me about ...") 1 of 8 second turns reached the
    # replica holding their prefix (7 of 8 with these). The tag (fresh per policy) goes last.
    openings = [
        f"{TOPICS[k % len(TOPICS)].capitalize()}: tell me about them. ({tag} {k})" for k in range(chats)
    ]
    results = await asyncio.gather(*(chat(client, o, turns, new_tokens) for o in openings))
    later = [row for r in results for row in r[1:]]  # turns that had a prefix to reuse
    ttfts = [row[2] for r in results for row in r]
    return {
        "hits_by_turn": [sum(r[t][1] > 0 for r in results) for t in range(turns)],
        "prompt_tokens": sum(row[0] for r in results for row in r),
        "cached_tokens": sum(row[1] for r in results for row in r),
        "later_turns_hit": sum(row[1] > 0 for row in later) / len(later),
        "reused_share_later_turns": sum(row[1] for row in later) / sum(row[0] for row in later),
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3,
    }


async def reach(client: AsyncOpenAI, n: int, tag: str) -> None:
    async def one(k: int) -> None:
        await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"{tag} {k}: a colour?"}], max_tokens=2
        )

    await asyncio.gather(*(one(k) for k in range(n)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        help="smg's --cache-threshold for cache_aware (its default 0.3: a turn whose text matches less "
        "of a replica's tree than that is routed by load instead)",
    )
    args = ap.parse_args()
    aware = ["--cache-threshold", str(args.cache_threshold)] if args.cache_threshold is not None else []
    with tempfile.TemporaryDirectory() as tmp:
        roots = [Path(tmp) / f"r{i}" for i in range(args.replicas)]
        for root in roots:
            write_meminfo(root, TOTAL, OK_AVAILABLE)
        serve = [
            "--model",
            "default",
            "--served-model-name",
            "default",
            "--max-num-seqs",
            "8",
            "--memwatch-poll-s",
            "0.05",
        ]
        per = [["--memory-root", str(r)] for r in roots]
        result: dict[str, object] = {
            "model": "default (SmolLM2-135M-Instruct Q4_1, CPU)",
            "replicas": args.replicas,
            "chats": args.chats,
            "turns": args.turns,
            "new_tokens": args.new_tokens,
            "cache_threshold": args.cache_threshold,
            "cpus": os.cpu_count(),
            "load_average_start": os.getloadavg(),
        }
        with Fleet.start(args.replicas, serve, per) as fleet:
            for policy in ("cache_aware", "round_robin"):
                with fleet.gateway(policy, aware if policy == "cache_aware" else ()) as url:
                    result[policy] = asyncio.run(load(url, policy, args.chats, args.turns, args.new_tokens))
            with fleet.gateway("cache_aware") as url:
                client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
                target = fleet.replicas[0]
                t0 = time.monotonic()
                write_meminfo(roots[0], TOTAL, CRITICAL_AVAILABLE)
                wait_until(
                    lambda: target.url not in Fleet.routable(url), 60, "smg drops the CRITICAL replica"
                )
                dropped = time.monotonic() - t0
                seen = target.metric("ballast_requests_total")
                asyncio.run(reach(client, 6, "drained"))
                result["critical_to_unroutable_s"] = dropped
                result["requests_reaching_critical_replica_after"] = (
                    target.metric("ballast_requests_total") - seen
                )
        result["load_average_end"] = os.getloadavg()
    print(
        f"{args.replicas} replicas (default model, CPU) behind smg; {args.chats} chats x {args.turns} turns, "
        f"{args.new_tokens} new tokens a turn"
    )
    print(
        f"{'policy':<14}{'later turns hit':>16}{'reused (later)':>16}{'TTFT p50':>11}{'TTFT p99':>11}"
        f"  hits by turn (of {args.chats})"
    )
    for policy in ("cache_aware", "round_robin"):
        r = result[policy]
        assert isinstance(r, dict)
        print(
            f"{policy:<14}{r['later_turns_hit']:>15.0%}{r['reused_share_later_turns']:>15.0%}"
            f"{r['ttft_p50_ms']:>9.0f}ms{r['ttft_p99_ms']:>9.0f}ms  {r['hits_by_turn']}"
        )
    print(
        f"CRITICAL -> smg stops routing there: {result['critical_to_unroutable_s']:.2f} s "
        f"(requests reaching it afterwards: {result['requests_reaching_critical_replica_after']:.0f})"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_multiturn.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
