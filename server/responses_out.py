"""OpenAI Responses answers: the whole Response object, and its stream of events
(`response.created`, `response.in_progress`, per output item `response.output_item.added`, its
deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`) and their `.done`, `response.output_item.done`, then
`response.completed`, or `response.incomplete` when max_output_tokens cut the answer short).
Every event carries its `sequence_number`; an error after the stream began is an `error` event."""

from __future__ import annotations

import json
import uuid
from typing import Any

from ballast.engine.interface import TokenizerLike
from ballast.server import replies
from ballast.server.answer import Answer
from ballast.server.errors import ApiError
from ballast.server.parts import Call
from ballast.server.translate import BlockWriter, Ending, Kind


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def text_item(item: str, text: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item, "type": "message", "status": "completed", "role": "assistant", "content": [part]}


def thought_item(item: str, text: str) -> dict[str, Any]:
    return {
        "id": item,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(item: str, call: Call, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }


def answer_items(answer: Answer) -> list[dict[str, Any]]:
    items = [thought_item(item_id("rs"), answer.reasoning)] if answer.reasoning else []
    if answer.content:
        items.append(text_item(item_id("msg"), answer.content))
    return items + [call_item(item_id("fc"), c) for c in answer.calls]


class ResponseShape:
    """The Response object of one request, as it stands."""

    def __init__(self, resp_id: str, model: str, echo: dict[str, Any], tokenizer: TokenizerLike) -> None:
        self.resp_id, self.model, self.echo, self.tokenizer = resp_id, model, echo, tokenizer
        self.created = replies.now()

    def body(self, items: list[dict[str, Any]], end: Ending | None) -> dict[str, Any]:
        status = "in_progress" if end is None else "incomplete" if end.reason == "length" else "completed"
        return {
            "id": self.resp_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": items,
            "usage": None if end is None else self._usage(items, end),
            **self.echo,
        }

    def _usage(self, items: list[dict[str, Any]], end: Ending) -> dict[str, Any]:
        # The tokens of the thinking, counted again from its text: the split is made on text.
        thinking = "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"])
        reasoning = len(self.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
        return {
            "input_tokens": end.prompt_tokens,
            "input_tokens_details": {"cached_tokens": end.cached_tokens},
            "output_tokens": end.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, end.completion_tokens)},
            "total_tokens": end.prompt_tokens + end.completion_tokens,
        }


class ResponseEvents(BlockWriter):
    def __init__(self, shape: ResponseShape) -> None:
        super().__init__()
        self.shape = shape
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items done so far
        self.item = ""  # the open item's id
        self.written = ""  # its text or arguments so far

    def _event(self, name: str, data: dict[str, Any]) -> str:
        payload = {"type": name, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item, "output_index": len(self.items)}

    def start(self) -> str:
        body = self.shape.body([], None)
        return self._event("response.created", {"response": body}) + self._event(
            "response.in_progress", {"response": body}
        )

    def open_block(self, kind: Kind) -> str:
        self.item, self.written = item_id({"text": "msg", "thought": "rs", "call": "fc"}[kind]), ""
        index = {"output_index": len(self.items)}
        if kind == "call":
            assert self.call is not None
            call = Call(self.call.id, self.call.name, "")
            return self._event(
                "response.output_item.added", {**index, "item": call_item(self.item, call, "in_progress")}
            )
        if kind == "thought":
            item = {"id": self.item, "type": "reasoning", "summary": [], "content": []}
            return self._event("response.output_item.added", {**index, "item": item})
        item = {
            "id": self.item,
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._event("response.output_item.added", {**index, "item": item}) + self._event(
            "response.content_part.added", {**self._where(), "content_index": 0, "part": part}
        )

    def text(self, text: str) -> str:
        self.written += text
        data = {**self._where(), "content_index": 0, "delta": text, "logprobs": []}
        return self._event("response.output_text.delta", data)

    def thought(self, text: str) -> str:
        self.written += text
        return self._event(
            "response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": text}
        )

    def arguments(self, text: str) -> str:
        self.written += text
        return self._event("response.function_call_arguments.delta", {**self._where(), "delta": text})

    def close_block(self, kind: Kind, call: Call | None) -> str:
        where = self._where()
        if kind == "call":
            assert call is not None
            item = call_item(self.item, call)
            done = {**where, "name": call.name, "arguments": call.arguments}
            out = self._event("response.function_call_arguments.done", done)
        elif kind == "thought":
            item = thought_item(self.item, self.written)
            out = self._event(
                "response.reasoning_text.done", {**where, "content_index": 0, "text": self.written}
            )
        else:
            item = text_item(self.item, self.written)
            part = item["content"][0]
            out = self._event(
                "response.output_text.done",
                {**where, "content_index": 0, "text": self.written, "logprobs": []},
            )
            out += self._event("response.content_part.done", {**where, "content_index": 0, "part": part})
        out += self._event("response.output_item.done", {"output_index": len(self.items), "item": item})
        self.items.append(item)
        return out

    def finish(self, end: Ending) -> str:
        body = self.shape.body(self.items, end)
        name = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return self._event(name, {"response": body})

    def error(self, err: ApiError) -> str:
        # The `error` object as well: the openai client raises on a streamed event that has one.
        fields = {"code": err.code or err.type, "message": err.message, "param": err.param}
        return self._event("error", {**fields, "error": err.body()["error"]})
