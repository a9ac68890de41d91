"""POST /v1/completions and /v1/chat/completions: request -> `GenerationRequest` -> response.

Both endpoints share one flow: validate what pydantic cannot (model name, unsupported options),
tokenize, submit to the scheduler (a refusal raises here, before any byte is sent), wait for the
first event (a request refused while queued still gets a proper 503, not a broken stream), then
either collect the whole answer or stream it (`ballast.server.streaming`).

A CAP verdict (admission shortened the request's window to fit memory) ends the request with
finish_reason "length" and, on non-streaming responses, the header `X-Ballast-Capped: 1`; a stream
says it in its last chunk as `"x_ballast_capped": true`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, cast

from ballast.engine.interface import TokenizerLike
from ballast.engine.plan import SamplingParams
from ballast.engine.tokenizer import Tokenizer
from ballast.scheduler.errors import EngineFailed, Refused, outcome_of
from ballast.scheduler.request import (
    Event,
    FinishEvent,
    GenerationRequest,
    RequestHandle,
    TokenEvent,
    TokenLogprob,
)
from ballast.server import protocol as p
from ballast.server.errors import ApiError, bad_request, from_refusal
from ballast.server.events import request_accepted, request_refused
from ballast.server.metrics import RequestTimer
from ballast.server.state import ServerState
from fastapi import Request
from fastapi.responses import JSONResponse, Response

Endpoint = Literal["chat", "completion"]
CAPPED_HEADER = "X-Ballast-Capped"


@dataclass(frozen=True)
class Job:
    """One validated generation request and how to answer it."""

    endpoint: Endpoint
    response_id: str
    model: str
    gen: GenerationRequest
    stream: bool
    include_usage: bool
    want_logprobs: bool
    prompt_param: str  # the parameter a context-length error names


def _check_model(state: ServerState, requested: str) -> str:
    name = state.model_name
    if name is None:
        raise ApiError(503, "the model is still loading", "server_overloaded", code="model_loading", headers={"Retry-After": "1"})
    if requested != name and requested not in state.model_aliases:
        raise ApiError(404, f"The model `{requested}` does not exist; this server serves `{name}`", param="model", code="model_not_found")
    return name


def _sampling(req: p.GenerationFields, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            seed=req.seed,
            repetition_penalty=req.repetition_penalty or 1.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            logprobs=logprobs,
        )
    except ValueError as exc:  # a combination pydantic's per-field checks let through
        raise bad_request(str(exc)) from exc


def _max_tokens(asked: int | None, prompt_len: int, max_model_len: int) -> int:
    # Unset: whatever is left of the context. Never below 1, so a prompt that fills the context is
    # refused by the scheduler's one context check (ContextTooLong), not by a second one here.
    return asked if asked is not None else max(1, max_model_len - prompt_len)


def _common_checks(req: p.GenerationFields) -> None:
    if req.n != 1:
        raise bad_request("only n=1 is supported", param="n")


def _ready_engine(state: ServerState) -> tuple[TokenizerLike, int]:
    """The tokenizer and the context window a request may fill (prompt + new tokens)."""
    if state.engine is None or state.scheduler is None:
        raise ApiError(503, "the model is still loading", "server_overloaded", code="model_loading", headers={"Retry-After": "1"})
    return state.engine.tokenizer, state.context_window


def _check_token_ids(tokenizer: TokenizerLike, ids: list[int]) -> None:
    """A client's token ids reach the embedding as they are; one out of range would fail the step
    and with it the whole engine, so it is refused here as bad input. The protocol states no
    vocabulary size, so the bound comes from the real tokenizer when it is one."""
    limit = tokenizer.vocab_size if isinstance(tokenizer, Tokenizer) else None
    bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
    if bad:
        accepted = f"0..{limit - 1}" if limit is not None else ">= 0"
        raise bad_request(f"token id {bad[0]} is outside the vocabulary ({accepted})", param="prompt")


def _prompt_ids(tokenizer: TokenizerLike, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    """Token ids of a completion prompt: text, token ids, or a batch of one of either."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not prompt:
        return []
    first = prompt[0]
    if not isinstance(first, int) and len(prompt) != 1:
        raise bad_request("a list of several prompts is not supported; send one request per prompt", param="prompt")
    if isinstance(first, str):
        return tokenizer.encode(first)
    # pydantic made the list homogeneous: ids, or one list of ids
    ids = list(first) if isinstance(first, list) else cast(list[int], prompt)
    _check_token_ids(tokenizer, ids)
    return ids


def completion_job(state: ServerState, req: p.CompletionRequest) -> Job:
    model = _check_model(state, req.model)
    tokenizer, max_len = _ready_engine(state)
    _common_checks(req)
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", param="best_of")
    ids = _prompt_ids(tokenizer, req.prompt)
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    gen = _generation(p.new_id("cmpl"), ids, req, req.max_tokens, max_len, req.logprobs)
    return Job("completion", gen.request_id, model, gen, req.stream, _usage(req), req.logprobs is not None, "prompt")


def chat_job(state: ServerState, req: p.ChatCompletionRequest) -> Job:
    model = _check_model(state, req.model)
    tokenizer, max_len = _ready_engine(state)
    _common_checks(req)
    if req.tools:
        raise bad_request("tools are not supported", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format type 'text' is supported", param="response_format")
    ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages])
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    gen = _generation(p.new_id("chatcmpl"), ids, req, asked, max_len, top)
    return Job("chat", gen.request_id, model, gen, req.stream, _usage(req), req.logprobs, "messages")


def _usage(req: p.GenerationFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _generation(rid: str, ids: list[int], req: p.GenerationFields, asked: int | None, max_len: int, logprobs: int | None) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_ids=tuple(ids),
        params=_sampling(req, logprobs),
        max_tokens=_max_tokens(asked, len(ids), max_len),
        stop=req.stop_strings(),
    )


def refuse(state: ServerState, job: Job, exc: Refused, *, counted: bool = False) -> ApiError:
    """Map a refusal for the client, mark the server unsound if the engine failed, and count it
    (unless the request's timer already did, for an error that ended a running request)."""
    if isinstance(exc, EngineFailed):
        state.fail(str(exc))
    err = from_refusal(exc, job.prompt_param)
    request_refused(job.response_id, job.endpoint, err.status, err.code, str(exc))
    if not counted:
        state.metrics.refused(job.endpoint, err.status, outcome_of(exc))
    return err


def finish_outcome(finish: FinishEvent) -> str:
    """The metrics label of a finished request: its reason, or the refusal that ended it."""
    return finish.reason if finish.error is None else outcome_of(finish.error)


@dataclass(frozen=True)
class Started:
    """A submitted request whose first event has arrived."""

    handle: RequestHandle
    events: AsyncIterator[Event]  # the one iterator over the handle's mailbox
    first: Event
    timer: RequestTimer


async def start(state: ServerState, job: Job) -> Started:
    """Submit and wait for the first event; a refusal (now or while queued) raises an ApiError."""
    assert state.scheduler is not None
    timer = RequestTimer(state.metrics, job.endpoint, job.response_id)
    if state.engine is not None:
        request_accepted(job.endpoint, job.gen, state.engine.tokenizer, state.config.log_prompts)
    try:
        handle = state.scheduler.submit(job.gen)
    except Refused as exc:
        raise refuse(state, job, exc) from exc
    events = aiter(handle)
    try:
        first = await anext(events)
    except BaseException:
        handle.abort()  # cancelled while waiting (client gone, server stopping): free the slot
        raise
    if isinstance(first, FinishEvent) and first.error is not None:
        raise refuse(state, job, first.error)
    return Started(handle, events, first, timer)


async def abort_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """The body has been read, so the next ASGI message is the client going away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.abort()
            return


def token_text(tokenizer: TokenizerLike, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer: TokenizerLike, entries: tuple[TokenLogprob, ...]) -> list[p.ChatTokenLogprob]:
    out = []
    for e in entries:
        text = token_text(tokenizer, e.token_id)
        top = [p.TopLogprob(token=(t := token_text(tokenizer, tid)), logprob=lp, bytes=list(t.encode())) for tid, lp in e.top]
        out.append(p.ChatTokenLogprob(token=text, logprob=e.logprob, bytes=list(text.encode()), top_logprobs=top))
    return out


def completion_logprobs(tokenizer: TokenizerLike, entries: tuple[TokenLogprob, ...], offset: int) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    for e in entries:
        text = token_text(tokenizer, e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({token_text(tokenizer, tid): lp for tid, lp in e.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


async def respond(state: ServerState, job: Job, started: Started, request: Request) -> Response:
    """Collect the whole answer (non-streaming)."""
    assert state.engine is not None
    tokenizer = state.engine.tokenizer
    handle, timer = started.handle, started.timer
    watcher = asyncio.create_task(abort_on_disconnect(request, handle))
    texts: list[str] = []
    entries: list[TokenLogprob] = []
    try:
        event = started.first
        while isinstance(event, TokenEvent):
            texts.append(event.text)
            entries.extend(event.logprobs or ())
            timer.tokens(len(event.token_ids))
            event = await anext(started.events)
    finally:
        watcher.cancel()
        handle.abort()
    finish = event
    timer.finished(finish_outcome(finish), finish.prompt_tokens, finish.completion_tokens)
    if finish.error is not None:
        raise refuse(state, job, finish.error, counted=True)
    text = "".join(texts)
    usage = p.Usage.of(finish.prompt_tokens, finish.completion_tokens, finish.cached_tokens)
    body: p.ChatCompletion | p.Completion
    if job.endpoint == "chat":
        lp = p.ChatLogprobs(content=chat_logprobs(tokenizer, tuple(entries))) if job.want_logprobs else None
        choice = p.ChatChoice(message=p.AssistantMessage(content=text), logprobs=lp, finish_reason=finish.reason)
        body = p.ChatCompletion(id=job.response_id, created=p.now(), model=job.model, choices=[choice], usage=usage)
    else:
        clp = completion_logprobs(tokenizer, tuple(entries), 0) if job.want_logprobs else None
        cchoice = p.CompletionChoice(text=text, logprobs=clp, finish_reason=finish.reason)
        body = p.Completion(id=job.response_id, created=p.now(), model=job.model, choices=[cchoice], usage=usage)
    headers = {CAPPED_HEADER: "1"} if finish.capped else {}
    return JSONResponse(body.model_dump(), headers=headers)
