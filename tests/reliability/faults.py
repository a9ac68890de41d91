"""Scenario 5, faults: failures injected into a real server (built-in tiny Llama on CPU, real
MemWatch, real uvicorn on 127.0.0.1, the official `openai` client), one after another:

- a Python exception inside an engine step: the requests in that step get a 503 + Retry-After
  ("engine_step_failed"), every other request completes, /health stays 200 and says how many
  steps failed, the KV blocks come back;
- a host `MemoryError` and a `torch.cuda.OutOfMemoryError` during a prefill: the newcomer's
  prompt is retried with half its chunk and the decodes beside it run again, so every request
  completes; /health counts the failed steps;
- a tokenizer error: that request gets an OpenAI error body (500), the server serves on;
- a slow consumer (a stream nobody reads): its slot is freed when its generation ends, others
  are served meanwhile;
- MemWatch polls failing: the snapshot goes stale, new requests get 503 at once (not a wait to
  the deadline), /ready says why, /health stays 200; serving resumes with the next good poll;
- last, a CUDA error that poisons the context: 500, /health 503 (the process would exit).

    python tests/reliability/faults.py [--out faults.json]
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import harness  # noqa: F401 - puts tests/ and tests/integration on sys.path
import httpx
import openai
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Level
from ballast.memory.watch import MemWatch
from ballast.models.base import Rows
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from ballast.server.state import ServerState
from serverproc import running_server

MSG = [{"role": "user", "content": "Say something about rivers."}]


class FaultInjector:
    """Wraps the runner's forward on the engine thread: the next forward whose batch matches
    raises the queued exception."""

    def __init__(self, engine: Engine) -> None:
        self._forward = engine.runner.forward
        self._lock = threading.Lock()
        self._queued: list[tuple[Callable[[Rows], bool], BaseException]] = []
        engine.runner.forward = self._run  # type: ignore[method-assign]

    def next(self, exc: BaseException, when: Callable[[Rows], bool] = lambda seqs: True) -> None:
        with self._lock:
            self._queued.append((when, exc))

    def _run(self, seqs: Rows, all_logits: Sequence[bool] = ()) -> torch.Tensor:
        with self._lock:
            hit = next(((w, e) for w, e in self._queued if w(seqs)), None)
            if hit is not None:
                self._queued.remove(hit)
        if hit is not None:
            raise hit[1]
        return self._forward(seqs, all_logits)


def prefilling(seqs: Rows) -> bool:
    return any(len(tokens) > 1 for _, tokens, _ in seqs)


@contextmanager
def real_server(
    stale_s: float = 1.0, root: str = "/"
) -> Iterator[tuple[str, ServerState, MemWatch, list[str]]]:
    """root: where the memory layer reads proc/ (a test's tree pins the host's level)."""
    watch = MemWatch(MemoryConfig(poll_interval_s=0.1, root=root))
    fatal: list[str] = []
    cfg = EngineConfig(
        model=harness.MODEL, device="cpu", max_num_seqs=4, max_model_len=256, prefill_chunk_tokens=64
    )
    app = create_app(
        ServerConfig(served_model_name="tiny"),
        SchedulerConfig(max_num_seqs=4, stale_snapshot_s=stale_s),
        lambda: Engine.load(cfg, watch),
        memwatch=watch,
        on_fatal=fatal.append,
    )
    with running_server(app) as url:
        yield url, app.state.ballast, watch, fatal


def chat(client: openai.OpenAI, max_tokens: int = 24, stream: bool = False) -> tuple[str, int | None, float]:
    """(outcome, status, seconds): outcome "ok" or the error code."""
    t0 = time.monotonic()
    try:
        if stream:
            for _ in client.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=max_tokens, stream=True
            ):  # type: ignore[arg-type]
                pass
        else:
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=max_tokens)  # type: ignore[arg-type]
        return "ok", 200, time.monotonic() - t0
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return str(body.get("code") or exc.status_code), exc.status_code, time.monotonic() - t0
    except openai.APIError as exc:  # an error event inside a stream
        return str(getattr(exc, "code", None) or type(exc).__name__), None, time.monotonic() - t0


def used_blocks(engine: Engine) -> int:
    kv = engine.kv_figures()
    return 0 if kv is None else kv.used_blocks - kv.evictable_blocks


def wait_idle(state: ServerState, engine: Engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    s = state.scheduler
    assert s is not None
    while not (s.idle and used_blocks(engine) == 0):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not idle: queue {s.queue_depth}, slots {s.active_slots}, blocks {used_blocks(engine)}"
            )
        time.sleep(0.05)


def step_fault(url: str, state: ServerState, inject: FaultInjector, exc: BaseException) -> dict[str, Any]:
    """4 requests start decoding; a 5th arrives and its prefill step fails; 3 more queue behind."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    results: dict[int, tuple[str, int | None, float]] = {}

    def go(i: int, delay: float) -> None:
        time.sleep(delay)
        results[i] = chat(client, max_tokens=40 if i < 4 else 16, stream=i % 2 == 0)

    threads = [threading.Thread(target=go, args=(i, 0.0)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the first three are decoding
    inject.next(exc, prefilling)
    later = [threading.Thread(target=go, args=(i, 0.05 * (i - 3))) for i in range(3, 8)]
    for t in later:
        t.start()
    for t in threads + later:
        t.join(120)
    engine = cast(Engine, state.engine)
    wait_idle(state, engine)
    health = httpx.get(url + "/health").json()
    outcomes = [results[i][0] for i in sorted(results)]
    return {
        "fault": type(exc).__name__,
        "outcomes": outcomes,
        "failed_in_step": outcomes.count("engine_step_failed"),
        "completed": outcomes.count("ok"),
        "other": len(outcomes) - outcomes.count("ok") - outcomes.count("engine_step_failed"),
        "health": health["status"],
        "step_failures": health.get("step_failures", 0),
        "blocks_after": used_blocks(engine),
    }


def tokenizer_fault(url: str, state: ServerState) -> dict[str, Any]:
    engine = cast(Engine, state.engine)
    tok = engine.tokenizer
    real = tok.apply_chat_template

    def broken(messages: Any, *args: Any, **kwargs: Any) -> list[int]:
        if any("\u2603" in m["content"] for m in messages):
            raise RuntimeError("tokenizer failed on this input")
        return real(messages, *args, **kwargs)

    tok.apply_chat_template = broken  # type: ignore[method-assign]
    try:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "\u2603"}], "max_tokens": 4},
        )
        ok = chat(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0))
    finally:
        tok.apply_chat_template = real  # type: ignore[method-assign]
    err = r.json().get("error", {})
    return {
        "status": r.status_code,
        "error_type": err.get("type"),
        "has_openai_body": set(err) == {"message", "type", "param", "code"},
        "traceback_leaked": "Traceback" in r.text,
        "next_request": ok[0],
        "health": httpx.get(url + "/health").json()["status"],
    }


def slow_consumer(url: str, state: ServerState) -> dict[str, Any]:
    """A raw client asks for a stream and never reads a byte; meanwhile others are served."""
    host, port = url.removeprefix("http://").split(":")
    body = (
        b'{"model":"tiny","messages":[{"role":"user","content":"Tell a long story."}],'
        b'"max_tokens":200,"stream":true}'
    )
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    t0 = time.monotonic()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    others = [chat(client, max_tokens=16)[0] for _ in range(3)]
    engine = cast(Engine, state.engine)
    wait_idle(state, engine, timeout_s=60)  # its generation ended: slot and blocks are back
    freed_s = time.monotonic() - t0
    sock.close()
    return {"others": others, "slot_freed_after_s": round(freed_s, 2), "blocks_after": used_blocks(engine)}


def stale_memwatch(url: str, state: ServerState, watch: MemWatch, stale_s: float) -> dict[str, Any]:
    reader = watch._host_reader  # the poll's first read; failing it makes every poll fail
    real = reader.read

    def failing() -> Any:
        raise OSError("injected: /proc/meminfo unreadable")

    reader.read = failing  # type: ignore[method-assign]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        time.sleep(stale_s + 0.5)
        refused = chat(client)
        ready = httpx.get(url + "/ready")
        health = httpx.get(url + "/health").status_code
    finally:
        reader.read = real  # type: ignore[method-assign]
    time.sleep(0.5)  # the next good poll
    after = chat(client)
    return {
        "polls_failed": watch.poll_failures,
        "refused": refused[0],
        "status": refused[1],
        "refusal_s": round(refused[2], 3),
        "ready_status": ready.status_code,
        "ready_reason": ready.json().get("reason"),
        "health_status": health,
        "after_recovery": after[0],
    }


def device_fault(url: str, state: ServerState, inject: FaultInjector, fatal: list[str]) -> dict[str, Any]:
    inject.next(RuntimeError("CUDA error: an illegal memory access was encountered"))
    outcome = chat(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0))
    return {
        "outcome": outcome[0],
        "status": outcome[1],
        "health_status": httpx.get(url + "/health").status_code,
        "on_fatal_called": bool(fatal),
    }


def run(stale_s: float = 1.0, root: str = "/") -> dict[str, Any]:
    """The scenarios on one server. root: see `real_server` (the script reads this host's /proc;
    the test a tree at OK, so that a memory fault's rung starts from OK on a busy shared box)."""
    figures: dict[str, Any] = {}
    with real_server(stale_s, root) as (url, state, watch, fatal):
        engine = cast(Engine, state.engine)
        inject = FaultInjector(engine)
        figures["python_exception"] = step_fault(url, state, inject, ValueError("injected bug in a step"))
        figures["memory_error_in_prefill"] = step_fault(url, state, inject, MemoryError("injected host OOM"))
        # A memory failure raises the level for a while (it calms a rung per retry-after): the
        # next fault starts from a calm server, as the first two did.
        calm_by = time.monotonic() + 30
        while state.scheduler is not None and state.scheduler.fault_level is not Level.OK:
            assert time.monotonic() < calm_by, "the level raised by the memory failure never calmed"
            time.sleep(0.1)
        figures["cuda_oom_in_prefill"] = step_fault(
            url, state, inject, torch.cuda.OutOfMemoryError("injected CUDA out of memory")
        )
        figures["tokenizer_error"] = tokenizer_fault(url, state)
        figures["slow_consumer"] = slow_consumer(url, state)
        figures["stale_memwatch"] = stale_memwatch(url, state, watch, stale_s)
        figures["device_fault"] = device_fault(url, state, inject, fatal)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description="scenario 5: faults")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    figures = run()
    harness.report("faults", {k: str(v) for k, v in figures.items()}, None)
    if a.out:
        import json
        from pathlib import Path

        Path(a.out).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
