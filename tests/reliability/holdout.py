"""Issue 31's holdout-style run: `ballast serve` on the default model in a memory cgroup of
3 GiB, with 16 streams generating until their contexts fill the KV the cgroup cannot hold. The
server must refuse, preempt or cap, never be OOM-killed: every request ends with its tokens, a
length cap, or a fast retryable refusal, and the cgroup's OOM-kill count stays 0.

Every second it records the server's RSS, the KV pool's granted bytes (/metrics), the cgroup's
usage and its peak (memory.max_usage_in_bytes on v1, memory.peak on v2) and the OOM kills; it
prints a table every few seconds and writes the whole timeline and the outcomes as JSON.

Needs permission to create a child memory cgroup (root on cgroup v1, or a delegated v2
subtree); it says what was refused and exits 0 otherwise ("skipped").

    python tests/reliability/holdout.py [--limit-gib 3] [--streams 16] [--seconds 300]
        [--max-model-len 2048] [--serve-arg=--max-queue-wait-s --serve-arg=0] [--out holdout.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import harness  # noqa: F401 - tests/ and tests/integration on sys.path
import httpx
import openai
import psutil
from harness import scrape, total
from serverproc import _read_listen_line, wait_ready
from squeeze import Cgroup

GiB = 1 << 30
MiB = 1 << 20


def peak_bytes(cg: Cgroup) -> int:
    name = "memory.max_usage_in_bytes" if cg.v1 else "memory.peak"
    return int((cg.path / name).read_text())


def stream(url: str, stop: threading.Event, outcomes: Counter[str], lock: threading.Lock, who: int) -> None:
    """One client: a new ~1,000-token prompt each time, asking for everything left of the context
    (no max_tokens: the server gives it the rest of the window)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    n = 0
    while not stop.is_set():
        n += 1
        prompt = " ".join(f"s{who}r{n}w{i}" for i in range(200))  # unique: no prefix is shared
        kind = "completed"
        try:
            chunks = client.chat.completions.create(
                model="x",
                messages=[{"role": "user", "content": prompt}],
                temperature=0.8,
                stream=True,
            )
            finish = None
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if (chunk.model_extra or {}).get("x_ballast_capped"):
                    kind = "capped"
            kind = kind if kind == "capped" else f"finished:{finish}"
        except openai.APIStatusError as exc:
            kind = f"refused:{exc.status_code}"
        except (openai.APIConnectionError, httpx.HTTPError) as exc:
            kind = f"connection:{type(exc).__name__}"
        with lock:
            outcomes[kind] += 1
        if kind.startswith(("refused", "connection")):
            time.sleep(0.5)  # as a client told Retry-After would


def run(
    limit: int, streams: int, seconds: float, max_len: int = 2048, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    cg = Cgroup(limit)
    args = ["--model", "default", "--max-num-seqs", str(streams), "--max-model-len", str(max_len), *extra]
    args += ["--served-model-name", "x", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ballast.server.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=cg.enter,
    )
    lines: list[str] = []
    timeline: list[dict[str, float]] = []
    outcomes: Counter[str] = Counter()
    lock, stop = threading.Lock(), threading.Event()
    clients: list[threading.Thread] = []
    alive = False
    try:
        url = _read_listen_line(proc, lines, 300)
        wait_ready(url, 300)
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout or ()], daemon=True).start()
        clients += [
            threading.Thread(target=stream, args=(url, stop, outcomes, lock, i), daemon=True)
            for i in range(streams)
        ]
        for c in clients:
            c.start()
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < seconds and proc.poll() is None:
            row: dict[str, float] = {"t_s": round(t, 1)}
            try:
                m = scrape(url)
                row["kv_granted_mib"] = total(m, "ballast_kv_pool_bytes") / MiB
                row["level"] = total(m, "ballast_memory_pressure_level")
                row["preemptions"] = total(m, "ballast_kv_preemptions_total")
                row["active"] = total(m, "ballast_slots_active")
            except httpx.HTTPError:
                row["kv_granted_mib"] = -1.0  # no answer to a scrape: a stall, recorded as such
            row["rss_mib"] = psutil.Process(proc.pid).memory_info().rss / MiB
            row["cgroup_mib"] = cg.usage() / MiB
            row["cgroup_peak_mib"] = peak_bytes(cg) / MiB
            row["oom_kills"] = float(cg.oom_kills())
            timeline.append(row)
            if len(timeline) % 10 == 1:
                with lock:
                    done = sum(outcomes.values())
                print(
                    f"{row['t_s']:>6.0f}s rss {row['rss_mib']:>6.0f} MiB  "
                    f"kv {row['kv_granted_mib']:>6.0f} MiB  "
                    f"cgroup {row['cgroup_mib']:>6.0f} (peak {row['cgroup_peak_mib']:>6.0f}) MiB  "
                    f"level {row.get('level', -1):.0f}  preempted {row.get('preemptions', 0):.0f}  "
                    f"oom {row['oom_kills']:.0f}  requests done {done}",
                    flush=True,
                )
            time.sleep(1.0)
        stop.set()
        alive = proc.poll() is None
    finally:
        stop.set()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        oom = cg.oom_kills()
        peak = peak_bytes(cg)
        cg.remove()
    for c in clients:  # the server is gone: each ends its request with a connection error
        c.join(timeout=30)
    capacity = [x for x in lines if "capacity:" in x]
    # What the server said about anything that went wrong (a 500 is a bug to read, not a figure).
    errors = [x.rstrip() for x in lines if any(w in x for w in ("ERROR", "Traceback", "Error:", "CRITICAL"))]
    return {
        "limit_mib": limit / MiB,
        "streams": streams,
        "seconds": seconds,
        "max_model_len": max_len,
        "serve_args": list(extra),
        "cgroup_version": 1 if cg.v1 else 2,
        "server_alive_at_end": alive,
        "oom_kills": oom,
        "cgroup_peak_mib": peak / MiB,
        "rss_peak_mib": max((r["rss_mib"] for r in timeline), default=0.0),
        "kv_granted_peak_mib": max((r.get("kv_granted_mib", 0.0) for r in timeline), default=0.0),
        "outcomes": dict(outcomes),
        "capacity_line": capacity[-1].strip() if capacity else "",
        "server_errors": errors[-200:],
        "server_log_tail": [x.rstrip() for x in lines[-300:]],
        "timeline": timeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-gib", type=float, default=3.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to ballast serve")
    parser.add_argument("--out", default="holdout.json")
    a = parser.parse_args()
    try:
        result = run(int(a.limit_gib * GiB), a.streams, a.seconds, a.max_model_len, tuple(a.serve_arg))
    except OSError as e:
        print(
            f"skipped: cannot make a child memory cgroup here ({e}); needs root on cgroup v1 or a delegated "
            "cgroup v2 subtree"
        )
        return
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1))
    if result["oom_kills"] or not result["server_alive_at_end"]:
        raise SystemExit("the server was OOM-killed or died: governance failed")


if __name__ == "__main__":
    main()
