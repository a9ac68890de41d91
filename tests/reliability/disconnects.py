"""Scenario 6, disconnect storm: streaming clients that drop at random points (while queued,
after the first chunk, mid-stream; some read to the end) against `ballast serve` on CPU.
Afterwards no slot, queue entry or KV block is held, and /metrics counts every request exactly
once: the ones that read to the end as finished, the others as aborts.

    python tests/reliability/disconnects.py [--clients 200] [--out disconnects.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
from harness import ballast_serve, report, total, wait_idle


async def client(http: httpx.AsyncClient, url: str, i: int, drop_after: int | None, max_tokens: int) -> str:
    """Stream one chat; close the connection after `drop_after` data lines (None: read all).
    Returns "done", "dropped" or the HTTP status of a refusal."""
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": f"Count to {i}."}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    if drop_after == -1:  # sends the whole request, then drops while still waiting (queued)
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        payload = json.dumps(body).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(payload) + payload
        )
        await writer.drain()
        try:
            first = await asyncio.wait_for(reader.read(64), timeout=0.2)
        except asyncio.TimeoutError:
            first = b""
        writer.close()
        return "refused" if first.startswith(b"HTTP/1.1 4") else "dropped"
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        seen = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return "done"
            if line.startswith("data: "):
                seen += 1
                if drop_after is not None and seen >= drop_after:
                    return "dropped"  # leaving the block closes the connection
    return "dropped"


async def storm(url: str, clients: int, max_tokens: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    plans: list[int | None] = []
    for _ in range(clients):
        r = rnd.random()
        plans.append(None if r < 0.2 else -1 if r < 0.35 else rnd.randint(1, max_tokens))
    limits = httpx.Limits(max_connections=clients + 10)
    async with httpx.AsyncClient(limits=limits, timeout=300) as http:
        return list(await asyncio.gather(*(client(http, url, i, d, max_tokens) for i, d in enumerate(plans))))


def run(clients: int = 200, slots: int = 8, max_tokens: int = 48, seed: int = 13) -> dict[str, object]:
    args = [
        "--max-num-seqs",
        str(slots),
        "--max-model-len",
        "256",
        "--served-model-name",
        "x",
        "--max-queue",
        str(clients),
    ]
    with ballast_serve(args) as server:
        rss_before = server.rss_bytes
        t0 = time.monotonic()
        ends = asyncio.run(storm(server.url, clients, max_tokens, seed))
        wall = time.monotonic() - t0
        idle = wait_idle(server)
        deadline = (
            time.monotonic() + 10
        )  # the last disconnects may still be on their way through the handlers
        while (
            total(m := server.metrics(), "ballast_requests_total") < clients and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        rss_after = server.rss_bytes
    counted = {o: total(m, "ballast_requests_total", outcome=o) for o in ("stop", "length", "abort")}
    return {
        "clients": clients,
        "slots": slots,
        "max_tokens": max_tokens,
        "read_to_end": ends.count("done"),
        "dropped": ends.count("dropped"),
        "refused": len(ends) - ends.count("done") - ends.count("dropped"),
        "refusal_statuses": sorted(set(ends) - {"done", "dropped"}),
        "metrics_refused": total(m, "ballast_requests_total") - sum(counted.values()),
        "metrics_finished": counted["stop"] + counted["length"],
        "metrics_aborted": counted["abort"],
        "metrics_total": total(m, "ballast_requests_total"),
        "wall_s": wall,
        "rss_before_mib": rss_before / 2**20,
        "rss_after_mib": rss_after / 2**20,
        **{f"idle_{k}": v for k, v in idle.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="scenario 6: disconnect storm")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out")
    a = ap.parse_args()
    report("disconnect storm", run(a.clients, a.slots, a.max_tokens), a.out)


if __name__ == "__main__":
    main()
