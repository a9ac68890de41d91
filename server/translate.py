"""What Anthropic Messages and OpenAI Responses share on the way out: an answer written as a row of
blocks (Messages' content blocks, Responses' output items), streamed or whole, over the chat
path's job, scheduler run and answer reading. Each API subclasses `BlockWriter` with its own
event shapes; the driver here feeds it, counts the request and ends it as chat streaming does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Literal

from ballast.engine.interface import TokenizerLike
from ballast.scheduler.errors import Refused
from ballast.scheduler.request import FinishEvent, TokenEvent
from ballast.server import protocol as p
from ballast.server import replies
from ballast.server.answer import Answer, AnswerStream, read_whole
from ballast.server.completions import Job, built
from ballast.server.errors import ApiError
from ballast.server.intake import arrived_at
from ballast.server.parts import Call, CallArguments, CallClosed, CallOpened, Part, Text, Thought
from ballast.server.respond import Collected
from ballast.server.state import ServerState
from ballast.server.submit import Started, finish_outcome, refusal, refuse, start_unless_gone
from fastapi import Request

Kind = Literal["thought", "text", "call"]


@dataclass(frozen=True)
class Ending:
    """How an answer ended, in the terms both APIs need."""

    reason: Literal["stop", "length"]
    stop_string: str | None  # the stop sequence that ended it (None: EOS, or length)
    called: bool  # it holds tool calls
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def ending(
    job: Job, tokenizer: TokenizerLike, finish: FinishEvent, ids: list[int], text: str, called: bool
) -> Ending:
    stop = None
    eos: frozenset[int] = getattr(tokenizer, "eos_token_ids", frozenset())
    stops = job.gens[0].stop
    if finish.reason == "stop" and stops and not (ids and ids[-1] in eos):
        # The detokenizer cut the text at the first stop string the whole output holds.
        full = tokenizer.decode(ids)
        hits = sorted((full.find(s, max(0, len(text) - len(s))), s) for s in stops if s in full)
        stop = hits[0][1] if hits else stops[0]
    reason: Literal["stop", "length"] = "length" if finish.reason == "length" else "stop"
    return Ending(reason, stop, called, job.prompt_tokens, finish.completion_tokens, finish.cached_tokens)


def whole_answer(job: Job, result: Collected) -> Answer:
    return read_whole(job.reading, result.text, truncated=result.finish.reason == "length")


class BlockWriter:
    """Parts -> one API's events. At most one block is open; a part of another kind closes it."""

    def __init__(self) -> None:
        self.open_kind: Kind | None = None
        self.blocks = 0  # blocks opened so far (the index of the next one)
        self.call: CallOpened | None = None

    def parts(self, parts: list[Part]) -> str:
        out = ""
        for part in parts:
            if isinstance(part, Text | Thought):
                kind: Kind = "text" if isinstance(part, Text) else "thought"
                if self.open_kind != kind:
                    out += self._close(None) + self._open(kind)
                out += self.text(part.text) if kind == "text" else self.thought(part.text)
            elif isinstance(part, CallOpened):
                out += self._close(None)
                self.call = part
                out += self._open("call")
            elif isinstance(part, CallArguments):
                out += self.arguments(part.text)
            elif isinstance(part, CallClosed):
                out += self._close(part.call)
        return out

    def close(self) -> str:
        return self._close(None)

    def _open(self, kind: Kind) -> str:
        self.open_kind = kind
        out = self.open_block(kind)
        self.blocks += 1
        return out

    def _close(self, call: Call | None) -> str:
        if self.open_kind is None:
            return ""
        kind, self.open_kind = self.open_kind, None
        return self.close_block(kind, call)

    # --- what each API writes -----------------------------------------------------------------

    def start(self) -> str:
        raise NotImplementedError

    def open_block(self, kind: Kind) -> str:
        """`self.blocks` is the new block's index; for a call, `self.call` says which."""
        raise NotImplementedError

    def text(self, text: str) -> str:
        raise NotImplementedError

    def thought(self, text: str) -> str:
        raise NotImplementedError

    def arguments(self, text: str) -> str:
        raise NotImplementedError

    def close_block(self, kind: Kind, call: Call | None) -> str:
        raise NotImplementedError

    def finish(self, end: Ending) -> str:
        raise NotImplementedError

    def error(self, err: ApiError) -> str:
        raise NotImplementedError


async def stream_blocks(
    state: ServerState, job: Job, started: Started, writer: BlockWriter
) -> AsyncIterator[str]:
    """The events of one answer (one choice). A client that goes away aborts the request."""
    assert state.engine is not None
    tokenizer = state.engine.tokenizer
    run, timer = started.runs[0], started.timer
    answer = AnswerStream(job.reading)
    ids: list[int] = []
    texts: list[str] = []
    counted = False
    try:
        out = writer.start()
        event = run.first
        while isinstance(event, TokenEvent):
            timer.tokens(len(event.token_ids))
            ids += event.token_ids
            texts.append(event.text)
            out += writer.parts(answer.feed(event.text)) if event.text else ""
            if out:
                yield out
                out = ""
            event = await anext(run.events)
        counted = True
        timer.finished(finish_outcome(event), job.prompt_tokens, len(ids))
        if event.error is not None:
            yield out + writer.error(refuse(state, job, event.error, counted=True))
            return
        out += writer.parts(answer.finish(truncated=event.reason == "length")) + writer.close()
        end = ending(job, tokenizer, event, ids, "".join(texts), bool(answer.calls))
        yield out + writer.finish(end)
    finally:
        started.abort()  # no-op after a finish; frees the slot when the client went away
        if not counted:
            timer.finished("abort", job.prompt_tokens, len(ids))


async def start_chat(
    state: ServerState, translate: Callable[[], p.ChatCompletionRequest], request: Request
) -> tuple[Job, Started] | None:
    """Translate a request into a chat one, build its job (its prompt off the event loop)
    and start it; None when the client went away first. A request that cannot be translated or
    built counts as invalid."""
    arrived = arrived_at(request)
    try:
        req = translate()
        job = await built(state, req)
    except ApiError:
        state.metrics.requests.labels(endpoint="chat", outcome="invalid").inc()
        raise
    except Refused as exc:  # before its prompt was built (refuse_early)
        raise refusal(state, exc, replies.new_id("chatcmpl"), "chat", "messages", arrived) from exc
    job = replace(job, received_at=arrived)
    started = await start_unless_gone(state, job, request)
    return None if started is None else (job, started)
