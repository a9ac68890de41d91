"""The cost of a /metrics scrape, as a gateway's endpoint picker pays it (every 50 ms), at idle and
under streaming load, and its effect on decode.

    python -m ballast.bench.metrics_scrape [--model default] [--streams 32] [--new-tokens 64]
        [--paths /metrics /metrics/gateway /health]

One `ballast serve` on a free localhost port. Per path, scrapes of an idle server; then the streams
alone (the reference: nothing scrapes); then, per path, the same streams with a scraper every 50 ms
beside them. Prints scrape latency p50/p99 and the streams' tokens/s and inter-token p50/p99 with and
without the scraper, and writes bench/results/metrics_scrape.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

import httpx
from ballast.bench.fleet import Fleet
from openai import AsyncOpenAI

RESULTS = Path(__file__).resolve().parent / "results"
SCRAPE_EVERY_S = 0.05  # the inference extension's endpoint picker's default


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def scrape(url: str, stop: asyncio.Event, times: list[float]) -> None:
    async with httpx.AsyncClient() as client:
        while not stop.is_set():
            t = time.perf_counter()
            r = await client.get(url)
            times.append(time.perf_counter() - t)
            # /health may be given as the floor: what any request through the HTTP stack costs.
            assert r.status_code == 200 and ("vllm:kv_cache_usage_perc" in r.text or "/metrics" not in url)
            await asyncio.sleep(SCRAPE_EVERY_S)


async def one_stream(client: AsyncOpenAI, k: int, new_tokens: int, gaps: list[float]) -> int:
    stream = await client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": f"Story {k}: tell a long tale about a harbour."}],
        max_tokens=new_tokens,
        stream=True,
    )
    last: float | None = None
    n = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            n += 1
    return n


async def streams(url: str, n: int, new_tokens: int, scraper: str | None) -> dict[str, float]:
    """scraper: the path a scraper reads every 50 ms beside the streams (None: nothing scrapes)."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    stop = asyncio.Event()
    times: list[float] = []
    task = asyncio.create_task(scrape(url + scraper, stop, times)) if scraper else None
    gaps: list[float] = []
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one_stream(client, k, new_tokens, gaps) for k in range(n)))
    wall = time.perf_counter() - t0
    stop.set()
    if task is not None:
        await task
    await client.close()  # before asyncio.run closes the loop its connections live on
    out = {
        "tokens_per_s": sum(counts) / wall,
        "itl_p50_ms": pct(gaps, 0.5) * 1e3,
        "itl_p99_ms": pct(gaps, 0.99) * 1e3,
    }
    if scraper:
        out |= {
            "scrapes": len(times),
            "scrape_p50_ms": pct(times, 0.5) * 1e3,
            "scrape_p99_ms": pct(times, 0.99) * 1e3,
        }
    return out


async def idle(url: str, n: int) -> dict[str, float]:
    times: list[float] = []
    async with httpx.AsyncClient() as client:
        for _ in range(n):
            t = time.perf_counter()
            await client.get(url)
            times.append(time.perf_counter() - t)
            await asyncio.sleep(SCRAPE_EVERY_S)
    return {"scrapes": n, "scrape_p50_ms": pct(times, 0.5) * 1e3, "scrape_p99_ms": pct(times, 0.99) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--idle-scrapes", type=int, default=200)
    ap.add_argument("--paths", nargs="+", default=["/metrics", "/metrics/gateway", "/health"])
    args = ap.parse_args()
    serve = ["--model", args.model, "--served-model-name", "default", "--max-num-seqs", str(args.streams)]
    with Fleet.start(1, serve) as fleet:
        url = fleet.urls[0]
        asyncio.run(streams(url, 4, 8, scraper=None))  # warm-up: first steps at these shapes
        result: dict[str, object] = {
            "model": args.model,
            "streams": args.streams,
            "new_tokens": args.new_tokens,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "load_average_start": os.getloadavg(),
            "idle": {p: asyncio.run(idle(url + p, args.idle_scrapes)) for p in args.paths},
            "streams_alone": asyncio.run(streams(url, args.streams, args.new_tokens, scraper=None)),
            "streams_scraped": {
                p: asyncio.run(streams(url, args.streams, args.new_tokens, scraper=p)) for p in args.paths
            },
            "load_average_end": os.getloadavg(),
        }
    idle_runs, alone, scraped = result["idle"], result["streams_alone"], result["streams_scraped"]
    assert isinstance(idle_runs, dict) and isinstance(alone, dict) and isinstance(scraped, dict)
    print(
        f"model {args.model}, {args.streams} streams x {args.new_tokens} tokens, "
        f"scrape every {SCRAPE_EVERY_S * 1e3:.0f} ms"
    )
    print(f"{'run':<40}{'scrape p50':>12}{'scrape p99':>12}{'tok/s':>9}{'ITL p50':>10}{'ITL p99':>10}")
    for p, i in idle_runs.items():
        print(f"{'idle, ' + p:<40}{i['scrape_p50_ms']:>10.2f}ms{i['scrape_p99_ms']:>10.2f}ms")
    rows = [("streams, no scraper", alone)]
    rows += [(f"streams + 50 ms scraper of {p}", r) for p, r in scraped.items()]
    for name, r in rows:
        p50 = f"{r['scrape_p50_ms']:>10.2f}ms" if "scrape_p50_ms" in r else f"{'':>12}"
        p99 = f"{r['scrape_p99_ms']:>10.2f}ms" if "scrape_p99_ms" in r else f"{'':>12}"
        print(
            f"{name:<40}{p50}{p99}{r['tokens_per_s']:>9.1f}{r['itl_p50_ms']:>8.1f}ms{r['itl_p99_ms']:>8.1f}ms"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "metrics_scrape.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
