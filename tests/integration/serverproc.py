"""Start a real uvicorn server on a free localhost port, and tear it down.

    from serverproc import running_server
    with running_server(app) as base_url:          # in a thread of this process
        ...
    with serve_subprocess(["--model", "builtin:tiny-llama"]) as (base_url, proc):   # `ballast serve`
        ...

The thread form binds the socket itself (port 0, so parallel tests never collide) and waits until
uvicorn has started and, by default, until /ready answers 200 (the engine has loaded).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI

LISTEN_RE = re.compile(r"listening on (http://\S+)")


class ServerDidNotStart(RuntimeError):
    pass


def wait_ready(base_url: str, timeout_s: float, path: str = "/ready") -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(base_url + path, timeout=2.0)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.05)
    raise ServerDidNotStart(f"{base_url}{path} not 200 after {timeout_s} s: {last}")


@contextmanager
def running_server(app: FastAPI, *, wait_for_ready: bool = True, timeout_s: float = 60.0) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive():
                raise ServerDidNotStart("uvicorn exited during start-up (see the log above)")
            if time.monotonic() > deadline:
                raise ServerDidNotStart(f"uvicorn did not start within {timeout_s} s")
            time.sleep(0.01)
        if wait_for_ready:
            wait_ready(base_url, timeout_s)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if thread.is_alive():
            raise RuntimeError(f"uvicorn on port {port} did not stop within 30 s")


@contextmanager
def serve_subprocess(
    args: list[str],
    env: Mapping[str, str] | None = None,
    *,
    timeout_s: float = 120.0,
    wait_for_ready: bool = True,
    output: list[str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Run `ballast serve --port 0 ARGS` in a child process; yields (base_url, process). `output`,
    if given, receives every line the child prints (stdout and stderr), complete once it exits."""
    cmd = [sys.executable, "-m", "ballast.server.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    lines: list[str] = output if output is not None else []
    drain: threading.Thread | None = None
    try:
        base_url = _read_listen_line(proc, lines, timeout_s)
        if wait_for_ready:
            wait_ready(base_url, timeout_s)
        # Keep draining output so the child never blocks on a full pipe.
        drain = threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout or ()], daemon=True)
        drain.start()
        yield base_url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if drain is not None:
            drain.join(timeout=10)


def _read_listen_line(proc: subprocess.Popen[str], lines: list[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    result: list[str] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = LISTEN_RE.search(line)
            if m:
                result.append(m.group(1))
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout_s)
    if not result:
        raise ServerDidNotStart("`ballast serve` printed no 'listening on' line:\n" + "".join(lines))
    return result[0]
