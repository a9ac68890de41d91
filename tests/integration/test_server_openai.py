"""The OpenAI protocol end to end: the official `openai` client against a real uvicorn server.

The engine is the deterministic FakeEngine (its greedy text is a pure function of the prompt), so
every answer can be checked exactly; one slow test runs the real engine on a builtin model through
`ballast serve`. The app's lifecycle (loading, a failed load) is checked here too.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest, TokenEvent
from ballast.server.app import create_app
from ballast.server.completions import Job
from ballast.server.config import ServerConfig
from ballast.server.metrics import HttpMetrics
from ballast.server.state import ServerState
from ballast.server.streaming import _ChunkWriter
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens
from memfixtures import level_tree
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from serverproc import running_server, serve_subprocess

import ballast

TOK = FakeTokenizer()
MESSAGES = [{"role": "user", "content": "say something"}]
CHAT = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}


def chat_prompt(messages: list[dict[str, str]]) -> list[int]:
    return TOK.apply_chat_template(messages)


def greedy_text(prompt: list[int], n: int) -> str:
    return TOK.decode(expected_tokens(prompt, n))


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root: Path = tmp_path_factory.mktemp("proc")
    level_tree(root, Level.OK)
    watch = MemWatch(MemoryConfig(root=str(root)))
    app = create_app(
        ServerConfig(),
        SchedulerConfig(),
        lambda: FakeEngine(max_model_len=256),
        memwatch=watch,
        model_aliases=("default",),
    )
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_model_list(client: openai.OpenAI) -> None:
    models = client.models.list().data
    # the served name first, then every other name requests may use (gateways route on these)
    assert [m.id for m in models] == ["fake-model", "default"]


def test_chat_non_stream_is_the_greedy_text_with_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="fake-model", messages=MESSAGES, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    prompt = chat_prompt(MESSAGES)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy_text(prompt, 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt),
        12,
        len(prompt) + 12,
    )


def test_chat_stream_equals_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=10,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_text(chat_prompt(MESSAGES), 10)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(chat_prompt(MESSAGES))


def test_completions_stream_and_non_stream(client: openai.OpenAI) -> None:
    prompt = "the cat sat"
    ids = TOK.encode(prompt)
    r = client.completions.create(model="fake-model", prompt=prompt, temperature=0, max_tokens=9)
    assert r.object == "text_completion"
    assert r.choices[0].text == greedy_text(ids, 9)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    parts = [
        c.choices[0].text
        for c in client.completions.create(
            model="fake-model", prompt=prompt, temperature=0, max_tokens=9, stream=True
        )
        if c.choices
    ]
    assert "".join(parts) == r.choices[0].text


def test_completions_accepts_token_ids(client: openai.OpenAI) -> None:
    ids = TOK.encode("hello there")
    r = client.completions.create(model="fake-model", prompt=ids, temperature=0, max_tokens=5)
    assert r.choices[0].text == greedy_text(ids, 5)


def test_stop_string_cuts_the_text_and_finishes_with_stop(client: openai.OpenAI) -> None:
    prompt = chat_prompt(MESSAGES)
    full = greedy_text(prompt, 30)
    stop = full[7:9]  # a stop string that first occurs somewhere in the greedy text
    cut = full[: full.index(stop)]
    r = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, temperature=0, max_tokens=30, stop=[stop, "never-there"]
    )  # type: ignore[arg-type]
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, temperature=0, max_tokens=30, stop=stop, stream=True
    )  # type: ignore[arg-type]
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_sampled_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model="fake-model", prompt="once upon", temperature=1.0, seed=seed, max_tokens=16
        )
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1  # the seed does change the draw
    greedy = greedy_text(TOK.encode("once upon"), 16)
    assert sample(7) != greedy


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )  # type: ignore[arg-type]
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 4
    tokens = expected_tokens(chat_prompt(MESSAGES), 4)
    assert [e.token for e in lp.content] == [TOK.decode([t]) for t in tokens]
    for e in lp.content:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.bytes == list(e.token.encode())


def test_chat_stream_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, stream=True
        )
    )  # type: ignore[arg-type]
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [TOK.decode([t]) for t in expected_tokens(chat_prompt(MESSAGES), 6)]
    assert all(e.top_logprobs == [] for e in entries)  # top_logprobs unset: the sampled token only


def test_completion_logprobs_offsets(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake-model", prompt="abc", temperature=0, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.text_offset is not None
        and lp.top_logprobs is not None
    )
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_metrics_parse_and_carry_http_scheduler_and_memory_figures(
    client: openai.OpenAI, base_url: str
) -> None:
    client.chat.completions.create(model="fake-model", messages=MESSAGES, temperature=0, max_tokens=3)  # type: ignore[arg-type]
    text = httpx.get(base_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "ballast_memory_pressure_level",
        "ballast_host_memory_available_bytes",
        "ballast_memory_psi_full_avg10",
        "ballast_ladder_max_slots",
        "ballast_admission_verdicts",
        "ballast_time_to_first_token_seconds",
        "ballast_inter_token_latency_seconds",
        "ballast_e2e_request_latency_seconds",
        "ballast_prompt_tokens",
        "ballast_generation_tokens",
        "ballast_requests",
        "ballast_http_rejections",
        "ballast_queue_depth",
        "ballast_slots_active",
        "ballast_slots_limit",
        "ballast_prompt_tokens_reused",
    ):
        assert name in families, name
    requests = {
        tuple(sorted(s.labels.items())): s.value
        for s in families["ballast_requests"].samples
        if s.name == "ballast_requests_total"
    }
    assert requests[(("endpoint", "chat"), ("outcome", "length"))] >= 1
    assert next(s.value for s in families["ballast_slots_limit"].samples) == 8
    ttft_count = next(
        s.value for s in families["ballast_time_to_first_token_seconds"].samples if s.name.endswith("_count")
    )
    assert ttft_count >= 1
    assert (
        next(s.value for s in families["ballast_memory_pressure_level"].samples) == 0
    )  # the OK fixture tree
    assert next(s.value for s in families["ballast_host_memory_total_bytes"].samples) == 16 * (1 << 30)


def test_health_and_ready(base_url: str) -> None:
    assert httpx.get(base_url + "/health").status_code == 200
    r = httpx.get(base_url + "/ready")
    assert r.status_code == 200 and r.json()["level"] == "OK"


@pytest.mark.slow
def test_real_engine_through_ballast_serve() -> None:
    """`ballast serve` in a child process with a real (tiny, random-init) model: chat through the
    openai client, streamed and not, greedy runs agree, and the server exits cleanly."""
    with serve_subprocess(
        ["--model", "builtin:tiny-llama", "--max-model-len", "256", "--max-num-seqs", "4"]
    ) as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        assert model == "builtin:tiny-llama"
        r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage is not None
        assert r.usage.completion_tokens >= 1 and r.choices[0].message.content
        chunks = list(
            client.chat.completions.create(
                model=model, messages=MESSAGES, temperature=0, max_tokens=12, stream=True
            )
        )  # type: ignore[arg-type]
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == r.choices[0].message.content
        )
        # a token id outside the vocabulary is the client's error, not an engine failure
        bad = httpx.post(
            url + "/v1/completions", json={"model": model, "prompt": [1, 10**9], "max_tokens": 2}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert httpx.get(url + "/health").status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert "ballast_memory_pressure_level" in metrics and "ballast_generation_tokens_total" in metrics
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (so -15, not a crash code)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_loading_phase_answers_503_until_the_engine_is_up(tmp_path: Path) -> None:
    level_tree(tmp_path, Level.OK)
    release = threading.Event()

    def slow_factory() -> FakeEngine:
        assert release.wait(30), "test never released the load"
        return FakeEngine()

    app = create_app(
        ServerConfig(), SchedulerConfig(), slow_factory, memwatch=MemWatch(MemoryConfig(root=str(tmp_path)))
    )
    with running_server(app, wait_for_ready=False) as url:
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["phase"] == "loading"
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503 and "loading" in ready.json()["reason"]
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert r.headers["retry-after"] == "1"
        assert httpx.get(url + "/v1/models").json()["data"] == []
        release.set()
        wait_until(lambda: httpx.get(url + "/ready").status_code == 200)
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_failed_load_makes_health_fail_and_calls_on_fatal(tmp_path: Path) -> None:
    def broken_factory() -> FakeEngine:
        raise OSError("weights file is truncated")

    fatal: list[str] = []
    app = create_app(ServerConfig(), SchedulerConfig(), broken_factory, on_fatal=fatal.append)
    with running_server(app, wait_for_ready=False) as url:
        wait_until(lambda: httpx.get(url + "/health").status_code == 503)
        assert "weights file is truncated" in httpx.get(url + "/health").json()["reason"]
        assert httpx.get(url + "/ready").status_code == 503
        assert len(fatal) == 1 and "model load failed" in fatal[0]


def wait_until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_streamed_text_chunks_are_the_modelled_bytes() -> None:
    """The per-token fast path (a pre-rendered chunk around the JSON text) gives exactly the bytes
    the pydantic models give, for text that needs escaping too."""
    engine = FakeEngine()
    registry = CollectorRegistry()
    state = ServerState(
        config=ServerConfig(), registry=registry, metrics=HttpMetrics(registry), engine=engine
    )
    try:
        for endpoint in ("chat", "completion"):
            for include_usage in (False, True):
                job = Job(
                    endpoint,
                    "id-1",
                    "m",
                    (GenerationRequest("id-1", (1,)),),
                    True,
                    include_usage,
                    False,
                    "prompt",
                )
                writer = _ChunkWriter(job, state)
                for text in (
                    "plain",
                    'quote " and \\ backslash',
                    "line\nbreak\t",
                    "ünïcødé 漢字 🙂",
                    "\x00",
                    "",
                ):
                    event = TokenEvent(text, (1,))
                    assert writer.tokens(event) == writer._modelled_tokens(event)
                    assert json.loads(writer.tokens(event)[6:])["object"] in (
                        "chat.completion.chunk",
                        "text_completion",
                    )
    finally:
        engine.shutdown()


def test_the_model_spec_is_an_alias_of_the_served_name(client: openai.OpenAI) -> None:
    """`ballast serve --model default` answers to "default" too (as vLLM answers to its --model);
    responses carry the served name, and any other name is still a 404."""
    done = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=3)  # type: ignore[arg-type]
    assert done.model == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]


def test_developer_role_is_the_system_role(client: openai.OpenAI) -> None:
    dev = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "developer", "content": "be brief"}, *MESSAGES],  # type: ignore[list-item]
        temperature=0,
        max_tokens=4,
    )
    as_system = chat_prompt([{"role": "system", "content": "be brief"}, *MESSAGES])
    assert dev.usage is not None and dev.usage.prompt_tokens == len(as_system)
    assert dev.choices[0].message.content == greedy_text(as_system, 4)


def test_refused_fields_are_named_and_harmless_ones_accepted(base_url: str) -> None:
    r = httpx.post(base_url + "/v1/chat/completions", json={**CHAT, "stop_token_ids": [3]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    r = httpx.post(
        base_url + "/v1/completions",
        json={"model": "fake-model", "prompt": "ab", "max_tokens": 2, "min_tokens": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    fmt = {"type": "json_object"}
    r = httpx.post(
        base_url + "/v1/completions", json={"model": "fake-model", "prompt": "ab", "response_format": fmt}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = httpx.post(base_url + "/v1/chat/completions", json={**CHAT, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    ok = httpx.post(
        base_url + "/v1/chat/completions",
        json={
            **CHAT,
            "metadata": {"a": "b"},
            "store": False,
            "user": "u",
            "service_tier": "auto",
            "parallel_tool_calls": False,
        },
    )
    assert ok.status_code == 200, ok.text


def test_model_retrieve_version_and_docs(client: openai.OpenAI, base_url: str) -> None:
    card = client.models.retrieve("fake-model")
    assert card.id == "fake-model" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(base_url + "/version").json() == {"version": ballast.__version__}
    assert httpx.get(base_url + "/docs").status_code == 200
    assert "/v1/chat/completions" in httpx.get(base_url + "/openapi.json").json()["paths"]


def test_tokenize_and_detokenize_in_vllm_shapes(base_url: str) -> None:
    r = httpx.post(base_url + "/tokenize", json={"model": "fake-model", "prompt": "the cat"}).json()
    assert r == {
        "count": len(TOK.encode("the cat")),
        "max_model_len": 256,
        "tokens": TOK.encode("the cat"),
        "token_strs": None,
    }
    chat = httpx.post(base_url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == chat_prompt(MESSAGES)
    assert httpx.post(base_url + "/detokenize", json={"tokens": TOK.encode("the cat")}).json() == {
        "prompt": "the cat"
    }
    assert httpx.post(base_url + "/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.post(base_url + "/tokenize", json={"prompt": "a", "messages": MESSAGES}).status_code == 400


def test_n_choices_greedy_and_seeded(client: openai.OpenAI) -> None:
    prompt = chat_prompt(MESSAGES)
    r = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, temperature=0, max_tokens=5, n=3
    )  # type: ignore[arg-type]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {greedy_text(prompt, 5)}
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 15)
    seeded = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, temperature=1, seed=5, max_tokens=8, n=2
    )  # type: ignore[arg-type]
    again = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, temperature=1, seed=5, max_tokens=8, n=2
    )  # type: ignore[arg-type]
    texts = [c.message.content for c in seeded.choices]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]


def test_n_choices_stream_by_index(client: openai.OpenAI) -> None:
    prompt = chat_prompt(MESSAGES)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in client.chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        temperature=0,
        max_tokens=6,
        n=2,  # type: ignore[arg-type]
        stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: greedy_text(prompt, 6), 1: greedy_text(prompt, 6)}
    assert finishes == {0: "length", 1: "length"}


def test_a_list_of_prompts_gives_a_choice_per_prompt_and_n(client: openai.OpenAI) -> None:
    prompts = ["the cat", "a dog", "bird"]
    r = client.completions.create(model="fake-model", prompt=prompts, temperature=0, max_tokens=4, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [greedy_text(TOK.encode(p), 4) for p in prompts for _ in range(2)]
    assert r.usage is not None and r.usage.prompt_tokens == sum(len(TOK.encode(p)) for p in prompts)
    ids = client.completions.create(
        model="fake-model", prompt=[TOK.encode("a dog"), TOK.encode("bird")], temperature=0, max_tokens=3
    )
    assert [c.text for c in ids.choices] == [greedy_text(TOK.encode(p), 3) for p in ("a dog", "bird")]


def test_echo_puts_the_prompt_before_the_answer(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="fake-model", prompt="the cat", temperature=0, max_tokens=4, echo=True
    )
    assert r.choices[0].text == "the cat" + greedy_text(TOK.encode("the cat"), 4)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="fake-model", prompt="the cat", temperature=0, max_tokens=4, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text
