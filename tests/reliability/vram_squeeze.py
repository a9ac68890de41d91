"""Scenario 4, VRAM squeeze with governance on and off (CUDA only; not run on CPU machines):
`ballast serve` on GPU 0 serves 32 concurrent streams while new ones keep arriving; a second
process takes VRAM in steps until ~200 MiB are free, holds, and leaves. Governance on: the default
config. Governance off: `--ladder-disable` (the ledger's ceiling and the die's admission check
stay: they cannot be blinded from outside the process). The timeline records free VRAM, the level,
the outcomes and whether the server survived (no CUDA OOM) and serves again afterwards.

    python tests/reliability/vram_squeeze.py --model /path/to/hf-dir [--mode both|on|off] [--out vram.json]
        [--serve-arg=--tokenizer --serve-arg=DIR ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import harness  # noqa: F401 - tests/ and tests/integration on sys.path
import httpx
from harness import scrape, total
from serverproc import _read_listen_line, wait_ready

MiB = 1 << 20
HOG = r"""
import sys, time, torch
leave, step, every, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
held = []
while True:
    free, _ = torch.cuda.mem_get_info(0)
    if free - step < leave:
        break
    # a third of what is left above the target each step (at least `step`): a few dozen steps
    take = max(step, (free - leave) // 3)
    held.append(torch.empty(take, dtype=torch.uint8, device="cuda:0"))
    print(free // 2**20, flush=True)
    time.sleep(every)
time.sleep(hold)
"""


def streams(
    url: str, stop: threading.Event, counts: Counter[str], lock: threading.Lock, i: int, max_tokens: int
) -> None:
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": f"Write a long story number {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    while not stop.is_set():
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                text = "".join(r.iter_text())
            kind = (
                "completed"
                if r.status_code == 200 and "[DONE]" in text
                else str(r.status_code)
                if r.status_code != 200
                else "error_event"
            )
        except httpx.HTTPError as exc:
            kind = type(exc).__name__
        with lock:
            counts[kind] += 1


def run_mode(
    model: str,
    governed: bool,
    serve_args: list[str],
    streams_n: int = 32,
    max_tokens: int = 2000,
    hog_s: float = 30,
    hold_s: float = 30,
) -> dict[str, Any]:
    args = [
        "--model",
        model,
        "--device",
        "cuda",
        "--max-num-seqs",
        str(streams_n),
        "--served-model-name",
        "x",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *([] if governed else ["--ladder-disable", "1"]),
        *serve_args,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ballast.server.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    counts: Counter[str] = Counter()
    lock, stop = threading.Lock(), threading.Event()
    timeline: list[dict[str, float]] = []
    hog = None
    try:
        url = _read_listen_line(proc, lines, 600)
        wait_ready(url, 600)
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout or ()], daemon=True).start()
        for i in range(streams_n + 8):  # more than the slots: new ones keep arriving
            threading.Thread(
                target=streams, args=(url, stop, counts, lock, i, max_tokens), daemon=True
            ).start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 + hog_s + hold_s + 30:
            t = time.monotonic() - t0
            if hog is None and t > 10:
                hog = subprocess.Popen(
                    [sys.executable, "-c", HOG, str(200 * MiB), str(256 * MiB), "0.5", str(hold_s)],
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
                    **{f"n_{k}": float(v) for k, v in done.items()},
                }
            )
            if not alive:
                break
            time.sleep(1.0)
        stop.set()
        alive = proc.poll() is None
        served = (
            alive
            and httpx.post(
                url + "/v1/chat/completions",
                json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=120,
            ).status_code
            == 200
        )
        oom = [ln for ln in lines if "CUDA out of memory" in ln or "OutOfMemoryError" in ln]
        # A KV segment the allocator could not deliver is logged and refused like a ledger "no":
        # handled. Any other OOM line, or an outcome other than done / 429 / 503, reached a client.
        handled = [ln for ln in oom if "could not be allocated" in ln]
        client_errors = {k: v for k, v in counts.items() if k not in ("completed", "429", "503")}
        return {
            "governed": governed,
            "outcomes": dict(counts),
            "server_alive": alive,
            "served_after": served,
            "oom_handled_in_log": len(handled),
            "oom_unhandled_in_log": len(oom) - len(handled),
            "client_errors": client_errors,
            "max_level": max((x["level"] for x in timeline), default=-1),
            "timeline": timeline,
        }
    finally:
        stop.set()
        for p in (hog, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description="scenario 4: VRAM squeeze (CUDA)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("both", "on", "off"), default="both")
    ap.add_argument("--out")
    ap.add_argument(
        "--serve-arg", action="append", default=[], help="passed on to ballast serve (repeatable)"
    )
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    results = [
        run_mode(a.model, g, a.serve_arg)
        for g in {"both": (True, False), "on": (True,), "off": (False,)}[a.mode]
    ]
    for r in results:
        print({k: v for k, v in r.items() if k != "timeline"})
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
