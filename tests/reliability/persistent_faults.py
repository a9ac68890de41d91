"""Scenario 6, faults that persist, injected from outside with `BALLAST_FAULTS` into a real
`ballast serve` child process (built-in tiny Llama on CPU, the official `openai` client):

- hang: a decode step never returns. Every client (streaming or queued) gets its 503
  `engine_stalled` within the watchdog's deadline, /health answers 503 with that code, and the
  process exits non-zero.
- oom: steps keep failing for want of memory (`count` steps, -1 = forever), under a steady load
  of clients. Within a few failed steps /ready is 503 and new requests are refused at once with
  503 + Retry-After; with a finite count the server serves again afterwards, nothing held.
- prompt: one new prompt's chunk fails for want of memory beside running streams. The streams
  complete with the tokens of a calm run of the same prompts on the same server, and the prompt
  is served too.

- tp_hang: under tensor parallel on the CPU (two ranks, gloo), rank 1's step hangs: rank 0 waits in
  the all-reduce until its watchdog fires; the clients get their 503s and no worker outlives it.

    python tests/reliability/persistent_faults.py [--scenario hang|tp_hang|oom|prompt|all] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import harness
import httpx
import openai
import psutil
from harness import Server, ballast_serve, pct, report, total, wait_idle

_DEADLINE = re.compile(r"deadline ([0-9.]+) s")


def _client(server: Server) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    return client, client.models.list().data[0].id


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me story number {i} about a river and a stone."}]


class Probe:
    """Polls /health and /ready every 20 ms in a thread: (monotonic time, path, status, body)."""

    def __init__(self, url: str) -> None:
        self.seen: list[tuple[float, str, int, dict[str, Any]]] = []
        self._url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as http:
            while not self._stop.is_set():
                for path in ("/health", "/ready"):
                    try:
                        r = http.get(self._url + path)
                        self.seen.append((time.monotonic(), path, r.status_code, r.json()))
                    except (httpx.HTTPError, ValueError):
                        pass
                time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def first(self, path: str, status: int) -> tuple[float, dict[str, Any]] | None:
        return next(((t, b) for t, p, s, b in self.seen if p == path and s == status), None)


def _stream(client: openai.OpenAI, model: str, i: int, max_tokens: int, marks: list[float]) -> dict[str, Any]:
    """One streamed chat; marks gets the time of every token. Returns how it ended."""
    text = []
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=_messages(i),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                marks.append(time.monotonic())
        return {"ok": True, "text": "".join(text), "end": time.monotonic()}
    except openai.APIError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        status = getattr(exc, "status_code", None)
        return {
            "ok": False,
            "code": body.get("code"),
            "message": str(body.get("message", "")),
            "status": status,
            "end": time.monotonic(),
            "tokens": len(text),
        }


def run_hang(
    watchdog_s: float = 1.0,
    streams: int = 3,
    queued: int = 2,
    ranks: int = 1,
    kind: str = "hang",
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """ranks 2: tensor parallel over two CPU processes (gloo), the hang in rank 1's step: rank 0
    waits in the step's all-reduce until its watchdog fires, and no worker may outlive it.
    kind device_hang (on a GPU): the step's kernel spins on the device and the engine thread waits
    for it inside CUDA."""
    faults = [{"kind": kind, "after_steps": 30, "when": "decode", "seconds": 600, "rank": ranks - 1}]
    args = ["--max-num-seqs", str(streams), "--step-watchdog-s", str(watchdog_s), *extra]
    if ranks > 1:
        args += ["--tensor-parallel-size", str(ranks), "--device", "cpu"]
    with ballast_serve(args, env={"BALLAST_FAULTS": json.dumps(faults)}) as server:
        client, model = _client(server)
        workers = [
            p
            for p in psutil.Process(server.pid).children(recursive=True)
            if "ballast" in " ".join(p.cmdline()) or p.name().startswith("python")
        ]
        probe = Probe(server.url)
        marks: list[list[float]] = [[] for _ in range(streams)]
        with ThreadPoolExecutor(streams + queued) as pool:
            running = [pool.submit(_stream, client, model, i, 400, marks[i]) for i in range(streams)]
            while sum(len(m) for m in marks) < streams * 5:
                time.sleep(0.01)
            waiting = [pool.submit(_stream, client, model, 100 + i, 8, []) for i in range(queued)]
            ends = [f.result(timeout=120) for f in running + waiting]
        last_token = max(m[-1] for m in marks if m)
        exit_code = psutil.Process(server.pid).wait(timeout=60)
        probe.stop()
        health = probe.first("/health", 503)
        _, alive = psutil.wait_procs(workers, timeout=10)
    return {
        "kind": kind,
        "ranks": ranks,
        "workers": len(workers),
        "workers_alive_after_exit": len(alive),
        "watchdog_s": watchdog_s,
        "clients": len(ends),
        "clients_engine_stalled": sum(e.get("code") == "engine_stalled" for e in ends),
        "client_codes": sorted({str(e.get("code")) for e in ends}),
        # The deadline the watchdog applied, as its 503 says: max(floor, 20 x p99 of decode steps).
        "deadline_s": max(float(m.group(1)) for e in ends if (m := _DEADLINE.search(e.get("message", "")))),
        "detect_s_max": max(e["end"] for e in ends) - last_token,
        "health_503_code": health[1].get("code") if health else None,
        "health_503_after_s": health[0] - last_token if health else None,
        "exit_code": exit_code,
    }


def _load(client: openai.OpenAI, model: str, seconds: float, workers: int) -> list[dict[str, Any]]:
    """`workers` clients sending short chats back to back for `seconds`: status, code, time, Retry-After."""
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def worker(w: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=model,
                    messages=_messages(w * 1000 + i),
                    max_tokens=8,
                    temperature=0,  # type: ignore[arg-type]
                )
                rec = {"status": raw.status_code, "code": None, "retry_after": None}
            except openai.APIStatusError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                rec = {
                    "status": exc.status_code,
                    "code": body.get("code"),
                    "retry_after": exc.response.headers.get("retry-after"),
                }
            rec.update(start=started, seconds=time.monotonic() - started)
            with lock:
                out.append(rec)
            i += 1
            if rec["status"] != 200:
                time.sleep(0.05)  # a client that was refused backs off a little (not the full Retry-After)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(worker, range(workers)))
    return sorted(out, key=lambda r: r["start"])


def run_oom(count: int = 6, seconds: float = 10.0, workers: int = 3) -> dict[str, Any]:
    faults = [{"kind": "oom", "count": count}]
    with ballast_serve(["--max-num-seqs", "4"], env={"BALLAST_FAULTS": json.dumps(faults)}) as server:
        client, model = _client(server)
        probe = Probe(server.url)
        calls = _load(client, model, seconds, workers)
        probe.stop()
        ready_503 = probe.first("/ready", 503)
        health_bad = [b for _, p, s, b in probe.seen if p == "/health" and s != 200]
        after_ready = [c for c in calls if ready_503 and c["start"] >= ready_503[0]]
        refusals = [c for c in calls if c["status"] in (429, 503)]
        fast = [c["seconds"] for c in after_ready if c["status"] == 503 and c["code"] == "server_overloaded"]
        served_after = [
            c for c in calls if c["status"] == 200 and refusals and c["start"] > refusals[-1]["start"]
        ]
        m = server.metrics()
        figures: dict[str, Any] = {
            "faults": count,
            "requests": len(calls),
            "completed": sum(c["status"] == 200 for c in calls),
            "refused_503": sum(c["status"] == 503 for c in calls),
            "other": sum(c["status"] not in (200, 503) for c in calls),
            "codes": sorted({str(c["code"]) for c in refusals}),
            "retry_after_missing": sum(c["retry_after"] is None for c in refusals),
            "failed_steps_on_metrics": total(m, "ballast_requests_total", outcome="step_failed"),
            "ready_503_seen": ready_503 is not None,
            "ready_503_reason": ready_503[1].get("reason") if ready_503 else None,
            "health_not_200": len(health_bad),
            "fast_refusals": len(fast),
            "fast_refusal_p50_s": pct(fast, 50),
            "fast_refusal_p99_s": pct(fast, 99),
            "server_refusals_under_100ms": total(m, "ballast_refusal_seconds_bucket", le="0.1"),
            "server_refusals": total(m, "ballast_refusal_seconds_count"),
            "served_after_the_faults": len(served_after),
        }
        if count != -1:
            idle = wait_idle(server)
            figures.update({f"idle_{k}": v for k, v in idle.items()})
    return figures


def run_prompt(streams: int = 8, max_tokens: int = 48) -> dict[str, Any]:
    """A calm run of `streams` greedy streams first, then the same streams again with a new
    prompt arriving mid-way whose prefill step fails for want of memory."""
    faults = [{"kind": "oom", "when": "prefill", "after_steps": max_tokens + 30, "count": 1}]
    args = ["--max-num-seqs", str(streams + 1), "--max-queue-wait-s", "0"]
    with ballast_serve(args, env={"BALLAST_FAULTS": json.dumps(faults)}) as server:
        client, model = _client(server)

        def wave(extra: Callable[[list[list[float]]], None] | None) -> list[dict[str, Any]]:
            marks: list[list[float]] = [[] for _ in range(streams)]
            with ThreadPoolExecutor(streams) as pool:
                futures = [
                    pool.submit(_stream, client, model, i, max_tokens, marks[i]) for i in range(streams)
                ]
                if extra is not None:
                    extra(marks)
                return [f.result(timeout=300) for f in futures]

        calm = wave(None)
        newcomer: list[dict[str, Any]] = []

        def send_newcomer(marks: list[list[float]]) -> None:
            while min(len(m) for m in marks) < 36 and not all(len(m) >= max_tokens for m in marks):
                time.sleep(0.005)
            newcomer.append(_stream(client, model, 999, 8, []))

        faulted = wave(send_newcomer)
        m = server.metrics()
        health = httpx.get(server.url + "/health", timeout=10).json()
        idle = wait_idle(server)
    same = sum(
        a.get("text") == b.get("text") and a["ok"] and b["ok"] for a, b in zip(calm, faulted, strict=True)
    )
    return {
        "streams": streams,
        "calm_completed": sum(c["ok"] for c in calm),
        "faulted_completed": sum(f["ok"] for f in faulted),
        "same_text_as_calm": same,
        "newcomer_ok": bool(newcomer and newcomer[0]["ok"]),
        "requests_failed_on_metrics": total(m, "ballast_requests_total", outcome="step_failed"),
        "failed_steps": health.get("step_failures", 0),
        "last_step_failure": health.get("last_step_failure"),
        **{f"idle_{k}": v for k, v in idle.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="scenario 6: faults that persist (BALLAST_FAULTS)")
    ap.add_argument("--scenario", choices=("hang", "tp_hang", "oom", "prompt", "all"), default="all")
    ap.add_argument("--out")
    a = ap.parse_args()
    figures: dict[str, Any] = {}
    if a.scenario in ("hang", "all"):
        figures["hang"] = run_hang()
    if a.scenario in ("tp_hang", "all"):
        figures["tp_hang"] = run_hang(ranks=2)
    if a.scenario in ("oom", "all"):
        figures["oom_finite"] = run_oom(count=6)
        figures["oom_forever"] = run_oom(count=-1, seconds=6.0)
    if a.scenario in ("prompt", "all"):
        figures["prompt"] = run_prompt()
    for name, f in figures.items():
        report(f"persistent faults: {name} ({harness.MODEL}, CPU)", f, None)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
