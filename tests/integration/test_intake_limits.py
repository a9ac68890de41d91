"""Host memory before admission is bounded (issue 31, items 5 and 6), through a real uvicorn
server: a prompt that cannot fit is refused before anything is copied per choice, bodies being
read at once are bounded (429 + Retry-After), parsing is booked against the host budget (503 +
Retry-After where the host is short), and a stop list is capped with a 400 that names the limit."""

from __future__ import annotations

import asyncio
import json
import socket
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.types import GiB, MiB
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server import protocol as p
from ballast.server.app import create_app
from ballast.server.completions import built
from ballast.server.config import ServerConfig
from ballast.server.errors import ApiError
from ballast.server.state import ServerState
from fake_engine import FakeEngine
from memfixtures import write_tree
from serverproc import running_server

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@contextmanager
def serve(root: Path, server: ServerConfig, available: int = 32 * GiB) -> Iterator[tuple[str, ServerState]]:
    write_tree(root, mem_total=64 * GiB, mem_available=available)
    watch = MemWatch(MemoryConfig(root=str(root), host_reserve_bytes=GiB))
    app = create_app(server, SchedulerConfig(), lambda: FakeEngine(max_model_len=1 << 17), memwatch=watch)
    with running_server(app) as url:
        yield url, app.state.ballast


@pytest.fixture(scope="module")
def calm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerState]]:
    config = ServerConfig(max_body_bytes=2 * MiB, max_parsing_bytes=3 * MiB)
    with serve(tmp_path_factory.mktemp("intake"), config) as served:
        yield served


def test_a_64_choice_request_with_a_huge_prompt_is_refused_before_it_copies(
    calm: tuple[str, ServerState],
) -> None:
    _, state = calm
    req = p.CompletionRequest(model="fake-model", prompt=[7] * 1_000_000, n=64, max_tokens=16)
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as refused:
            asyncio.run(built(state, req))  # its checks, then its prompt in a worker thread
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "context_length_exceeded",
        "prompt",
    )
    assert peak < 3 * 8 * 1_000_000, f"{peak / MiB:.0f} MiB held before the 400"  # one prompt, not 64


def test_one_prompt_is_shared_by_every_choice(calm: tuple[str, ServerState]) -> None:
    _, state = calm
    req = p.CompletionRequest(model="fake-model", prompt=[7] * 100, n=8, max_tokens=4)
    job = asyncio.run(built(state, req))
    assert len(job.gens) == 8 and all(g.prompt_ids is job.gens[0].prompt_ids for g in job.gens)


def test_bodies_read_at_once_are_bounded_with_429_and_retry_after(calm: tuple[str, ServerState]) -> None:
    url, _ = calm
    host, port = url.removeprefix("http://").split(":")
    # 1.6 MB each (a long `user` field, which nothing reads): two of them do not fit 3 MiB at once
    body = json.dumps({**CHAT, "user": "x" * 1_600_000}).encode()
    with socket.create_connection((host, int(port))) as slow:  # declares 1.6 MB, sends half, waits
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:800_000]
        )
        r = httpx.post(
            url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 429 and r.json()["error"]["code"] == "intake_busy", r.text
        assert int(r.headers["retry-after"]) >= 1
        assert httpx.get(url + "/health").status_code == 200  # probes are never the ones refused
    ok = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text  # the slow body gone, the same request is read


def test_a_host_short_of_room_to_parse_answers_503(tmp_path: Path) -> None:
    # 1 GiB reserve, 4 MiB above it: a 1 MiB body's parse (8 MiB of heap) does not fit.
    with serve(tmp_path, ServerConfig(), available=GiB + 4 * MiB) as (url, _):
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * MiB}]}
        r = httpx.post(url + "/v1/chat/completions", json=big)
        assert r.status_code == 503 and "parse" in r.json()["error"]["message"], r.text
        assert "retry-after" in r.headers
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_a_100000_string_stop_list_is_refused_naming_the_limit(calm: tuple[str, ServerState]) -> None:
    url, _ = calm
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stop": [f"s{i}" for i in range(100_000)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stop": [f"s{i}" for i in range(17)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert "at most 16 stop sequences" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stop": ["x" * 257]})
    assert r.status_code == 400 and "256 characters" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/chat/completions", json={**CHAT, "stop": ["a"] * 16}).status_code == 200
