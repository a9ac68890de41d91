"""Scenario 7, bad input, against a real server (built-in tiny Llama on CPU, its real tokenizer):

- schemathesis generates requests from the server's own OpenAPI schema (valid and invalid ones):
  no response is a 5xx;
- a list of malformed inputs each gets its documented 4xx with an OpenAI error body;
- a slowloris client (headers, then a body that never finishes) gets 408 while others are served;
- afterwards the server is sound, idle, and answers as before.

The statuses schemathesis saw are printed (`pytest -s`) for docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from typing import cast

import harness
import httpx
import pytest
import schemathesis
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.memory.config import MemoryConfig
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from ballast.server.state import ServerState
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from serverproc import running_server

pytestmark = pytest.mark.slow

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STATUSES: Counter[int] = Counter()
# Examples per generation mode: small in `make test`; the figures in docs/RELIABILITY.md come from
# RELIABILITY_EXAMPLES=500.
EXAMPLES = int(os.environ.get("RELIABILITY_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, ServerState]]:
    watch = MemWatch(MemoryConfig(poll_interval_s=0.1))
    cfg = EngineConfig(
        model=harness.MODEL, device="cpu", max_num_seqs=4, max_model_len=64, prefill_chunk_tokens=64
    )
    server = ServerConfig(served_model_name="tiny", max_body_bytes=1 << 20, body_timeout_s=1.0)
    app = create_app(server, SchedulerConfig(max_num_seqs=4), lambda: Engine.load(cfg, watch), memwatch=watch)
    with running_server(app) as url:
        yield url, app.state.ballast
    print(f"\nschemathesis: {sum(STATUSES.values())} calls, statuses {dict(sorted(STATUSES.items()))}")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_generated_requests_never_get_a_server_error(
    served: tuple[str, ServerState], mode: GenerationMode
) -> None:
    """Every operation of the server's own /openapi.json, with data schemathesis generates from it
    (conforming to the schema, or violating it): never a 5xx, the server stays sound."""
    url, state = served
    api = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
    }
    strategy = st.one_of([op.as_strategy(generation_mode=mode) for op in operations])
    if mode is GenerationMode.POSITIVE:  # name the served model, or nearly every case is a 404
        strategy = strategy.map(our_model)

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def call(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, timeout=60)
        STATUSES[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])

    call()
    assert state.sound()


def our_model(case: schemathesis.Case) -> schemathesis.Case:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"
    return case


def openai_error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "Traceback" not in r.text
    return cast(dict[str, object], err)


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("name", "kw", "status", "code"),
    [
        (
            "invalid JSON",
            {"content": b'{"model": "tiny", "messages": [', "headers": JSON},
            400,
            "invalid_json",
        ),
        ("empty body", {"content": b"", "headers": JSON}, 400, None),
        ("wrong types", {"json": {**CHAT, "messages": "hi", "max_tokens": "four"}}, 400, None),
        ("a JSON array", {"json": [CHAT]}, 400, None),
        ("huge max_tokens", {"json": {**CHAT, "max_tokens": 10**30}}, 400, "context_length_exceeded"),
        (
            "over-long prompt",
            {"json": {**CHAT, "messages": [{"role": "user", "content": "word " * 2000}]}},
            400,
            "context_length_exceeded",
        ),
        (
            "invalid UTF-8",
            {
                "content": b'{"model":"tiny","messages":[{"role":"user","content":"\xff\xfe\xfd"}]}',
                "headers": JSON,
            },
            400,
            None,
        ),
        ("10 MB of whitespace", {"content": b" " * (10 << 20), "headers": JSON}, 413, "request_too_large"),
        (
            "deeply nested JSON",
            {
                "content": b'{"model":"tiny","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                "headers": JSON,
            },
            400,
            None,
        ),
        (
            "NaN temperature",
            {
                "content": b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
                "headers": JSON,
            },
            400,
            None,
        ),
        ("a seed past 64 bits", {"json": {**CHAT, "seed": 2**80}}, 400, None),
        (
            "a token id past the vocabulary",
            {"json": {"model": "tiny", "prompt": [2**70], "max_tokens": 2}, "path": "/v1/completions"},
            400,
            None,
        ),
        ("unknown model", {"json": {**CHAT, "model": "gpt-5"}}, 404, "model_not_found"),
    ],
)
def test_malformed_inputs_get_their_documented_4xx(
    served: tuple[str, ServerState], name: str, kw: dict, status: int, code: str | None
) -> None:
    url, state = served
    path = kw.pop("path", "/v1/chat/completions")
    err = openai_error(httpx.post(url + path, timeout=60, **kw), status)
    if code is not None:
        assert err["code"] == code
    assert state.sound()


def test_lone_surrogates_are_400_and_nul_bytes_are_served(served: tuple[str, ServerState]) -> None:
    url, state = served

    def chat(content: bytes) -> httpx.Response:
        body = b'{"model":"tiny","max_tokens":3,"messages":[{"role":"user","content":' + content + b"}]}"
        return httpx.post(url + "/v1/chat/completions", content=body, headers=JSON, timeout=60)

    # Valid JSON, but no tokenizer can encode a lone surrogate: it used to be a 500.
    assert openai_error(chat(b'"\\ud800 x \\udfff"'), 400)["code"] == "invalid_text"
    assert chat(b'"a\\u0000b"').status_code == 200
    assert state.sound()


def test_slowloris_gets_408_and_others_are_served(served: tuple[str, ServerState]) -> None:
    url, state = served
    host, port = url.removeprefix("http://").split(":")
    slow = []
    for _ in range(20):  # headers promise a body; a few bytes come, then nothing
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 500\r\n\r\n{"model": '
        )
        slow.append(sock)
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)  # served meanwhile
    assert r.status_code == 200 and time.monotonic() - t0 < 30
    answers = []
    for sock in slow:
        sock.settimeout(30)
        answers.append(sock.recv(4096).decode(errors="replace"))
        sock.close()
    assert all(a.startswith("HTTP/1.1 408") and '"request_timeout"' in a for a in answers), answers[0][:300]
    assert state.sound()


def test_after_all_that_the_server_is_sound_idle_and_answers(served: tuple[str, ServerState]) -> None:
    url, state = served
    assert httpx.get(url + "/health").json()["status"] == "ok"
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    s = state.scheduler
    assert s is not None
    for _ in range(200):
        if s.idle:
            break
        time.sleep(0.05)
    assert s.idle and s.healthy
