"""What the Anthropic Messages and OpenAI Responses translation costs per request, against chat
completions on the same conversation: request parsing and translation into the chat request, the
whole answer's body, and a streamed answer's events (a 64-token text answer, one event per token).
Everything after the translation (template, tokenizer, scheduler, model) is the same code for all
three, so only these parts differ.

Each figure is microseconds per request over `--requests` requests (p50 and p99), in this
process. Table on stdout, JSON to bench/results/translation.json.

    python -m ballast.bench.translation [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast.server import messages, replies, responses
from ballast.server import protocol as p
from ballast.server.answer import Answer
from ballast.server.messages_out import MessageEvents, message
from ballast.server.parts import Text
from ballast.server.responses_out import ResponseEvents, ResponseShape, answer_items
from ballast.server.translate import Ending

RESULTS = Path(__file__).parent / "results" / "translation.json"
SYSTEM = "You are a helpful assistant."
TURNS = [("user", "What is the capital of France?"), ("assistant", "Paris."), ("user", "And of Italy?")]
TOKENS = [f" word{i}" for i in range(64)]
ANSWER = Answer(None, "".join(TOKENS), [])
END = Ending("stop", None, False, 40, 64, 0)


class _Tokenizer:
    """Responses count the thinking's tokens; this answer has none, so nothing is encoded."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * len(text.split())


def chat_body() -> dict[str, Any]:
    turns = [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": c} for r, c in TURNS]
    return {"model": "m", "messages": turns, "max_tokens": 64}


def messages_body() -> dict[str, Any]:
    turns = [{"role": r, "content": [{"type": "text", "text": c}]} for r, c in TURNS]
    return {"model": "m", "system": SYSTEM, "messages": turns, "max_tokens": 64}


def responses_body() -> dict[str, Any]:
    return {"model": "m", "instructions": SYSTEM, "input": [{"role": r, "content": c} for r, c in TURNS]}


def chat_request() -> object:
    return p.ChatCompletionRequest.model_validate(chat_body())


def messages_request() -> object:
    return messages.to_chat(messages.MessagesRequest.model_validate(messages_body()))


def responses_request() -> object:
    return responses.to_chat(responses.ResponsesRequest.model_validate(responses_body()))


def chat_whole() -> object:
    choice = replies.ChatChoice(
        message=replies.AssistantMessage(content=ANSWER.content), finish_reason="stop"
    )
    body = replies.ChatCompletion(
        id="c", created=0, model="m", choices=[choice], usage=replies.Usage.of(40, 64)
    )
    return json.dumps(body.model_dump())


def messages_whole() -> object:
    return json.dumps(message("msg", "m", ANSWER, END))


def responses_whole() -> object:
    req = responses.ResponsesRequest.model_validate(responses_body())
    shape = ResponseShape("resp", "m", responses.echo_fields(req), _Tokenizer())  # type: ignore[arg-type]
    return json.dumps(shape.body(answer_items(ANSWER), END))


def chat_stream() -> object:
    # As the server writes a plain text chunk: the chunk rendered once around a marker, then each
    # token's JSON string between its halves.
    marker = "\x00text\x00"
    chunk = replies.ChatCompletionChunk(
        id="c",
        created=0,
        model="m",
        choices=[replies.ChatChunkChoice(delta=replies.ChatDelta(content=marker))],
    )
    head, tail = f"data: {json.dumps(chunk.model_dump(), separators=(',', ':'))}\n\n".split(
        json.dumps(marker)
    )
    return [head + json.dumps(t) + tail for t in TOKENS]


def messages_stream() -> object:
    writer = MessageEvents("msg", "m", 40)
    out = [writer.start()] + [writer.parts([Text(t)]) for t in TOKENS]
    return out + [writer.close(), writer.finish(END)]


def responses_stream() -> object:
    req = responses.ResponsesRequest.model_validate(responses_body())
    writer = ResponseEvents(ResponseShape("resp", "m", responses.echo_fields(req), _Tokenizer()))  # type: ignore[arg-type]
    out = [writer.start()] + [writer.parts([Text(t)]) for t in TOKENS]
    return out + [writer.close(), writer.finish(END)]


def timed(fn: Callable[[], object], requests: int) -> tuple[float, float]:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(requests):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    stages = {
        "request": (chat_request, messages_request, responses_request),
        "whole answer": (chat_whole, messages_whole, responses_whole),
        "streamed answer (64 tokens)": (chat_stream, messages_stream, responses_stream),
    }
    rows = []
    print(f"{'stage':30} {'chat p50/p99 us':>18} {'messages p50/p99 us':>22} {'responses p50/p99 us':>22}")
    for stage, fns in stages.items():
        figures = [timed(fn, args.requests) for fn in fns]
        rows.append(
            {
                "stage": stage,
                **{
                    api: {"p50_us": f[0], "p99_us": f[1]}
                    for api, f in zip(("chat", "messages", "responses"), figures, strict=True)
                },
            }
        )
        print(f"{stage:30} " + " ".join(f"{f[0]:>10.1f}/{f[1]:<10.1f}" for f in figures))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"requests": args.requests, "python": platform.python_version(), "machine": platform.machine()}
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
