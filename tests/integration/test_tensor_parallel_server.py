"""Tensor parallel through the real server on the CPU (gloo): a real uvicorn and the official
openai client. Two ranks serve the greedy text one device serves; a worker killed mid-stream fails
the in-flight request with an error at once (no hang), turns /health red, and a new request gets
a 5xx at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from memfixtures import level_tree
from serverproc import running_server

MODEL = "builtin:tiny-qwen3-next"
PROMPTS = [[1, 400, 5000, 17, 23], [9, 8, 7], list(range(100, 160))]


@contextmanager
def serve(tmp_path: Path, tp: int, fatal: list[str]) -> Iterator[tuple[str, Callable[[], Engine]]]:
    level_tree(tmp_path, Level.OK)
    watch = MemWatch(MemoryConfig(root=str(tmp_path)))
    engines: list[Engine] = []

    def factory() -> Engine:
        cfg = EngineConfig(
            model=MODEL, device="cpu", max_model_len=256, max_num_seqs=4, tensor_parallel_size=tp
        )
        engines.append(Engine.load(cfg, watch))
        return engines[-1]

    app = create_app(ServerConfig(), SchedulerConfig(), factory, memwatch=watch, on_fatal=fatal.append)
    with running_server(app, timeout_s=180) as url:
        yield url, lambda: engines[0]


def greedy(url: str, max_tokens: int = 12) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out: list[str] = [""] * len(PROMPTS)

    def one(i: int) -> None:  # concurrent: the prompts share steps (batched decode of several slots)
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0)
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_two_ranks_serve_the_greedy_text_of_one(tmp_path: Path) -> None:
    fatal: list[str] = []
    with serve(tmp_path / "one", 1, fatal) as (url, _):
        want = greedy(url)
    with serve(tmp_path / "two", 2, fatal) as (url, engine):
        assert engine().runner.workers.pids  # type: ignore[attr-defined]
        got = greedy(url)
        assert httpx.get(url + "/health").status_code == 200
    assert all(want) and got == want
    assert not fatal


def test_a_killed_worker_fails_the_stream_and_health_at_once(tmp_path: Path) -> None:
    fatal: list[str] = []
    with serve(tmp_path, 2, fatal) as (url, engine):
        [pid] = engine().runner.workers.pids  # type: ignore[attr-defined]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True
        )
        chunks = iter(stream)
        next(chunks)  # the request is in flight
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in chunks:
                pass
        assert time.monotonic() - t0 < 30
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "ballast-tp1" in health.json()["reason"]
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code >= 500 and time.monotonic() - t0 < 10
        assert fatal


def test_a_worker_that_dies_while_idle_turns_health_red(tmp_path: Path) -> None:
    fatal: list[str] = []
    with serve(tmp_path, 2, fatal) as (url, engine):
        assert httpx.get(url + "/health").status_code == 200
        [pid] = engine().runner.workers.pids  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health stayed green with a dead worker"
            time.sleep(0.05)
        assert httpx.get(url + "/ready").status_code == 503
