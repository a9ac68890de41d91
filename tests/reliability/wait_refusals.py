"""Issue 47's case, where memory (not slots) is what runs short: `ballast serve` on the default model
in a real memory cgroup, more slots than its KV room holds, and a burst of concurrent streaming chats
with long prompts. A request that cannot start within --max-queue-wait-s must be refused at once
(429/503 + Retry-After), not after the whole bound; a request that is served must get its first
token within the bound; nothing but 200/429/503; the server alive and never OOM-killed.

Each client records, on its own clock, the time to its refusal or to its first token; the server's
`ballast_refusal_seconds` histogram is read at the end.

Needs permission to make a child memory cgroup (root on cgroup v1, or a delegated v2 subtree); it
says why and exits 0 otherwise ("skipped").

    python tests/reliability/wait_refusals.py [--limit-gib 2] [--slots 32] [--clients 48]
        [--prompt-words 200] [--max-tokens 512] [--bound 30] [--out wait_refusals.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness  # noqa: F401 - tests/ and tests/integration on sys.path
import httpx
import openai
from harness import pct, scrape, total
from serverproc import _read_listen_line, wait_ready
from squeeze import Cgroup

GiB = 1 << 30
MiB = 1 << 20
WAITS_FOR = re.compile(r"waiting for ([a-zA-Z ]+)\)")


@dataclass
class Outcomes:
    kinds: Counter[str] = field(default_factory=Counter)
    refusal_s: list[float] = field(default_factory=list)  # client clock, send -> refusal
    ttft_s: list[float] = field(default_factory=list)  # client clock, send -> first content
    retry_after_s: list[float] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    waits_for: Counter[str] = field(default_factory=Counter)  # what each wait refusal names


def prompt_for(who: int, words: int) -> str:
    # Unique per client: no prefix is shared, so each request needs its own KV blocks.
    return " ".join(f"c{who}w{i}" for i in range(words))


async def one(
    client: openai.AsyncOpenAI, who: int, words: int, max_tokens: int, out: Outcomes, read: int | None
) -> None:
    """One streaming chat; `read`: close the stream after its first `read` chunks (None: read all)."""
    t0 = time.monotonic()
    try:
        chunks = await client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": prompt_for(who, words)}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        first = None
        n = 0
        async for chunk in chunks:
            n += 1
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - t0
            if read is not None and first is not None and n >= read:
                await chunks.response.aclose()  # the client goes: the server aborts the request
                break
        out.ttft_s.append(first if first is not None else time.monotonic() - t0)
        out.kinds["200"] += 1
    except openai.APIStatusError as exc:
        out.kinds[str(exc.status_code)] += 1
        if exc.status_code in (429, 503):
            out.refusal_s.append(time.monotonic() - t0)
            named = WAITS_FOR.search(exc.message)
            out.waits_for[named.group(1) if named else "-"] += 1
            out.retry_after_s.append(float(exc.response.headers.get("retry-after", "nan")))
        if len(out.messages) < 5:
            out.messages.append(f"{exc.status_code}: {exc.message}")
    except Exception as exc:  # a dropped connection, a timeout: never an acceptable outcome
        out.kinds["other"] += 1
        out.messages.append(f"{type(exc).__name__}: {exc}")


async def burst(url: str, clients: int, words: int, max_tokens: int, read: int | None) -> Outcomes:
    out = Outcomes()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http)
        await asyncio.gather(*(one(client, i, words, max_tokens, out, read) for i in range(clients)))
    return out


def run(
    limit: int | None,
    slots: int,
    clients: int,
    words: int,
    max_tokens: int,
    bound_s: float,
    max_len: int = 2048,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
    model: str = "default",
    read: int | None = None,
    warm: bool = True,
) -> dict[str, Any]:
    """limit: the memory cgroup's, in bytes (None: no cgroup of its own, memory is not the limit).
    warm: serve two requests before the burst (False: the burst meets a server that has measured
    no step)."""
    cg = Cgroup(limit) if limit is not None else None
    args = ["--model", model, "--max-num-seqs", str(slots), "--max-model-len", str(max_len)]
    args += ["--max-queue-wait-s", str(bound_s), *extra]
    args += ["--served-model-name", "x", "--host", "127.0.0.1", "--port", "0", "--log-format", "json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ballast.server.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=cg.enter if cg is not None else None,
    )
    lines: list[str] = []
    try:
        url = _read_listen_line(proc, lines, 300)
        wait_ready(url, 300)
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout or ()], daemon=True).start()
        # Warm: the server has served before the burst (its step times are measured: the second
        # request's steps are warm ones; a size's first step only stands in until one is).
        warmer = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        prompt_tokens = 0
        n_warm = 2 if warm else 0
        for k in range(n_warm):
            warmed = warmer.chat.completions.create(
                model="x", messages=[{"role": "user", "content": prompt_for(-1 - k, words)}], max_tokens=8
            )
            prompt_tokens = warmed.usage.prompt_tokens if warmed.usage else 0
        t0 = time.monotonic()
        out = asyncio.run(burst(url, clients, words, max_tokens, read))
        wall = time.monotonic() - t0
        until = time.monotonic() + 10  # a served request's `finished` line may trail its stream's end
        while len(_server_ttfts(lines, n_warm)) < out.kinds["200"] and time.monotonic() < until:
            time.sleep(0.05)
        m = scrape(url)
        alive = proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        oom = cg.oom_kills() if cg is not None else 0
        if cg is not None:
            cg.remove()
    served_429 = total(m, "ballast_refusal_seconds_count", status="429")
    served_503 = total(m, "ballast_refusal_seconds_count", status="503")
    refusal_sum = total(m, "ballast_refusal_seconds_sum")
    return {
        "limit_mib": limit / MiB if limit is not None else None,
        "model": model,
        "slots": slots,
        "clients": clients,
        "prompt_words": words,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "max_queue_wait_s": bound_s,
        "serve_args": list(extra),
        "outcomes": dict(out.kinds),
        "refusal_waits_for": dict(out.waits_for),
        "refusal_p50_s": pct(out.refusal_s, 50),
        "refusal_p99_s": pct(out.refusal_s, 99),
        "refusal_max_s": max(out.refusal_s, default=0.0),
        "ttft_p50_s": pct(out.ttft_s, 50),
        "ttft_p99_s": pct(out.ttft_s, 99),
        "ttft_max_s": max(out.ttft_s, default=0.0),
        "ttft_s": sorted(out.ttft_s),
        # the server's own clock, from the request's submission (where its queue wait starts) to its
        # first token, from each served request's `finished` event (the warm-up's come first)
        "server_ttft_s": sorted(_server_ttfts(lines, n_warm)),
        "retry_after_min_s": min(out.retry_after_s, default=0.0),
        "retry_after_max_s": max(out.retry_after_s, default=0.0),
        "server_refusals": served_429 + served_503,
        "server_refusal_mean_s": refusal_sum / max(1.0, served_429 + served_503),
        "queue_wait_refusals": total(m, "ballast_requests_total", outcome="queue_wait"),
        "wall_s": wall,
        "server_alive": alive,
        "oom_kills": oom,
        "examples": out.messages,
        "server_errors": [x.rstrip() for x in lines if "Traceback" in x or '"level": "ERROR"' in x][-20:],
        "server_log_tail": [x.rstrip() for x in lines[-60:]],
    }


def _server_ttfts(lines: list[str], skip: int) -> list[float]:
    """The served requests' times to first token, in the server's log order, less the first `skip`."""
    return [t for t in (_finished_ttft(x) for x in list(lines)) if t is not None][skip:]


def _finished_ttft(line: str) -> float | None:
    """A served request's time to first token, from its `finished` event (JSON log), else None."""
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    ttft = record.get("ttft_s") if record.get("event") == "finished" else None
    return float(ttft) if ttft is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit-gib", type=float, default=2.0)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--prompt-words", type=int, default=200, help="~7 tokens each")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--bound", type=float, default=30.0, help="--max-queue-wait-s")
    ap.add_argument("--reserve-floor-mib", type=int, default=256)
    ap.add_argument("--serve-arg", action="append", default=[], help="passed to ballast serve")
    ap.add_argument("--out", default="wait_refusals.json")
    a = ap.parse_args()
    env = {"BALLAST_HOST_RESERVE_MIN_BYTES": str(a.reserve_floor_mib * MiB)}
    try:
        f = run(
            int(a.limit_gib * GiB),
            a.slots,
            a.clients,
            a.prompt_words,
            a.max_tokens,
            a.bound,
            env=env,
            extra=tuple(a.serve_arg),
        )
    except OSError as e:
        print(f"skipped: cannot make a child memory cgroup here ({e})")
        return
    Path(a.out).write_text(json.dumps(f, indent=1) + "\n")
    print(json.dumps(f, indent=1))


if __name__ == "__main__":
    main()
