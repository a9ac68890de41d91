"""Scenario 4, VRAM squeeze with governance on and off (CUDA only; not run on CPU machines):
`ballast serve` on GPU 0 serves 32 concurrent streams while new ones keep arriving; a second
process takes VRAM in steps until ~200 MiB are free, holds, and leaves. Governance on: the default
config. Governance off: `--ladder-disable` (the ledger's ceiling and the die's admission check
stay: they cannot be blinded from outside the process). The timeline records free VRAM, the level,
the outcomes and whether the server survived (no CUDA OOM) and serves again afterwards.

One die of a tensor-parallel group: `--hog-gpu 1` fills GPU 1 while GPU 0 stays calm, with
`--serve-arg=--tensor-parallel-size --serve-arg=2`. The level is the worst die's, so it turns on
GPU 1 alone; the timeline records every GPU's free VRAM and level, and the result says how high
each GPU's level went. Outcomes name the error code of a stream that ended in an error event.

    python tests/reliability/vram_squeeze.py --model /path/to/hf-dir [--mode both|on|off] [--out vram.json]
        [--hog-gpu N] [--serve-arg=--tokenizer --serve-arg=DIR ...]

The issue-47 burst (`--burst N`): the server first serves `--warm-streams` streams together, then
the second process takes all but ~200 MiB and holds, then `--clients` streaming clients send N
requests between them (each once its last answered). Printed: the server's p99 time to a 429/503
(`ballast_refusal_seconds`) and the client's, completed against refused, the served TTFT p99, and
any OOM in the server's log. E.g. (tests/gpu/run_on_device.sh squeeze, the 8B shape):
    python tests/reliability/vram_squeeze.py --model builtin:llama-8b --mode on --streams 128 \
        --warm-streams 8 --clients 64 --burst 192 --prompt-words 260 --max-tokens 128

`--device cpu` runs the same flow on the CPU at a tiny size without the second process (no VRAM
to take): a check of the script itself before GPU time, e.g.
    python tests/reliability/vram_squeeze.py --device cpu --model builtin:tiny-qwen3-next --mode on \
        --streams 4 --max-tokens 16 --hog-s 2 --hold-s 2 --serve-arg=--tensor-parallel-size --serve-arg=2
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import harness  # noqa: F401 - tests/ and tests/integration on sys.path
import httpx
from harness import pct, scrape, total
from serverproc import _read_listen_line, wait_ready

MiB = 1 << 20
HOG = r"""
import sys, time, torch
leave, step, every, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
gpu = int(sys.argv[5])
held = []
while True:
    free, _ = torch.cuda.mem_get_info(gpu)
    if free - step < leave:
        break
    # a third of what is left above the target each step (at least `step`): a few dozen steps
    take = max(step, (free - leave) // 3)
    held.append(torch.empty(take, dtype=torch.uint8, device=f"cuda:{gpu}"))
    print(free // 2**20, flush=True)
    time.sleep(every)
print("filled", flush=True)
time.sleep(hold if hold >= 0 else 1e9)
"""


def _story(i: int, max_tokens: int, prompt_words: int) -> dict[str, Any]:
    """Client i's streaming chat: a story asked for, after `prompt_words` filler words."""
    filler = " ".join(f"river{(i * 7 + w) % 997}" for w in range(prompt_words))
    return {
        "model": "x",
        "messages": [{"role": "user", "content": f"Write a long story number {i}. {filler}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def streams(
    url: str,
    stop: threading.Event,
    counts: Counter[str],
    lock: threading.Lock,
    i: int,
    max_tokens: int,
    refusals: list[float],
    prompt_words: int = 0,
) -> None:
    """One client in a loop; `refusals` gets the seconds each 429/503 took to arrive (the client's
    clock, from sending the request to its status line)."""
    body = _story(i, max_tokens, prompt_words)
    while not stop.is_set():
        sent = time.monotonic()
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                if r.status_code in (429, 503):
                    with lock:
                        refusals.append(time.monotonic() - sent)
                text = "".join(r.iter_text())
            if r.status_code == 200:
                kind = "completed" if "[DONE]" in text else f"error_event:{_error_code(text)}"
            else:  # a refusal: its status and code (e.g. 503:server_overloaded, 429:queue_wait_exceeded)
                kind = f"{r.status_code}:{_refusal_code(text)}"
        except httpx.HTTPError as exc:
            kind = type(exc).__name__
        with lock:
            counts[kind] += 1


def _error_code(text: str) -> str:
    """The code (else type) of the error event that ended a stream."""
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                err = json.loads(line[len("data: ") :]).get("error", {})
            except json.JSONDecodeError:
                continue
            return str(err.get("code") or err.get("type") or "unknown")
    return "unknown"


def _refusal_code(text: str) -> str:
    """The OpenAI error body's code (else type) of a refused request."""
    return str(_refusal_error(text).get("code") or _refusal_error(text).get("type") or "unknown")


def _refusal_error(text: str) -> dict[str, Any]:
    try:
        err = json.loads(text).get("error", {})
    except (json.JSONDecodeError, AttributeError):
        return {}
    return err if isinstance(err, dict) else {}


def _p99_bucket(m: dict[str, float]) -> float:
    """The upper bound of the histogram bucket that holds the server's p99 time to a refusal."""
    n = total(m, "ballast_refusal_seconds_count")
    if n <= 0:
        return float("nan")
    bounds = sorted(
        {float(k.split('le="')[1].split('"')[0]) for k in m if k.startswith("ballast_refusal_seconds_bucket")}
    )
    for le in bounds:
        if (
            total(m, "ballast_refusal_seconds_bucket", le=repr(le) if le != float("inf") else "+Inf")
            >= 0.99 * n
        ):
            return le
    return float("inf")


def _per_gpu(m: dict[str, float]) -> dict[str, float]:
    """Every GPU's free VRAM (MiB) and level on this scrape."""
    gpus = sorted({k.split('gpu="')[1].split('"')[0] for k in m if 'gpu="' in k})
    out: dict[str, float] = {}
    for g in gpus:
        out[f"gpu{g}_free_mib"] = total(m, "ballast_gpu_memory_free_bytes", gpu=g) / MiB
        out[f"gpu{g}_level"] = total(m, "ballast_gpu_memory_level", gpu=g)
    return out


def _spawn(
    model: str, device: str, streams_n: int, extra: list[str]
) -> tuple[subprocess.Popen[str], list[str]]:
    """`ballast serve` of the model on a free port; its output lines are collected in the list."""
    args = ["--model", model, "--device", device, "--max-num-seqs", str(streams_n)]
    args += ["--served-model-name", "x", "--host", "127.0.0.1", "--port", "0", *extra]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ballast.server.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, []


def _until_ready(proc: subprocess.Popen[str], lines: list[str]) -> str:
    """The server's URL once /ready says 200; its later output keeps going into `lines`."""
    url = _read_listen_line(proc, lines, 600)
    wait_ready(url, 600)
    threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True).start()
    return url


def run_mode(
    model: str,
    governed: bool,
    serve_args: list[str],
    streams_n: int = 32,
    max_tokens: int = 2000,
    hog_s: float = 30,
    hold_s: float = 30,
    hog_gpu: int | None = 0,
    device: str = "cuda",
    progress: bool = True,
    log: Path | None = None,
    prompt_words: int = 0,
    clients: int = 0,
) -> dict[str, Any]:
    """hog_gpu None: no second process (the CPU check of the script). `progress` prints the
    timeline every 10 s; `log` gets the server's output when the mode ends."""
    extra = [*([] if governed else ["--ladder-disable", "1"]), *serve_args]
    proc, lines = _spawn(model, device, streams_n, extra)
    counts: Counter[str] = Counter()
    lock, stop = threading.Lock(), threading.Event()
    timeline: list[dict[str, float]] = []
    refusals: list[float] = []
    hog = None
    try:
        started = time.monotonic()
        url = _until_ready(proc, lines)
        if progress:
            print(f"  server ready in {time.monotonic() - started:.0f} s", flush=True)
        for i in range(clients or streams_n + 8):  # more than the slots: new ones keep arriving
            threading.Thread(
                target=streams,
                args=(url, stop, counts, lock, i, max_tokens, refusals, prompt_words),
                daemon=True,
            ).start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 + hog_s + hold_s + 30:
            t = time.monotonic() - t0
            if hog is None and hog_gpu is not None and t > 10:
                hog = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        HOG,
                        str(200 * MiB),
                        str(256 * MiB),
                        "0.5",
                        str(hold_s),
                        str(hog_gpu),
                    ],
                    text=True,
                    stdout=subprocess.DEVNULL,
                )
            alive = proc.poll() is None
            m = scrape(url) if alive else {}
            with lock:
                done = dict(counts)
            timeline.append(
                {
                    "t_s": round(t, 1),
                    "alive": float(alive),
                    "level": total(m, "ballast_memory_pressure_level"),
                    "gpu_free_mib": total(m, "ballast_gpu_memory_free_bytes") / MiB,
                    "scheduler_pressure": total(m, "ballast_scheduler_pressure_level"),
                    "slots_active": total(m, "ballast_slots_active"),
                    "slots_limit": total(m, "ballast_slots_limit"),
                    "queued": total(m, "ballast_queue_depth"),
                    "kv_pool_mib": total(m, "ballast_kv_pool_bytes") / MiB,
                    "preemptions": total(m, "ballast_kv_preemptions_total"),
                    "generated": total(m, "ballast_generation_tokens_total"),
                    **_per_gpu(m),
                    **{f"n_{k}": float(v) for k, v in done.items()},
                }
            )
            if progress and len(timeline) % 5 == 1:
                x = timeline[-1]
                print(
                    f"  t={x['t_s']:5.0f}s level={x['level']:.0f}/{x['scheduler_pressure']:.0f} "
                    f"free={x['gpu_free_mib']:,.0f} MiB slots {x['slots_active']:.0f}/{x['slots_limit']:.0f} "
                    f"queued {x['queued']:.0f} kv {x['kv_pool_mib']:,.0f} MiB "
                    f"preempted {x['preemptions']:.0f} generated {x['generated']:,.0f} {done}",
                    flush=True,
                )
            if not alive:
                break
            time.sleep(1.0)
        stop.set()
        alive = proc.poll() is None
        final = scrape(url) if alive else {}
        served = (
            alive
            and httpx.post(
                url + "/v1/chat/completions",
                json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=60,
            ).status_code
            == 200
        )
        oom = [ln for ln in lines if "CUDA out of memory" in ln or "OutOfMemoryError" in ln]
        # A KV segment the allocator could not deliver is logged and refused like a ledger "no":
        # handled. Any other OOM line, or an outcome other than done / 429 / 503, reached a client.
        handled = [ln for ln in oom if "could not be allocated" in ln]
        # A retryable end (the server's _RETRYABLE codes) is clean; anything else reached a client.
        retryable = (
            "server_overloaded",
            "queue_full",
            "queue_wait_exceeded",
            "engine_step_failed",
            "engine_stalled",
        )
        client_errors = {
            k: v
            for k, v in counts.items()
            if not (
                k == "completed"
                or k.startswith(("429:", "503:"))
                or k.removeprefix("error_event:") in retryable
            )
        }
        gpu_levels = sorted({k.removesuffix("_level") for x in timeline for k in x if k.endswith("_level")})
        return {
            "governed": governed,
            "hog_gpu": hog_gpu,
            "max_level_by_gpu": {g: max(x.get(f"{g}_level", -1) for x in timeline) for g in gpu_levels},
            "outcomes": dict(counts),
            "server_alive": alive,
            "served_after": served,
            "oom_handled_in_log": len(handled),
            "oom_unhandled_in_log": len(oom) - len(handled),
            "client_errors": client_errors,
            "max_level": max((x["level"] for x in timeline), default=-1),
            # Time to a refusal: the client's clock, and the server's own histogram
            "refusals": len(refusals),
            "refusal_client_p50_s": pct(refusals, 50),
            "refusal_client_p99_s": pct(refusals, 99),
            "refusal_client_max_s": max(refusals, default=float("nan")),
            "refusal_server_count": total(final, "ballast_refusal_seconds_count"),
            "refusal_server_under_100ms": total(final, "ballast_refusal_seconds_bucket", le="0.1"),
            "refusal_server_p99_bucket_s": _p99_bucket(final),
            "timeline": timeline,
        }
    finally:
        stop.set()
        if log is not None:  # the server's own lines (not the access log), repeats counted
            own = [ln.rstrip() for ln in lines if ln.strip() and '" 200' not in ln and "HTTP/1.1" not in ln]
            log.write_text("\n".join(own[-400:]) + "\n")
        for p in (hog, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


class Outcome(NamedTuple):
    """One streaming chat: its outcome as `streams` names it, seconds to the status line, seconds
    to the first content token (nan: none), a refusal's message ("" else), and when it was sent
    (this process's monotonic clock)."""

    kind: str
    status_s: float
    first_s: float
    message: str
    sent: float


def one_request(
    url: str, i: int, max_tokens: int, prompt_words: int, http: httpx.Client | None = None
) -> Outcome:
    """http: the client's own connection pool, made before the clock starts (a client made per
    request costs ~30 ms of this process's CPU under the GIL for its TLS context: 64 threads
    queued behind one another's, s27)."""
    body = _story(i, max_tokens, prompt_words)
    sent, first, message = time.monotonic(), float("nan"), ""
    try:
        with (http or httpx).stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            status_s = time.monotonic() - sent
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if first != first and r.status_code == 200 and _has_text(line):
                    first = time.monotonic() - sent
            text = "\n".join(lines)
        if r.status_code == 200:
            kind = "completed" if "[DONE]" in text else f"error_event:{_error_code(text)}"
        else:
            kind, message = f"{r.status_code}:{_refusal_code(text)}", str(_refusal_error(text).get("message"))
    except httpx.HTTPError as exc:
        kind, status_s = type(exc).__name__, time.monotonic() - sent
    return Outcome(kind, status_s, first, message, sent)


def projected_past_floor(results: list[Outcome]) -> list[float]:
    """Per refusal that names its projected wait: how far that wait passes a floor of the real one,
    the last first token of the served requests sent before it (FCFS: it would have started after
    them), from its sending (s). What is left is its own prefill and the decode steps beside it: a
    figure well past a lone request's first token (`ttft_served_min_s`) reads as an early refusal."""
    wait = re.compile(r"estimated wait ([0-9.]+) s")
    served = [(o.sent, o.sent + o.first_s) for o in results if o.kind == "completed"]
    served = [(sent, first) for sent, first in served if first == first]  # nan: no first token
    out = []
    for o in results:
        projected = wait.findall(o.message)
        ahead = [first for sent, first in served if sent <= o.sent]
        if projected and ahead:
            out.append(round(float(projected[0]) - max(0.0, max(ahead) - o.sent), 3))
    return out


def _has_text(line: str) -> bool:
    """An SSE chunk carrying generated text (not the role chunk's empty content)."""
    if not line.startswith("data: {"):
        return False
    try:
        choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    except json.JSONDecodeError:
        return False
    return bool((choices[0].get("delta") or {}).get("content"))


def run_burst(
    model: str,
    serve_args: list[str],
    streams_n: int,
    warm: int,
    clients: int,
    burst: int,
    max_tokens: int,
    prompt_words: int,
    hog_gpu: int | None,
    device: str = "cuda",
    deadline_s: float = 150,
    log: Path | None = None,
    bursts: int = 1,
) -> dict[str, Any]:
    """Issue 47's squeeze: `warm` streams served together, then (hog_gpu set) a co-tenant takes all
    but ~200 MiB and holds, then `clients` clients send `burst` requests between them, `bursts`
    times over (the first burst's figures at the top, the later ones' in "bursts")."""
    proc, lines = _spawn(model, device, streams_n, serve_args)
    hog = None
    try:
        started = time.monotonic()
        url = _until_ready(proc, lines)
        print(f"  server ready in {time.monotonic() - started:.0f} s; warming at {warm} streams", flush=True)
        with ThreadPoolExecutor(warm) as ex:
            warm_results = list(ex.map(lambda i: one_request(url, i, max_tokens, prompt_words), range(warm)))
        warmed = Counter(o.kind for o in warm_results)
        warm_refused = [o.status_s for o in warm_results if o.kind.startswith(("429:", "503:"))]
        free_mib = float("nan")
        if hog_gpu is not None:
            hog = subprocess.Popen(
                [sys.executable, "-c", HOG, str(200 * MiB), str(256 * MiB), "0.2", "-1", str(hog_gpu)],
                text=True,
                stdout=subprocess.PIPE,
            )
            assert hog.stdout is not None
            for line in hog.stdout:  # its free MiB at each step, then "filled"
                if line.strip() == "filled":
                    break
            free_mib = total(scrape(url), "ballast_gpu_memory_free_bytes") / MiB
        print(
            f"  warm {dict(warmed)}; co-tenant holds, {free_mib:,.0f} MiB free; "
            f"{burst} requests from {clients} clients",
            flush=True,
        )
        rounds = []
        for n in range(bursts):  # the second is projected with what the first measured
            rounds.append(
                _one_burst(url, proc, lines, clients, burst, n * burst, max_tokens, prompt_words, deadline_s)
            )
            print(f"  burst {n + 1}: {rounds[-1]['outcomes']}", flush=True)
        return {
            "warm": dict(warmed),
            # The warm phase's requests reach a server that has measured no step yet
            "warm_refusal_client_s": sorted(round(x, 2) for x in warm_refused),
            "gpu_free_mib_after_cotenant": free_mib,
            **rounds[0],
            "bursts": rounds[1:],
        }
    finally:
        if log is not None:
            log.write_text("\n".join(ln.rstrip() for ln in lines if "HTTP/1.1" not in ln)[-800_000:] + "\n")
        for p in (hog, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def _one_burst(
    url: str,
    proc: subprocess.Popen,
    lines: list[str],
    clients: int,
    burst: int,
    first_id: int,
    max_tokens: int,
    prompt_words: int,
    deadline_s: float,
) -> dict[str, Any]:
    """`clients` clients send `burst` requests between them; what came of them, the server's
    refusal counts taken since the burst began."""
    before, seen = scrape(url), len(lines)
    todo = iter(range(first_id, first_id + burst))
    lock = threading.Lock()
    results: list[Outcome] = []
    https = [httpx.Client(timeout=600) for _ in range(clients)]  # each client's keep-alive pool
    t0 = time.monotonic()

    def client(http: httpx.Client) -> None:
        while time.monotonic() - t0 < deadline_s:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            r = one_request(url, 1000 + i, max_tokens, prompt_words, http)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(http,), daemon=True) for http in https]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline_s + 30 - (time.monotonic() - t0)))
    burst_s = time.monotonic() - t0
    for http in https:
        http.close()
    alive = proc.poll() is None
    final = scrape(url) if alive else {}
    since = {k: v - before.get(k, 0.0) for k, v in final.items()}  # the refusal counters' share
    counts = Counter(o.kind for o in results)
    refused = [o.status_s for o in results if o.kind.startswith(("429:", "503:"))]
    ttft = [o.first_s for o in results if o.kind == "completed" and o.first_s == o.first_s]
    # why they were refused: each distinct message with digits masked, and how often
    said = Counter(re.sub(r"[0-9][0-9.,]*", "#", o.message) for o in results if o.message)
    # the waits the refusals at arrival were projected, against the queue ahead of each
    projected = [float(x) for o in results for x in re.findall(r"estimated wait ([0-9.]+) s", o.message)]
    past_floor = projected_past_floor(results)
    oom = [ln for ln in lines if "CUDA out of memory" in ln or "OutOfMemoryError" in ln]
    return {
        "burst_s": round(burst_s, 1),
        "sent": len(results),
        "outcomes": dict(counts),
        "refusal_messages": dict(said.most_common(6)),
        "completed": counts.get("completed", 0),
        "refused": len(refused),
        "refusal_client_p50_s": pct(refused, 50),
        "refusal_client_p99_s": pct(refused, 99),
        "refusal_server_count": total(since, "ballast_refusal_seconds_count"),
        "refusal_server_under_100ms": total(since, "ballast_refusal_seconds_bucket", le="0.1"),
        "refusal_server_p99_bucket_s": _p99_bucket(since),
        "ttft_served_p50_s": pct(ttft, 50),
        "ttft_served_p99_s": pct(ttft, 99),
        "ttft_served_max_s": max(ttft, default=float("nan")),
        "refusal_projected_wait_min_p50_s": [min(projected, default=float("nan")), pct(projected, 50)],
        # each such refusal's projected wait past the last first token of those sent before it
        "refusal_projected_past_floor_min_p50_s": [
            min(past_floor, default=float("nan")),
            pct(past_floor, 50),
        ],
        "ttft_served_min_s": min(ttft, default=float("nan")),
        # the queued requests' real waits over their projections (median): the next burst's factor
        "queue_wait_factor_after": total(final, "ballast_queue_wait_factor"),
        # how queued requests' first tokens came against the waits projected for them, by projection
        "first_token_over_projected": projection_error(lines[seen:]),
        "server_alive": alive,
        "oom_in_log": len(oom),
    }


# The server's per-request event (`--log-level debug`) for a queued request's first token
FIRST_TOKEN = re.compile(r"first token after ([0-9.]+) s, projected ([0-9.]+) s as queued")
PROJECTED_BINS_S = (1.0, 5.0, 10.0, 15.0, 21.0)


def projection_error(lines: list[str]) -> dict[str, list[float]]:
    """Queued requests' real waits over their projections, by the wait projected (a bin from each
    of PROJECTED_BINS_S to the next): [count, median, min, max]."""
    bins: dict[str, list[float]] = {}
    edges = (*PROJECTED_BINS_S, math.inf)
    for line in lines:
        if (m := FIRST_TOKEN.search(line)) is None or float(m[2]) < edges[0]:
            continue
        waited, projected = float(m[1]), float(m[2])
        lo = max(e for e in edges if e <= projected)
        bins.setdefault(f"{lo:g}-{edges[edges.index(lo) + 1]:g} s", []).append(waited / projected)
    return {
        k: [len(v), round(statistics.median(v), 2), round(min(v), 2), round(max(v), 2)]
        for k, v in sorted(bins.items(), key=lambda kv: float(kv[0].split("-")[0]))
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="scenario 4: VRAM squeeze (CUDA)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("both", "on", "off"), default="both")
    ap.add_argument("--out")
    ap.add_argument(
        "--serve-arg", action="append", default=[], help="passed on to ballast serve (repeatable)"
    )
    ap.add_argument("--hog-gpu", type=int, default=0, help="the GPU the second process fills")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: no hog, a check")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--hog-s", type=float, default=30, help="seconds the hog takes to fill")
    ap.add_argument("--hold-s", type=float, default=30, help="seconds the hog holds what it took")
    ap.add_argument(
        "--prompt-words",
        type=int,
        default=0,
        help="filler words per prompt (~3.8 tokens each: 260 make ~1k tokens)",
    )
    ap.add_argument("--clients", type=int, default=0, help="client threads (default: streams + 8)")
    ap.add_argument("--burst", type=int, default=0, help="issue 47: this many requests after the squeeze")
    ap.add_argument("--warm-streams", type=int, default=8, help="--burst: streams served together first")
    ap.add_argument("--deadline-s", type=float, default=150, help="--burst: no request sent after this")
    ap.add_argument("--bursts", type=int, default=1, help="--burst: this many bursts, one after another")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    if a.burst:
        r = run_burst(
            a.model,
            a.serve_arg,
            a.streams,
            a.warm_streams,
            a.clients or a.streams,
            a.burst,
            a.max_tokens,
            a.prompt_words,
            a.hog_gpu if a.device == "cuda" else None,
            a.device,
            a.deadline_s,
            Path(a.out).with_suffix(".log") if a.out else None,
            a.bursts,
        )
        print(json.dumps(r, indent=1), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(r, indent=2) + "\n")
        return
    results = []
    for governed in {"both": (True, False), "on": (True,), "off": (False,)}[a.mode]:
        print(f"governance {'on' if governed else 'off'}:", flush=True)
        log = Path(a.out).with_suffix(f".{'on' if governed else 'off'}.log") if a.out else None
        r = run_mode(
            a.model,
            governed,
            a.serve_arg,
            a.streams,
            a.max_tokens,
            a.hog_s,
            a.hold_s,
            a.hog_gpu if a.device == "cuda" else None,
            a.device,
            log=log,
            prompt_words=a.prompt_words,
            clients=a.clients,
        )
        print({k: v for k, v in r.items() if k != "timeline"}, flush=True)
        results.append(r)
        if a.out:  # after each mode: a run cut short keeps what it measured
            Path(a.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
