"""Every error a client can meet comes as OpenAI error JSON with the right status, through a real
uvicorn server: bad input (400, never 422 or a traceback), unknown model (404), body too large
(413), queue full (429), memory pressure (503 + Retry-After, /ready down), bad key (401), engine
failure (500, /health down); plus client disconnects freeing their slot and the CAP header."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.types import CostModel, Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from ballast.server.state import ServerState
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens
from memfixtures import level_tree
from serverproc import running_server

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "temperature": 0,
}


@contextmanager
def serve(
    root: Path,
    level: Level = Level.OK,
    *,
    server: ServerConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    engine: FakeEngine | None = None,
    wait_for_ready: bool = True,
) -> Iterator[tuple[str, ServerState, FakeEngine]]:
    level_tree(root, level)
    watch = MemWatch(MemoryConfig(root=str(root), poll_interval_s=0.05))
    fake = engine or FakeEngine()
    app = create_app(server or ServerConfig(), scheduler or SchedulerConfig(), lambda: fake, memwatch=watch)
    with running_server(app, wait_for_ready=wait_for_ready) as url:
        yield url, app.state.ballast, fake


def assert_openai_error(
    r: httpx.Response,
    status: int,
    *,
    type: str | None = None,
    code: str | None = None,
    param: str | None = None,
) -> dict[str, object]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if type is not None:
        assert err["type"] == type
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


@pytest.fixture(scope="module")
def calm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(
        tmp_path_factory.mktemp("calm"),
        server=ServerConfig(max_body_bytes=4096),
        engine=FakeEngine(max_model_len=64),
    ) as (url, _, _):
        yield url


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages[0].content",
        ),
        ({"logit_bias": {"-3": 5}}, "logit_bias"),
        ({"logit_bias": {"one": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias.1"),
        ({"stop": 5}, None),
        ({"stream_options": {"include_usage": True}}, None),
    ],
)
def test_bad_parameters_are_400_openai_json(calm: str, change: dict[str, object], param: str | None) -> None:
    err = assert_openai_error(
        httpx.post(calm + "/v1/chat/completions", json={**CHAT, **change}), 400, type="invalid_request_error"
    )
    if param is not None:
        assert err["param"] == param


def test_missing_field_and_broken_json_are_400(calm: str) -> None:
    assert_openai_error(
        httpx.post(calm + "/v1/completions", json={"model": "fake-model"}), 400, param="prompt"
    )
    r = httpx.post(
        calm + "/v1/chat/completions",
        content=b'{"model": "fake-model", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 400, code="invalid_json")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [3, -1]}, "prompt"),
        ({"prompt": ["one", ""]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_completion_prompts_are_400(calm: str, body: dict[str, object], param: str) -> None:
    r = httpx.post(calm + "/v1/completions", json={"model": "fake-model", "max_tokens": 2, **body})
    assert_openai_error(r, 400, param=param)


def test_context_length_exceeded(calm: str) -> None:
    r = httpx.post(
        calm + "/v1/completions", json={"model": "fake-model", "prompt": "abcdefghij" * 5, "max_tokens": 30}
    )
    err = assert_openai_error(r, 400, code="context_length_exceeded", param="prompt")
    assert "64" in str(err["message"])


def test_unset_max_tokens_fills_the_configured_window(tmp_path: Path) -> None:
    sched = SchedulerConfig(context_window=48)
    with serve(tmp_path, scheduler=sched, engine=FakeEngine(max_model_len=256)) as (url, _, _):
        body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["total_tokens"] == 48 and r.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 48


def test_unknown_model_and_route_are_404(calm: str) -> None:
    assert_openai_error(
        httpx.post(calm + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"}),
        404,
        code="model_not_found",
        param="model",
    )
    assert_openai_error(httpx.get(calm + "/v1/nothing-here"), 404, code="not_found")
    assert_openai_error(httpx.get(calm + "/v1/chat/completions"), 405, code="method_not_allowed")


def test_body_too_large_is_413_by_length_and_when_chunked(calm: str) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 8000}]}
    assert_openai_error(httpx.post(calm + "/v1/chat/completions", json=big), 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count what arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = httpx.post(
        calm + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_openai_error(r, 413, code="request_too_large")
    # and a small body is still fine afterwards
    assert httpx.post(calm + "/v1/chat/completions", json=CHAT).status_code == 200


def test_openai_client_raises_typed_errors(calm: str) -> None:
    client = openai.OpenAI(base_url=calm + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], temperature=5
        )
    assert bad.value.code is None and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_critical_pressure_gives_503_with_retry_after_then_recovers(tmp_path: Path) -> None:
    with serve(tmp_path, Level.CRITICAL, wait_for_ready=False) as (url, state, fake):
        deadline = time.monotonic() + 30
        while state.scheduler is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(url + "/health").status_code == 200  # the process is sound
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503 and "CRITICAL" in ready.json()["reason"]
        for path, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/chat/completions", {**CHAT, "stream": True}),
        ):
            r = httpx.post(url + path, json=body)
            assert_openai_error(r, 503, type="server_overloaded")
            assert int(r.headers["retry-after"]) >= 1
        assert fake.tokenizer.templated == 0  # refused before its prompt was built
        metrics = httpx.get(url + "/metrics").text
        assert 'ballast_http_rejections_total{status="503"} 2.0' in metrics

        level_tree(tmp_path, Level.OK)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "never ready again after pressure cleared"
            time.sleep(0.05)
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_queue_full_is_429_with_retry_after(tmp_path: Path) -> None:
    sched = SchedulerConfig(max_num_seqs=1, max_queue=1, max_num_batched_tokens=64)
    with serve(tmp_path, scheduler=sched, engine=FakeEngine(num_slots=1, step_delay_s=0.05)) as (
        url,
        state,
        fake,
    ):
        running = {**CHAT, "max_tokens": 40, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=running) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep it: a dropped iterator closes the connection
            next(lines)  # A holds the only slot
            waiter = threading.Thread(
                target=lambda: httpx.post(
                    url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=60
                )
            )
            waiter.start()  # B waits in the queue
            _wait_until(lambda: state.scheduler is not None and state.scheduler.queue_depth == 1)
            built = fake.tokenizer.templated
            r = httpx.post(url + "/v1/chat/completions", json=CHAT)  # C: no room
            assert_openai_error(r, 429, code="queue_full")
            assert int(r.headers["retry-after"]) >= 1
            # no prompt changes a full queue's refusal: it comes before C's chat template ran
            assert fake.tokenizer.templated == built
            completion = httpx.post(url + "/v1/completions", json={"model": CHAT["model"], "prompt": "hi"})
            assert_openai_error(completion, 429, code="queue_full")
        waiter.join(timeout=60)
        _wait_until(lambda: state.scheduler is not None and state.scheduler.idle)


def test_api_key_guards_v1_only(tmp_path: Path) -> None:
    with serve(tmp_path, server=ServerConfig(api_key="s3cret")) as (url, _, _):
        assert_openai_error(httpx.post(url + "/v1/chat/completions", json=CHAT), 401, code="invalid_api_key")
        bad = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cres"})
        assert_openai_error(bad, 401)
        assert_openai_error(httpx.get(url + "/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_engine_failure_is_500_and_health_fails(tmp_path: Path) -> None:
    with serve(tmp_path) as (url, state, fake):
        fake.fail_next_step(RuntimeError("device lost"))
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        err = assert_openai_error(r, 500, type="server_error")
        assert "device lost" in str(err["message"])
        metrics = httpx.get(url + "/metrics").text  # counted once, under the refusal's label
        assert 'ballast_requests_total{endpoint="chat",outcome="failed"} 1.0' in metrics
        assert 'outcome="error"' not in metrics
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.get(url + "/ready").status_code == 503
        assert state.failure is not None


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_slot(tmp_path: Path, stream: bool) -> None:
    with serve(tmp_path, engine=FakeEngine(step_delay_s=0.02)) as (url, state, fake):
        body = {**CHAT, "max_tokens": 200, "stream": stream}
        if stream:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
                next(r.iter_lines())
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/chat/completions", json=body, timeout=0.5)
        _wait_until(lambda: state.scheduler is not None and state.scheduler.idle and fake.active_slots == 0)
        assert len(fake.recorded()) < 150  # it stopped long before 200 tokens
        # Counted once, as an abort, in the request counter and the end-to-end histogram.
        _wait_until(
            lambda: (
                'ballast_requests_total{endpoint="chat",outcome="abort"} 1.0'
                in httpx.get(url + "/metrics").text
            )
        )
        metrics = httpx.get(url + "/metrics").text
        assert "ballast_e2e_request_latency_seconds_count 1.0" in metrics
        assert 'ballast_requests_total{endpoint="chat",outcome="length"}' not in metrics


def test_cap_verdict_sets_finish_length_and_header(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK)
    budget = MemWatch(MemoryConfig(root=str(tmp_path))).poll_now().host_budget_bytes
    per_token = budget // 40  # about 40 tokens of window fit in host memory
    cost = CostModel(
        kv_bytes_per_token=per_token, state_bytes_per_slot=0, activation_bytes_per_prefill_token=0
    )
    with serve(tmp_path, engine=FakeEngine(cost_model=cost)) as (url, _, _):
        prompt = FakeTokenizer().apply_chat_template(CHAT["messages"])  # type: ignore[arg-type]
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 100})
        assert r.status_code == 200 and r.headers.get("x-ballast-capped") == "1"
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(prompt) + body["usage"]["completion_tokens"] <= 40
        small = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        assert small.status_code == 200 and "x-ballast-capped" not in small.headers
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True}
        ) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert (
            events[-1]["x_ballast_capped"] is True and events[-1]["choices"][0]["finish_reason"] == "length"
        )


def _wait_until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _stream_once(client: httpx.Client, url: str, content: str) -> tuple[str, str]:
    """One streaming chat; ("ok", text) when it completed, ("refused", "") for a clean 503, ("late",
    "") for a clean 429: the queue ahead is projected past the wait bound (a slow shared box's
    1-slot CRITICAL queue of 24 measured 34 s), which is refused at arrival, not after the wait."""
    body = {**CHAT, "messages": [{"role": "user", "content": content}], "max_tokens": 16, "stream": True}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code in (503, 429):
            r.read()
            if r.status_code == 503:
                assert_openai_error(r, 503, type="server_overloaded")
            else:
                assert_openai_error(r, 429, code="queue_wait_exceeded")
            assert int(r.headers["retry-after"]) >= 1
            return ("refused" if r.status_code == 503 else "late"), ""
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "error" not in events[-1], events[-1]  # an admitted request is never killed mid-stream
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return "ok", "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def test_pressure_walk_under_32_streaming_clients(tmp_path: Path) -> None:
    """OK -> WATCH -> TIGHT -> CRITICAL -> OK while 32 clients stream: the slot ceiling and window
    follow the ladder, CRITICAL answers 503 + Retry-After, every admitted request completes with its
    calm text, and the server serves again at OK with nothing left behind."""
    tok = FakeTokenizer()
    sched = SchedulerConfig(max_num_seqs=8, max_queue=64, max_num_batched_tokens=256)
    with serve(tmp_path, scheduler=sched, engine=FakeEngine(num_slots=8, step_delay_s=0.005)) as (
        url,
        state,
        fake,
    ):
        assert state.scheduler is not None
        stop = threading.Event()
        outcomes: list[str] = []
        failures: list[BaseException] = []

        def client_loop(i: int) -> None:
            with httpx.Client(timeout=60) as client:
                k = 0
                while not stop.is_set():
                    content = f"client {i} request {k}"
                    try:
                        outcome, text = _stream_once(client, url, content)
                        if outcome == "ok":
                            prompt = tok.apply_chat_template([{"role": "user", "content": content}])
                            assert text == tok.decode(expected_tokens(prompt, 16))
                        outcomes.append(outcome)
                    except BaseException as exc:  # reported below; a thread must not die silently
                        failures.append(exc)
                        return
                    k += 1

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        s = state.scheduler
        try:
            _wait_until(lambda: outcomes.count("ok") >= 32)
            for level, slots, window in (
                (Level.WATCH, 8, 256),
                (Level.TIGHT, 4, 128),
                (Level.CRITICAL, 1, 64),
            ):
                level_tree(tmp_path, level)
                _wait_until(
                    lambda s=slots, w=window: (
                        s == state.scheduler.slot_limit and w == state.scheduler.ladder.context_window
                    )
                )  # type: ignore[union-attr]
                if level is Level.CRITICAL:
                    _wait_until(lambda: outcomes.count("refused") >= 8)
                    assert httpx.get(url + "/ready").status_code == 503
                    assert httpx.get(url + "/health").status_code == 200
            level_tree(tmp_path, Level.OK)
            _wait_until(lambda: s.slot_limit == 8 and httpx.get(url + "/ready").status_code == 200)
            served = outcomes.count("ok")
            _wait_until(lambda: outcomes.count("ok") >= served + 32)  # serving again at OK
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not failures, failures[:3]
        _wait_until(lambda: s.idle and fake.active_slots == 0)
        assert s.queue_depth == 0 and s.active_slots == 0


def test_level_flapping_never_corrupts_an_admitted_request(tmp_path: Path) -> None:
    """The level toggles OK <-> CRITICAL every 50 ms while 16 greedy requests stream: each one
    either completes with exactly its calm text or is refused with a clean 503."""
    tok = FakeTokenizer()
    with serve(tmp_path, engine=FakeEngine(num_slots=8, step_delay_s=0.005)) as (url, state, fake):
        flapping = threading.Event()

        def flap() -> None:
            level = Level.CRITICAL
            while not flapping.is_set():
                level_tree(tmp_path, level)
                level = Level.OK if level is Level.CRITICAL else Level.CRITICAL
                time.sleep(0.05)
            level_tree(tmp_path, Level.OK)

        results: list[tuple[str, str, str]] = []

        def one(i: int) -> None:
            content = f"flap {i}"
            with httpx.Client(timeout=60) as client:
                outcome, text = _stream_once(client, url, content)
            results.append((content, outcome, text))

        flapper = threading.Thread(target=flap)
        flapper.start()
        clients = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        try:
            for t in clients:
                t.start()
                time.sleep(0.02)  # spread arrivals over several flips
            for t in clients:
                t.join(timeout=60)
        finally:
            flapping.set()
            flapper.join()
        assert len(results) == 16
        for content, outcome, text in results:
            if outcome == "ok":
                prompt = tok.apply_chat_template([{"role": "user", "content": content}])
                assert text == tok.decode(expected_tokens(prompt, 16)), content
        assert state.sound()
        _wait_until(lambda: state.scheduler is not None and state.scheduler.idle and fake.active_slots == 0)


def test_n_choices_prefill_their_prompt_once(tmp_path: Path) -> None:
    """The first choice prefills the prompt; the others start once it has, and restore it from the
    prefix cache instead of prefilling it again (up to the last checkpoint boundary)."""
    with serve(tmp_path, engine=FakeEngine(checkpoint_interval=8, prefill_chunk_tokens=64)) as (url, _, fake):
        content = "a prompt long enough to span several checkpoints of eight tokens"
        body = {**CHAT, "messages": [{"role": "user", "content": content}], "max_tokens": 3, "n": 3}
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        prompt = FakeTokenizer().apply_chat_template(body["messages"])  # type: ignore[arg-type]
        prefilled = sum(len(c.token_ids) for plan in fake.recorded() for c in plan.prefills)
        restored = [len(x.prefix) for plan in fake.recorded() for x in plan.restores]
        assert restored == [len(prompt) // 8 * 8] * 2
        assert prefilled == len(prompt) + 2 * (len(prompt) - restored[0])
        assert (
            len({c["message"]["content"] for c in r.json()["choices"]}) == 1
        )  # greedy: the same answer thrice


def test_a_refusal_is_timed_from_the_request_s_arrival(tmp_path: Path) -> None:
    """`ballast_refusal_seconds` runs from when the request's head reached the server, not from
    when its prompt was built: a body that comes 0.3 s after the head is in the refusal's time
    (before s26 the clock started after parsing and templating, and a burst of long chats read
    25 ms at the server while its clients waited up to 1 s)."""
    with serve(tmp_path, Level.CRITICAL, wait_for_ready=False) as (url, state, _):
        deadline = time.monotonic() + 30
        while state.scheduler is None and time.monotonic() < deadline:
            time.sleep(0.02)

        def slow_body() -> Iterator[bytes]:
            time.sleep(0.3)
            yield json.dumps(CHAT).encode()

        r = httpx.post(
            url + "/v1/chat/completions", content=slow_body(), headers={"content-type": "application/json"}
        )
        assert_openai_error(r, 503, type="server_overloaded")
        page = httpx.get(url + "/metrics").text
        waited = re.search(r'^ballast_refusal_seconds_sum\{status="503"\} (\S+)$', page, re.M)
        assert waited is not None and float(waited.group(1)) >= 0.3
