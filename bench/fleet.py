"""Replicas of `ballast serve` behind a real gateway (`smg`, SGLang's Shepherd Model Gateway), all
on this machine, for the gateway tests and benchmarks.

    with Fleet.start(3, ["--model", "default"]) as fleet:          # three replicas, in parallel
        with fleet.gateway("cache_aware") as url:                  # smg in front of them
            ...

Every process is a child of this one, listens on 127.0.0.1 only, and is stopped on exit. The
gateway probes each replica's /ready (so a replica at CRITICAL leaves the rotation within one probe
interval) and polls its /metrics for load (`vllm:kv_cache_usage_perc` and the request gauges).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx

_LISTEN = re.compile(r"listening on (http://\S+)")

# The gateway's poll periods, seconds (its minimum is 1): its /ready probe and its load poll.
PROBE_INTERVAL_S = 1


class FleetError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smg_binary() -> str:
    """The `smg` launcher installed beside this Python (the test extra installs it)."""
    here = os.path.join(os.path.dirname(sys.executable), "smg")
    found = here if os.path.exists(here) else shutil.which("smg")
    if found is None:
        raise FleetError("smg is not installed (pip install smg; it is in the project's test extra)")
    return found


@dataclass
class Replica:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    url: str = ""

    def metric(self, name: str) -> float:
        """The sum of every sample of `name` on the replica's /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        """SIGKILL: the replica dies mid-request, as a crashed or OOM-killed process does."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def _drain(replica: Replica) -> None:
    assert replica.proc.stdout is not None
    for line in replica.proc.stdout:
        replica.lines.append(line)
        if not replica.url and (m := _LISTEN.search(line)):
            replica.url = m.group(1)


def wait_until(check: object, timeout_s: float, what: str, every_s: float = 0.05) -> float:
    """Poll `check()` until it is true; the seconds it took. Raises FleetError after timeout_s."""
    assert callable(check)
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        if time.monotonic() - start > timeout_s:
            raise FleetError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)


@dataclass
class Fleet:
    replicas: list[Replica]
    stack: ExitStack

    @classmethod
    @contextmanager
    def start(
        cls, n: int, args: Sequence[str], per_replica: Sequence[Sequence[str]] = (), timeout_s: float = 240.0
    ) -> Iterator[Fleet]:
        """Start n replicas at once (they load in parallel) and wait until every one is ready.
        `per_replica[i]` adds arguments to replica i (its memory root, say)."""
        with ExitStack() as stack:
            fleet = cls([], stack)
            for i in range(n):
                extra = list(per_replica[i]) if i < len(per_replica) else []
                cmd = [sys.executable, "-m", "ballast.server.cli", "serve", "--host", "127.0.0.1"]
                cmd += ["--port", "0", *args, *extra]
                env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
                )
                replica = Replica(proc)
                stack.callback(_stop, proc)
                threading.Thread(target=_drain, args=(replica,), daemon=True).start()
                fleet.replicas.append(replica)
            for r in fleet.replicas:
                try:
                    wait_until(lambda r=r: r.url and _ready(r.url), timeout_s, "replica ready", every_s=0.1)
                except FleetError as exc:
                    raise FleetError(f"{exc}; its output:\n{''.join(r.lines[-40:])}") from None
            yield fleet

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @contextmanager
    def gateway(self, policy: str, extra: Sequence[str] = (), timeout_s: float = 60.0) -> Iterator[str]:
        """`smg launch` in front of every replica; yields its base URL once it routes to all."""
        port = free_port()
        cmd = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", *self.urls, "--policy", policy]
        cmd += ["--health-check-endpoint", "/ready", "--health-check-interval-secs", str(PROBE_INTERVAL_S)]
        cmd += ["--health-failure-threshold", "1", "--health-success-threshold", "1"]
        cmd += ["--load-monitor-interval", str(PROBE_INTERVAL_S), "--prometheus-port", str(free_port())]
        # smg stops routing to a replica whose in-flight pile is four deep with no token for 3 s: on
        # CPU replicas of a shared machine a token can take longer than that while the replica is
        # healthy, and a chat's next turn would be routed away from its prefix.
        cmd += ["--worker-wedge-secs", "600"]
        cmd += ["--log-level", "warn", *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_until(
                    lambda: self.routable(url) == set(self.urls), timeout_s, "smg routes to every replica"
                )
            except FleetError as exc:
                raise FleetError(f"{exc}; smg said:\n{''.join(lines[-40:])}") from None
            yield url
        finally:
            _stop(proc)

    @staticmethod
    def routable(gateway_url: str) -> set[str]:
        """The replicas the gateway would route to now (healthy and ready in its registry)."""
        workers = httpx.get(gateway_url + "/workers", timeout=5).json()["workers"]
        return {w["url"] for w in workers if w.get("is_healthy") and w.get("status") == "ready"}


def _ready(url: str) -> bool:
    return httpx.get(url + "/ready", timeout=2).status_code == 200


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
