"""`ballast_generation_tokens_total` is live: a real uvicorn server and the official openai client
show it rising while an answer streams, and, once requests complete, equal to the sum of their
usage.completion_tokens (chat and completions, streamed and not, n > 1, several prompts, a stop
string, tools), with a client that went away counted for what was generated before it left.

The engine is the deterministic FakeEngine; its step gate (`allow_steps`) holds a stream mid-way,
so what a scrape sees mid-stream does not depend on timing. One slow test runs the real default
model (its own end-of-sequence tokens, detokenizer stop strings, a grammar-forced tool call).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from fake_engine import FakeEngine, FakeTokenizer, expected_tokens
from prometheus_client.parser import text_string_to_metric_families
from serverproc import running_server

TOK = FakeTokenizer()
MODEL = "fake-model"
MESSAGES = [{"role": "user", "content": "write a long story"}]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
    }
]


@dataclass
class Served:
    url: str
    engine: FakeEngine
    client: openai.OpenAI


@pytest.fixture
def served() -> Iterator[Served]:
    """A fresh server per test: its counters start at 0."""
    engine = FakeEngine(max_model_len=512)
    app = create_app(ServerConfig(), SchedulerConfig(), lambda: engine)
    with running_server(app) as url:
        try:
            yield Served(url, engine, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))
        finally:
            engine.allow_steps(None)  # a held step would keep the server from stopping


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name and labels (`name{k=v,...}`)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def generated(url: str) -> float:
    return scrape(url)["ballast_generation_tokens_total"]


def test_a_long_stream_is_counted_while_it_streams(served: Served) -> None:
    assert generated(served.url) == 0  # present before the first token, so rate() has a series
    served.engine.allow_steps(8)  # the prefill and seven decodes: at most 8 of its 300 tokens
    stream = served.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=300,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if chunks == 5:
                break
    mid = generated(served.url)
    assert 5 <= mid <= 8  # already counted, mid-stream (before this change: 0 until the end)
    served.engine.allow_steps(None)
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 300
    assert generated(served.url) == 300


def test_finished_requests_add_exactly_their_usage(served: Served) -> None:
    client = served.client
    usages = []
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, temperature=0)  # type: ignore[arg-type]
    usages.append(r.usage)
    c = client.completions.create(
        model=MODEL, prompt=["the cat", "a dog"], n=3, max_tokens=5, temperature=0.8
    )
    usages.append(c.usage)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        n=2,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.8,
        seed=3,
    )
    usages += [chunk.usage for chunk in streamed if chunk.usage is not None]
    with_tools = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages += [chunk.usage for chunk in with_tools if chunk.usage is not None]
    # A stop string cuts the answer's text; the token that completed it was generated and counts.
    calm = TOK.decode(expected_tokens(TOK.encode("the cat"), 40))
    stop = calm[12:14]
    stopped = client.completions.create(
        model=MODEL,
        prompt="the cat",
        max_tokens=40,
        temperature=0,
        stop=[stop],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stopped)
    usages += [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert len(usages) == 5 and all(u is not None for u in usages)
    assert usages[1] is not None and usages[1].completion_tokens == 30  # 2 prompts x n=3 x 5
    assert usages[4] is not None and 0 < usages[4].completion_tokens < 40
    figures = scrape(served.url)
    assert figures["ballast_generation_tokens_total"] == sum(u.completion_tokens for u in usages if u)
    assert figures["ballast_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages if u)


def test_a_client_that_goes_away_is_counted_for_what_was_generated(served: Served) -> None:
    served.engine.allow_steps(6)
    stream = served.client.completions.create(model=MODEL, prompt="the cat", max_tokens=300, stream=True)
    chunks = 0
    for chunk in stream:
        chunks += bool(chunk.choices and chunk.choices[0].text)
        if chunks == 2:
            break
    stream.close()
    # However this server notices the disconnect (a listener, or the next send failing), a few
    # more steps are enough; the scrape below waits for the abort, not for a time.
    served.engine.allow_steps(50)
    aborted = "ballast_requests_total{endpoint=completion,outcome=abort}"
    for _ in range(600):
        figures = scrape(served.url)
        if figures.get(aborted) == 1 and figures["ballast_slots_active"] == 0:
            break
        time.sleep(0.05)
    assert figures.get(aborted) == 1, figures
    left = figures["ballast_generation_tokens_total"]
    assert 2 <= left < 300
    served.engine.allow_steps(None)
    r = served.client.completions.create(model=MODEL, prompt="a dog", max_tokens=11, temperature=0)
    assert r.usage is not None and generated(served.url) == left + r.usage.completion_tokens


@pytest.mark.slow
def test_the_real_model_counts_exactly_its_usage() -> None:
    config = EngineConfig(model="default", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=1024)
    app = create_app(
        ServerConfig(), SchedulerConfig(), lambda: Engine.load(config), model_aliases=("default",)
    )
    with running_server(app, timeout_s=180) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "What is the weather in Paris? Say it in one line."}]
        usages = []
        reasons = []
        # A free answer, streamed: the model's own end-of-sequence token ends it (or max_tokens).
        for chunk in client.chat.completions.create(
            model="default",
            messages=ask,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        ):
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usages += [chunk.usage] if chunk.usage is not None else []
        # A tool call the grammar forces, two choices.
        weather: Any = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                        "required": ["city"],
                    },
                },
            }
        ]
        forced = client.chat.completions.create(
            model="default",
            messages=ask,  # type: ignore[arg-type]
            tools=weather,
            tool_choice="required",
            n=2,
            temperature=0,
            max_tokens=80,
        )
        usages.append(forced.usage)
        reasons += [c.finish_reason for c in forced.choices]
        # A stop string inside the greedy text: the text is cut, the token completing it counts.
        whole = client.completions.create(
            model="default", prompt="The capital of France", max_tokens=24, temperature=0
        )
        text = whole.choices[0].text
        usages.append(whole.usage)
        cut = client.completions.create(
            model="default", prompt="The capital of France", max_tokens=24, temperature=0, stop=[text[8:12]]
        )
        usages.append(cut.usage)
        reasons += [cut.choices[0].finish_reason]
        assert "tool_calls" in reasons and reasons[-1] == "stop" and all(u is not None for u in usages)
        assert cut.usage is not None and whole.usage is not None
        assert cut.usage.completion_tokens < whole.usage.completion_tokens
        assert generated(url) == sum(u.completion_tokens for u in usages if u is not None)
