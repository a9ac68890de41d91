"""Scenario 3, host squeeze with governance on and off: `ballast serve` (the default model on
CPU) runs in a child memory cgroup of its own, with a limit a few GiB above its working set, under
steady load (long prompts, so the KV pool grows); a memory hog in the same cgroup then grows until
little is left, holds, and leaves. Run once with the default config (governance on) and once with
`--ladder-disable` and admission blinded (BALLAST_MEMORY_ROOT pointed at a tree that shows an
unconstrained host, so every admission says yes): the timeline shows what governance prevented
(OOM kills of the server, stalls) and whether ballast serves again after the hog leaves.

The hog asks for oom_score_adj -1000 so that, when the cgroup runs out, the kernel would kill the
process that overran rather than the tenant beside it; where the write is ignored (this box's VM
reads back 0) the OOM killer takes the largest process, the hog. Either way an OOM kill in the
cgroup is the failure governance exists to prevent.

Needs permission to create a memory cgroup (root on cgroup v1, or a delegated v2 subtree); it says
why and exits 0 otherwise ("skipped").

    python tests/reliability/squeeze.py [--mode both|on|off] [--out squeeze.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import harness  # noqa: F401 - tests/ and tests/integration on sys.path
import httpx
from harness import scrape, total
from memfixtures import write_tree
from serverproc import _read_listen_line, wait_ready

GiB = 1 << 30
MiB = 1 << 20
HOG = r"""
import os, sys, time
open("/proc/self/oom_score_adj", "w").write("-1000")
step, every, target, hold = (float(x) for x in sys.argv[1:5])
chunks = []
held = 0
while held < target:
    n = int(min(step, target - held))
    b = bytearray(n)
    b[::4096] = b"\x01" * len(range(0, n, 4096))  # touch every page: resident, not just reserved
    chunks.append(b)
    held += n
    print(held, flush=True)
    time.sleep(every)
time.sleep(hold)
print("leaving", flush=True)
"""


def own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    raise OSError("no memory cgroup for this process")


class Cgroup:
    def __init__(self, limit: int) -> None:
        parent = own_memory_cgroup()
        self.v1 = (parent / "memory.limit_in_bytes").exists()
        self.path = parent / f"ballast-squeeze-{os.getpid()}-{time.monotonic_ns()}"
        self.path.mkdir()
        self.limit(limit)

    def limit(self, n: int) -> None:
        (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(n))

    def usage(self) -> int:
        used = int((self.path / ("memory.usage_in_bytes" if self.v1 else "memory.current")).read_text())
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        return used - int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))

    def oom_kills(self) -> int:
        f = self.path / ("memory.oom_control" if self.v1 else "memory.events")
        fields = dict(line.split() for line in f.read_text().splitlines())
        return int(fields.get("oom_kill", 0))

    def enter(self) -> None:  # runs in a child before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def load(url: str, stop: threading.Event, counts: Counter[str], lock: threading.Lock, seed: int) -> None:
    n = 0
    while not stop.is_set():
        # ~600 tokens, new every time: the prefix cache keeps each one, so the KV pool grows
        n += 1
        words = " ".join(f"w{seed}x{n}x{i}" for i in range(120))
        body = {
            "model": "x",
            "messages": [{"role": "user", "content": words}],
            "max_tokens": 48,
            "temperature": 0,
        }
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            kind = "completed" if r.status_code == 200 else str(r.status_code)
        except httpx.HTTPError as exc:
            kind = (
                "connection_error"
                if "Connect" in type(exc).__name__ or "Protocol" in type(exc).__name__
                else type(exc).__name__
            )
            time.sleep(0.5)
        with lock:
            counts[kind] += 1
        if kind != "completed":
            time.sleep(0.2)


def run_mode(
    governed: bool, hog_s: float = 40.0, hold_s: float = 20.0, after_s: float = 20.0, clients: int = 4
) -> dict[str, Any]:
    cg = Cgroup(16 * GiB)
    fake_root = tempfile.mkdtemp(prefix="ballast-squeeze-root-")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [
        "--model",
        "default",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "2048",
        "--served-model-name",
        "x",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    if not governed:
        write_tree(
            Path(fake_root), mem_total=256 * GiB, mem_available=240 * GiB
        )  # admission sees plenty, always
        env["BALLAST_MEMORY_ROOT"] = fake_root
        args += ["--ladder-disable", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ballast.server.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=cg.enter,
    )
    lines: list[str] = []
    timeline: list[dict[str, float]] = []
    counts: Counter[str] = Counter()
    lock, stop = threading.Lock(), threading.Event()
    hog: subprocess.Popen[str] | None = None
    try:
        url = _read_listen_line(proc, lines, 300)
        wait_ready(url, 300)
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout or ()], daemon=True).start()
        httpx.post(
            url + "/v1/chat/completions",
            json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=120,
        )
        working_set = cg.usage()
        limit = working_set + 3 * GiB  # the default host reserve is 1 GiB: room for it and for the KV to grow
        cg.limit(limit)
        workers = [
            threading.Thread(target=load, args=(url, stop, counts, lock, i), daemon=True)
            for i in range(clients)
        ]
        for w in workers:
            w.start()
        t0 = time.monotonic()
        hog_bytes = [0]
        hog_target = limit - working_set - 192 * MiB  # leaves the server its working set and a sliver
        phase = "load"
        while True:
            t = time.monotonic() - t0
            if hog is None and t >= 10:
                step = 64 * MiB
                hog = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        HOG,
                        str(step),
                        str(hog_s * step / hog_target),
                        str(hog_target),
                        str(hold_s),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    preexec_fn=cg.enter,
                )
                threading.Thread(
                    target=lambda h=hog: [
                        hog_bytes.__setitem__(0, int(x))
                        if x.strip().isdigit()
                        else hog_bytes.__setitem__(0, 0)
                        for x in h.stdout or ()
                    ],
                    daemon=True,
                ).start()
                phase = "hog grows"
            if hog is not None and hog.poll() is not None and phase != "hog gone":
                phase, gone_at = "hog gone", t
                hog_bytes[0] = 0
            alive = proc.poll() is None
            level = -1.0
            kv = 0.0
            if alive:
                try:
                    m = scrape(url)
                    level, kv = total(m, "ballast_memory_pressure_level"), total(m, "ballast_kv_pool_bytes")
                except httpx.HTTPError:
                    level = -2.0  # no answer to a scrape within 10 s: a stall
            with lock:
                done = dict(counts)
            timeline.append(
                {
                    "t_s": round(t, 2),
                    "usage_mib": cg.usage() / MiB,
                    "hog_mib": hog_bytes[0] / MiB,
                    "server_alive": float(alive),
                    "level": level,
                    "kv_pool_mib": kv / MiB,
                    **{f"n_{k}": float(v) for k, v in done.items()},
                }
            )
            if (
                phase == "hog gone"
                and t - gone_at >= after_s
                or (not alive and t > 10 and phase != "load" and hog is not None and hog.poll() is not None)
            ):
                break
            if t > 10 + hog_s + hold_s + after_s + 60:
                break
            time.sleep(0.5)
        stop.set()
        alive = proc.poll() is None
        served_after = False
        if alive:
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=120,
            )
            served_after = r.status_code == 200
        return {
            "governed": governed,
            "working_set_mib": working_set / MiB,
            "limit_mib": limit / MiB,
            "hog_target_mib": hog_target / MiB,
            "oom_kills": cg.oom_kills(),
            "server_alive_at_end": alive,
            "server_exit_code": proc.poll(),
            "served_after_hog_left": served_after,
            "outcomes": dict(counts),
            "max_level": max((x["level"] for x in timeline), default=-1),
            "stalled_scrapes": sum(x["level"] == -2.0 for x in timeline),
            "timeline": timeline,
            "log_tail": [ln.rstrip() for ln in lines[-5:]],
        }
    finally:
        stop.set()
        for p in (hog, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        cg.remove()


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 3.6 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        tl = r["timeline"]
        t = [x["t_s"] for x in tl]
        ax.plot(t, [x["usage_mib"] for x in tl], label="cgroup usage")
        ax.plot(t, [x["hog_mib"] for x in tl], label="hog")
        ax.plot(t, [x["kv_pool_mib"] for x in tl], label="ballast KV pool")
        ax.axhline(r["limit_mib"], color="k", linestyle="--", linewidth=0.8, label="cgroup limit")
        ax.set_ylabel("MiB")
        lv = ax.twinx()
        lv.step(
            t,
            [x["level"] for x in tl],
            where="post",
            color="tab:red",
            alpha=0.6,
            label="level (0 OK .. 3 CRITICAL)",
        )
        lv.set_ylim(-0.2, 3.5)
        lv.set_yticks([0, 1, 2, 3])
        title = (
            "governance on (default config)"
            if r["governed"]
            else "governance off (--ladder-disable, admission blinded)"
        )
        ax.set_title(f"{title}: OOM kills {r['oom_kills']}, outcomes {r['outcomes']}", fontsize=9)
        ax.legend(loc="upper left", fontsize=7)
        lv.legend(loc="upper right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds (hog starts at 10 s)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description="scenario 3: host squeeze, governance on and off")
    ap.add_argument("--mode", choices=("both", "on", "off"), default="both")
    ap.add_argument("--out")
    ap.add_argument("--plot", help="write a timeline PNG here")
    ap.add_argument("--from-json", help="only plot the results of an earlier --out")
    a = ap.parse_args()
    if a.from_json:
        plot(json.loads(Path(a.from_json).read_text()), a.plot)
        return
    try:
        Cgroup(16 * GiB).remove()
    except OSError as e:
        print(
            f"skipped: cannot make a child memory cgroup here ({e}); needs root on cgroup v1 or a delegated "
            "v2 subtree"
        )
        return
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[a.mode]
    results = [run_mode(g) for g in modes]
    for r in results:
        print({k: v for k, v in r.items() if k != "timeline"})
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
