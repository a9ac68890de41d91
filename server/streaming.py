"""Server-sent events for streaming completions, in OpenAI's chunk format.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. With
`stream_options.include_usage` every chunk carries `"usage": null` and one extra chunk with empty
`choices` and the usage comes last, as OpenAI does. An error after the stream began (a deadline,
an engine failure) is sent as `data: {"error": {...}}`, which the official client raises.

A client that disconnects cancels the response task (Starlette) or fails the next send; either way
the generator's `finally` aborts the request, so its slot is freed within one step, and counts it
with outcome "abort" in the request counter and the latency histograms.

A chat answer with something to read out of it (tools, thinking) streams through an
`AnswerStream`: content and reasoning deltas as they come, text that may open a tag held back,
each call opened by a delta naming it and then its arguments as they are generated.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from ballast.scheduler.request import Event, FinishEvent, TokenEvent, TokenLogprob
from ballast.server import replies
from ballast.server.answer import AnswerStream
from ballast.server.completions import Job
from ballast.server.parts import CallArguments, CallOpened, Part, Text, Thought
from ballast.server.respond import chat_logprobs, completion_logprobs
from ballast.server.state import ServerState
from ballast.server.submit import Run, Started, finish_outcome, refuse
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {_json(data)}\n\n"


class _ChunkWriter:
    """Builds the chunks of one choice of a response (chat or completion shape)."""

    def __init__(self, job: Job, state: ServerState, index: int = 0, created: int | None = None) -> None:
        assert state.engine is not None
        self.job = job
        self.index = index
        self.tokenizer = state.engine.tokenizer
        self.created = replies.now() if created is None else created
        self.offset = 0  # text offset for completion logprobs
        # Most chunks carry only text. Render one through the models with a marker and keep the
        # halves around it: each later text chunk is head + JSON string + tail, the same bytes the
        # models give at a fraction of the cost (it was most of the server's time per token).
        marker = "\x00ballast-text\x00"
        head, tail = self._modelled_tokens(TokenEvent(marker, ())).split(_json(marker))
        self._text_head, self._text_tail = head, tail
        self.answer = AnswerStream(job.reading) if job.endpoint == "chat" and not job.reading.plain else None

    def _usage(self) -> dict[str, Any]:
        return {"usage": None} if self.job.include_usage else {}

    def role(self) -> str:
        delta = replies.ChatDelta(role="assistant", content="")
        return self._chat(replies.ChatChunkChoice(index=self.index, delta=delta))

    def _chat(self, choice: replies.ChatChunkChoice, **extra: Any) -> str:
        chunk = replies.ChatCompletionChunk(
            id=self.job.response_id, created=self.created, model=self.job.model, choices=[choice]
        )
        data = chunk.model_dump(exclude={"usage"})
        return sse({**data, **self._usage(), **extra})

    def _completion(self, choice: replies.CompletionChoice, **extra: Any) -> str:
        chunk = replies.Completion(
            id=self.job.response_id, created=self.created, model=self.job.model, choices=[choice]
        )
        data = chunk.model_dump(exclude={"usage"})
        return sse({**data, **self._usage(), **extra})

    def tokens(self, event: TokenEvent) -> str:
        if self.answer is not None:
            return self._parts(self.answer.feed(event.text), event.logprobs)
        if not self.job.want_logprobs:
            return self._text_head + _json(event.text) + self._text_tail
        return self._modelled_tokens(event)

    def _parts(self, parts: list[Part], logprobs: tuple[TokenLogprob, ...] | None = None) -> str:
        """A chunk per part; the tokens' logprobs ride on the first (or on an empty one)."""
        lp = None
        if self.job.want_logprobs and logprobs:
            lp = replies.ChatLogprobs(content=chat_logprobs(self.tokenizer, logprobs))
        out = ""
        for part in parts:
            delta = _delta(part)
            if delta is not None:
                out += self._chat(replies.ChatChunkChoice(index=self.index, delta=delta, logprobs=lp))
                lp = None
        if lp is not None:
            out += self._chat(
                replies.ChatChunkChoice(index=self.index, delta=replies.ChatDelta(content=""), logprobs=lp)
            )
        return out

    def _modelled_tokens(self, event: TokenEvent) -> str:
        entries = event.logprobs or ()
        if self.job.endpoint == "chat":
            lp = (
                replies.ChatLogprobs(content=chat_logprobs(self.tokenizer, entries))
                if self.job.want_logprobs
                else None
            )
            return self._chat(
                replies.ChatChunkChoice(
                    index=self.index, delta=replies.ChatDelta(content=event.text), logprobs=lp
                )
            )
        clp = completion_logprobs(self.tokenizer, entries, self.offset) if self.job.want_logprobs else None
        self.offset += len(event.text)
        return self._completion(
            replies.CompletionChoice(index=self.index, text=event.text, logprobs=clp, finish_reason=None)
        )

    def finish(self, event: FinishEvent) -> str:
        extra = {"x_ballast_capped": True} if event.capped else {}
        if self.job.endpoint == "chat":
            held, reason = "", str(event.reason)  # a chat may also end in "tool_calls"
            if self.answer is not None:
                held = self._parts(self.answer.finish(truncated=reason == "length"))
                reason = "tool_calls" if self.answer.calls and reason == "stop" else reason
            last = self._chat(
                replies.ChatChunkChoice(index=self.index, delta=replies.ChatDelta(), finish_reason=reason),
                **extra,
            )
            return held + last
        return self._completion(
            replies.CompletionChoice(index=self.index, text="", finish_reason=event.reason), **extra
        )

    def echo(self) -> str:
        """Completions' echo: the prompt's text, before the first generated text."""
        text = self.job.echo[self.index] if self.job.echo else ""
        if not text:
            return ""
        self.offset += len(text)
        return self._completion(replies.CompletionChoice(index=self.index, text=text, finish_reason=None))

    def usage(self, finishes: list[FinishEvent]) -> str:
        completion = sum(f.completion_tokens for f in finishes)
        cached = sum(f.cached_tokens for f in finishes[:: self.job.n])
        usage = replies.Usage.of(self.job.prompt_tokens, completion, cached).model_dump()
        obj = "chat.completion.chunk" if self.job.endpoint == "chat" else "text_completion"
        return sse(
            {
                "id": self.job.response_id,
                "object": obj,
                "created": self.created,
                "model": self.job.model,
                "choices": [],
                "usage": usage,
            }
        )


def _delta(part: Part) -> replies.ChatDelta | None:
    if isinstance(part, Text):
        return replies.ChatDelta(content=part.text)
    if isinstance(part, Thought):
        return replies.ChatDelta(reasoning=part.text, reasoning_content=part.text)
    if isinstance(part, CallOpened):
        named = replies.DeltaToolCall(
            index=part.index, id=part.id, type="function", function=replies.DeltaFunction(name=part.name)
        )
        return replies.ChatDelta(tool_calls=[named])
    if isinstance(part, CallArguments):
        piece = replies.DeltaToolCall(index=part.index, function=replies.DeltaFunction(arguments=part.text))
        return replies.ChatDelta(tool_calls=[piece])
    return None  # CallClosed: the client has the whole call by now


async def _merged(runs: tuple[Run, ...]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of every run as they arrive; each run's first event comes first. One
    run is read directly (the common case, no task per token)."""
    for i, run in enumerate(runs):
        yield i, run.first
    if len(runs) == 1:
        event = runs[0].first
        while isinstance(event, TokenEvent):
            event = await anext(runs[0].events)
            yield 0, event
        return
    pending = {
        asyncio.ensure_future(anext(run.events)): i
        for i, run in enumerate(runs)
        if isinstance(run.first, TokenEvent)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                event = task.result()
                if isinstance(event, TokenEvent):
                    pending[asyncio.ensure_future(anext(runs[i].events))] = i
                yield i, event
    finally:
        for task in pending:
            task.cancel()


async def _events(state: ServerState, job: Job, started: Started) -> AsyncIterator[str]:
    created = replies.now()
    writers = [_ChunkWriter(job, state, i, created) for i in range(len(started.runs))]
    timer = started.timer
    generated = 0
    counted = False
    finishes: dict[int, FinishEvent] = {}
    try:
        # The openings (chat's role chunks, completions' echo) go out in one write with the first
        # token's chunk: every first event is already here, so nothing waits for them, and the
        # client reads the answer's start in one piece.
        pending = "".join(writer.role() if job.endpoint == "chat" else writer.echo() for writer in writers)
        async for i, event in _merged(started.runs):
            if isinstance(event, TokenEvent):
                timer.tokens(len(event.token_ids))
                generated += len(event.token_ids)
                if event.text or event.logprobs:  # "" while a stop-string prefix is held back
                    pending += writers[i].tokens(event)
                if pending:
                    yield pending
                    pending = ""
                continue
            if pending:
                yield pending
                pending = ""
            if event.error is not None:
                counted = True
                timer.finished(finish_outcome(event), job.prompt_tokens, generated)
                yield sse(refuse(state, job, event.error, counted=True).body())
                return
            finishes[i] = event
            yield writers[i].finish(event)
        ordered = [finishes[i] for i in range(len(writers))]
        counted = True
        timer.finished(
            finish_outcome(ordered[0]), job.prompt_tokens, sum(f.completion_tokens for f in ordered)
        )
        if job.include_usage:
            yield writers[0].usage(ordered)
        yield DONE
    finally:
        started.abort()  # no-op after a finish; frees the slots when the client went away
        if not counted:  # the client went away before the finish
            timer.finished("abort", job.prompt_tokens, generated)


def stream_response(state: ServerState, job: Job, started: Started) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_events(state, job, started), media_type="text/event-stream", headers=headers)
