"""Anthropic Messages answers: the whole message, and the stream of its documented events
(`message_start`, `ping`, then per block `content_block_start` / `content_block_delta` (text_delta,
thinking_delta, input_json_delta) / `content_block_stop`, then `message_delta` with the stop
reason and usage, and `message_stop`). An error after the stream began is an `error` event."""

from __future__ import annotations

import json
import uuid
from typing import Any

from ballast.server.answer import Answer
from ballast.server.errors import ApiError, anthropic_body
from ballast.server.parts import Call
from ballast.server.translate import BlockWriter, Ending, Kind


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(end: Ending) -> str:
    if end.reason == "length":
        return "max_tokens"
    if end.called:
        return "tool_use"
    return "stop_sequence" if end.stop_string is not None else "end_turn"


def usage(end: Ending, output: bool = True) -> dict[str, int]:
    # Anthropic counts prompt tokens read from a cache apart from the ones it processed.
    out = {
        "input_tokens": end.prompt_tokens - end.cached_tokens,
        "cache_read_input_tokens": end.cached_tokens,
        "cache_creation_input_tokens": 0,
    }
    if output:
        out["output_tokens"] = end.completion_tokens
    return out


def _input(call: Call) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:  # a call cut off by max_tokens: what of it parses is not known
        return {}
    return value if isinstance(value, dict) else {}


def message(msg_id: str, model: str, answer: Answer, end: Ending) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c)} for c in answer.calls]
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(end),
        "stop_sequence": end.stop_string,
        "usage": usage(end),
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class MessageEvents(BlockWriter):
    def __init__(self, msg_id: str, model: str, prompt_tokens: int) -> None:
        super().__init__()
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, prompt_tokens

    def start(self) -> str:
        head: dict[str, Any] = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return _event("message_start", {"message": head}) + _event("ping", {})

    def open_block(self, kind: Kind) -> str:
        block: dict[str, Any] = {"type": "text", "text": ""}
        if kind == "thought":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == "call":
            assert self.call is not None
            block = {"type": "tool_use", "id": self.call.id, "name": self.call.name, "input": {}}
        return _event("content_block_start", {"index": self.blocks, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def text(self, text: str) -> str:
        return self._delta({"type": "text_delta", "text": text})

    def thought(self, text: str) -> str:
        return self._delta({"type": "thinking_delta", "thinking": text})

    def arguments(self, text: str) -> str:
        return self._delta({"type": "input_json_delta", "partial_json": text})

    def close_block(self, kind: Kind, call: Call | None) -> str:
        out = self._delta({"type": "signature_delta", "signature": ""}) if kind == "thought" else ""
        return out + _event("content_block_stop", {"index": self.blocks - 1})

    def finish(self, end: Ending) -> str:
        delta = {"stop_reason": stop_reason(end), "stop_sequence": end.stop_string}
        return _event("message_delta", {"delta": delta, "usage": usage(end)}) + _event("message_stop", {})

    def error(self, err: ApiError) -> str:
        return f"event: error\ndata: {json.dumps(anthropic_body(err), ensure_ascii=False)}\n\n"
