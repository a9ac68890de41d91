"""Scenario 1, overload: 25x the slots in concurrent streams plus a burst of non-streaming
requests, against `ballast serve` on CPU. Every request must complete or be refused fast with
429/503 + Retry-After (any other outcome is a failure), and afterwards slots, queue and KV blocks
are back to idle.

    python tests/reliability/overload.py                      # 8 slots, 200 streams + 1,000 burst
    python tests/reliability/overload.py --out overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai
from harness import ballast_serve, pct, report, total, wait_idle

PROMPT = "Write one sentence about the sea, number {i}."
WAITED = re.compile(r"(?:waited|estimated wait) ([0-9.e+-]+) s")


@dataclass
class Outcomes:
    kinds: Counter[str] = field(default_factory=Counter)
    refusal_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    retry_after: list[int] = field(default_factory=list)
    server_wait_s: list[float] = field(
        default_factory=list
    )  # the wait a refusal states: waited, or estimated
    other: list[str] = field(default_factory=list)

    def refused(self, exc: openai.APIStatusError, elapsed: float) -> None:
        status = exc.status_code
        self.kinds[str(status) if status in (429, 503) else "other"] += 1
        if status in (429, 503):
            self.refusal_s.append(elapsed)
            self.retry_after.append(int(exc.response.headers.get("retry-after", "0")))
            waited = WAITED.search(exc.message)
            self.server_wait_s.append(
                float(waited.group(1)) if waited else 0.0
            )  # a full queue refuses at once
        else:
            self.other.append(f"{status}: {exc.message}")


async def one(client: openai.AsyncOpenAI, i: int, stream: bool, max_tokens: int, out: Outcomes) -> None:
    t0 = time.monotonic()
    messages = [{"role": "user", "content": PROMPT.format(i=i)}]
    try:
        if stream:
            chunks = await client.chat.completions.create(
                model="x",
                messages=messages,
                max_tokens=max_tokens,  # type: ignore[arg-type]
                stream=True,
                temperature=0,
            )
            first = None
            async for chunk in chunks:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic() - t0
            if first is not None:
                out.ttft_s.append(first)
        else:
            await client.chat.completions.create(
                model="x", messages=messages, max_tokens=max_tokens, temperature=0
            )  # type: ignore[arg-type]
        out.kinds["completed"] += 1
    except openai.APIStatusError as exc:
        out.refused(exc, time.monotonic() - t0)
    except Exception as exc:  # a broken connection, a timeout: never acceptable
        out.kinds["other"] += 1
        out.other.append(f"{type(exc).__name__}: {exc}")


async def load(
    url: str, streams: int, burst: int, max_tokens: int, timeout_s: float, burst_delay_s: float
) -> Outcomes:
    """The streams at once, then (after burst_delay_s) the whole burst at once; each request
    once, no retries."""
    out = Outcomes()
    # No keep-alive: a pooled connection the server closes as the client reuses it would count as a
    # failure of the server when it is a race in the load generator.
    limits = httpx.Limits(max_connections=streams + burst + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=http)

        async def later() -> None:
            await asyncio.sleep(burst_delay_s)
            await asyncio.gather(*(one(client, streams + i, False, max_tokens, out) for i in range(burst)))

        await asyncio.gather(later(), *(one(client, i, True, max_tokens, out) for i in range(streams)))
    return out


def run(
    slots: int = 8,
    streams: int = 200,
    burst: int = 1000,
    max_tokens: int = 32,
    extra: tuple[str, ...] = (),
    timeout_s: float = 300.0,
    burst_delay_s: float = 1.0,
) -> dict[str, object]:
    args = ["--max-num-seqs", str(slots), "--max-model-len", "256", "--served-model-name", "x", *extra]
    with ballast_serve(args) as server:
        warm = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for _ in range(3):
            warm.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "hello"}], max_tokens=8
            )
        rss_before = server.rss_bytes
        t0 = time.monotonic()
        out = asyncio.run(load(server.url, streams, burst, max_tokens, timeout_s, burst_delay_s))
        wall = time.monotonic() - t0
        idle = wait_idle(server)
        rss_after = server.rss_bytes
        m = server.metrics()
    figures: dict[str, object] = {
        "slots": slots,
        "concurrent_streams": streams,
        "burst": burst,
        "max_tokens": max_tokens,
        "requests": streams + burst,
        "completed": out.kinds["completed"],
        "refused_429": out.kinds["429"],
        "refused_503": out.kinds["503"],
        "other": out.kinds["other"],
        "refusal_p50_s": pct(out.refusal_s, 50),
        "refusal_p99_s": pct(out.refusal_s, 99),
        "refusal_stated_wait_p50_s": pct(out.server_wait_s, 50),
        "refusal_stated_wait_p99_s": pct(out.server_wait_s, 99),
        "retry_after_min_s": min(out.retry_after, default=0),
        "retry_after_max_s": max(out.retry_after, default=0),
        "ttft_p50_admitted_stream_s": pct(out.ttft_s, 50),
        "ttft_p99_admitted_stream_s": pct(out.ttft_s, 99),
        "wall_s": wall,
        "rss_before_mib": rss_before / 2**20,
        "rss_after_mib": rss_after / 2**20,
        "queue_wait_refusals_on_metrics": total(m, "ballast_requests_total", outcome="queue_wait"),
        "queue_full_refusals_on_metrics": total(m, "ballast_requests_total", outcome="queue_full"),
        **{f"idle_{k}": v for k, v in idle.items()},
        "other_examples": out.other[:5],
    }
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--streams", type=int, default=0, help="concurrent streams (default 25 x slots)")
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("serve_args", nargs="*", help="more `ballast serve` flags (after --)")
    a = ap.parse_args()
    figures = run(a.slots, a.streams or 25 * a.slots, a.burst, a.max_tokens, tuple(a.serve_args))
    report("overload", figures, a.out)


if __name__ == "__main__":
    main()
