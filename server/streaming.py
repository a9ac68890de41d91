"""Server-sent events for streaming completions, in OpenAI's chunk format.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. With
`stream_options.include_usage` every chunk carries `"usage": null` and one extra chunk with empty
`choices` and the usage comes last, as OpenAI does. An error after the stream began (a deadline,
an engine failure) is sent as `data: {"error": {...}}`, which the official client raises.

A client that disconnects cancels the response task (Starlette) or fails the next send; either way
the generator's `finally` aborts the request, so its slot is freed within one step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ballast.scheduler.request import FinishEvent, TokenEvent
from ballast.server import protocol as p
from ballast.server.completions import (
    Job,
    Started,
    chat_logprobs,
    completion_logprobs,
    finish_outcome,
    refuse,
)
from ballast.server.state import ServerState
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {_json(data)}\n\n"


class _ChunkWriter:
    """Builds the chunks of one response (chat or completion shape)."""

    def __init__(self, job: Job, state: ServerState) -> None:
        assert state.engine is not None
        self.job = job
        self.tokenizer = state.engine.tokenizer
        self.created = p.now()
        self.offset = 0  # text offset for completion logprobs
        # Most chunks carry only text. Render one through the models with a marker and keep the
        # halves around it: each later text chunk is head + JSON string + tail, the same bytes the
        # models give at a fraction of the cost (it was most of the server's time per token).
        marker = "\x00ballast-text\x00"
        head, tail = self._modelled_tokens(TokenEvent(marker, ())).split(_json(marker))
        self._text_head, self._text_tail = head, tail

    def _usage(self) -> dict[str, Any]:
        return {"usage": None} if self.job.include_usage else {}

    def role(self) -> str:
        delta = p.ChatDelta(role="assistant", content="")
        return self._chat(p.ChatChunkChoice(delta=delta))

    def _chat(self, choice: p.ChatChunkChoice, **extra: Any) -> str:
        chunk = p.ChatCompletionChunk(id=self.job.response_id, created=self.created, model=self.job.model, choices=[choice])
        data = chunk.model_dump(exclude={"usage"})
        return sse({**data, **self._usage(), **extra})

    def _completion(self, choice: p.CompletionChoice, **extra: Any) -> str:
        chunk = p.Completion(id=self.job.response_id, created=self.created, model=self.job.model, choices=[choice])
        data = chunk.model_dump(exclude={"usage"})
        return sse({**data, **self._usage(), **extra})

    def tokens(self, event: TokenEvent) -> str:
        if not self.job.want_logprobs:
            return self._text_head + _json(event.text) + self._text_tail
        return self._modelled_tokens(event)

    def _modelled_tokens(self, event: TokenEvent) -> str:
        entries = event.logprobs or ()
        if self.job.endpoint == "chat":
            lp = p.ChatLogprobs(content=chat_logprobs(self.tokenizer, entries)) if self.job.want_logprobs else None
            return self._chat(p.ChatChunkChoice(delta=p.ChatDelta(content=event.text), logprobs=lp))
        clp = completion_logprobs(self.tokenizer, entries, self.offset) if self.job.want_logprobs else None
        self.offset += len(event.text)
        return self._completion(p.CompletionChoice(text=event.text, logprobs=clp, finish_reason=None))

    def finish(self, event: FinishEvent) -> str:
        extra = {"x_ballast_capped": True} if event.capped else {}
        if self.job.endpoint == "chat":
            return self._chat(p.ChatChunkChoice(delta=p.ChatDelta(), finish_reason=event.reason), **extra)
        return self._completion(p.CompletionChoice(text="", finish_reason=event.reason), **extra)

    def usage(self, event: FinishEvent) -> str:
        usage = p.Usage.of(event.prompt_tokens, event.completion_tokens, event.cached_tokens).model_dump()
        obj = "chat.completion.chunk" if self.job.endpoint == "chat" else "text_completion"
        return sse({"id": self.job.response_id, "object": obj, "created": self.created, "model": self.job.model, "choices": [], "usage": usage})


async def _events(state: ServerState, job: Job, started: Started) -> AsyncIterator[str]:
    writer = _ChunkWriter(job, state)
    handle, timer = started.handle, started.timer
    try:
        if job.endpoint == "chat":
            yield writer.role()
        event = started.first
        while isinstance(event, TokenEvent):
            timer.tokens(len(event.token_ids))
            if event.text or event.logprobs:  # "" while a stop-string prefix is held back
                yield writer.tokens(event)
            event = await anext(started.events)
        timer.finished(finish_outcome(event), event.prompt_tokens, event.completion_tokens)
        if event.error is not None:
            yield sse(refuse(state, job, event.error, counted=True).body())
            return
        yield writer.finish(event)
        if job.include_usage:
            yield writer.usage(event)
        yield DONE
    finally:
        handle.abort()  # no-op after a finish; frees the slot when the client went away
        # A client that went away mid-stream is counted as an abort (a no-op after a finish).
        timer.finished("abort", len(job.gen.prompt_ids), timer.generated)


def stream_response(state: ServerState, job: Job, started: Started) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_events(state, job, started), media_type="text/event-stream", headers=headers)
