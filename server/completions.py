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

from ballast.engine.engine import Engine
from ballast.engine.grammar import Constraint
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
from ballast.server import chat
from ballast.server import protocol as p
from ballast.server.errors import ApiError, bad_request, from_refusal
from ballast.server.metrics import RequestTimer
from ballast.server.state import ServerState
from ballast.server.toolcalls import Call, parse
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
    tools: chat.ToolPlan | None = None  # read tool calls out of the answer


def check_model(state: ServerState, requested: str) -> str:
    name = state.model_name
    if name is None:
        raise ApiError(503, "the model is still loading", "server_overloaded", code="model_loading", headers={"Retry-After": "1"})
    if requested != name and requested not in state.model_aliases:
        raise ApiError(404, f"The model `{requested}` does not exist; this server serves `{name}`", param="model", code="model_not_found")
    return name


def _logit_bias(tokenizer: TokenizerLike, req: p.GenerationFields) -> tuple[tuple[int, float], ...]:
    if not req.logit_bias:
        return ()
    try:
        bias = tuple((int(token), float(value)) for token, value in req.logit_bias.items())
    except ValueError as exc:
        raise bad_request("logit_bias keys must be token ids", param="logit_bias") from exc
    check_token_ids(tokenizer, [t for t, _ in bias], "logit_bias")
    return bias


def sampling_defaults(state: ServerState) -> dict[str, float]:
    """What the model's makers sample with, for the values a request omits."""
    return state.engine.sampling_defaults if isinstance(state.engine, Engine) else {}


def _sampling(req: p.GenerationFields, defaults: dict[str, float], logprobs: int | None,
              bias: tuple[tuple[int, float], ...] = (), constraint: Constraint | None = None) -> SamplingParams:
    def pick(asked: float | None, name: str, plain: float) -> float:
        return asked if asked is not None else defaults.get(name, plain)

    try:
        return SamplingParams(
            temperature=pick(req.temperature, "temperature", 1.0),
            top_p=pick(req.top_p, "top_p", 1.0),
            top_k=max(0, int(pick(req.top_k, "top_k", 0))),
            min_p=pick(req.min_p, "min_p", 0.0),
            seed=req.seed,
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            logprobs=logprobs,
            logit_bias=bias,
            constraint=constraint,
        )
    except ValueError as exc:  # a combination pydantic's per-field checks let through
        raise bad_request(str(exc)) from exc


def _max_tokens(asked: int | None, prompt_len: int, max_model_len: int) -> int:
    # Unset: whatever is left of the context. Never below 1, so a prompt that fills the context is
    # refused by the scheduler's one context check (ContextTooLong), not by a second one here.
    return asked if asked is not None else max(1, max_model_len - prompt_len)


def _common_checks(req: p.GenerationFields) -> None:
    refused = req.refused_field()
    if refused is not None:
        raise bad_request(refused[1], param=refused[0], code="unsupported_parameter")
    if req.n != 1:
        raise bad_request("only n=1 is supported", param="n")


def ready_engine(state: ServerState) -> tuple[TokenizerLike, int]:
    """The tokenizer and the context window a request may fill (prompt + new tokens)."""
    if state.engine is None or state.scheduler is None:
        raise ApiError(503, "the model is still loading", "server_overloaded", code="model_loading", headers={"Retry-After": "1"})
    return state.engine.tokenizer, state.context_window


def check_token_ids(tokenizer: TokenizerLike, ids: list[int], param: str = "prompt") -> None:
    """A client's token ids reach the embedding as they are; one out of range would fail the step
    and with it the whole engine, so it is refused here as bad input. The protocol states no
    vocabulary size, so the bound comes from the real tokenizer when it is one."""
    limit = tokenizer.vocab_size if isinstance(tokenizer, Tokenizer) else None
    bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
    if bad:
        accepted = f"0..{limit - 1}" if limit is not None else ">= 0"
        raise bad_request(f"token id {bad[0]} is outside the vocabulary ({accepted})", param=param)


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
    check_token_ids(tokenizer, ids)
    return ids


def completion_job(state: ServerState, req: p.CompletionRequest) -> Job:
    model = check_model(state, req.model)
    tokenizer, max_len = ready_engine(state)
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
    params = _sampling(req, sampling_defaults(state), req.logprobs, _logit_bias(tokenizer, req))
    gen = _generation(p.new_id("cmpl"), ids, req, params, req.max_tokens, max_len)
    return Job("completion", gen.request_id, model, gen, req.stream, _usage(req), req.logprobs is not None, "prompt")


def chat_job(state: ServerState, req: p.ChatCompletionRequest) -> Job:
    model = check_model(state, req.model)
    tokenizer, max_len = ready_engine(state)
    _common_checks(req)
    chat.check_tools(req)
    ids = chat.chat_prompt(state, tokenizer, req)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(req, sampling_defaults(state), top, _logit_bias(tokenizer, req), chat.constraint(state, req, len(ids)))
    gen = _generation(p.new_id("chatcmpl"), ids, req, params, asked, max_len)
    return Job("chat", gen.request_id, model, gen, req.stream, _usage(req), req.logprobs, "messages", chat.tool_plan(req))


def _usage(req: p.GenerationFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _generation(rid: str, ids: list[int], req: p.GenerationFields, params: SamplingParams, asked: int | None,
                max_len: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_ids=tuple(ids),
        params=params,
        max_tokens=_max_tokens(asked, len(ids), max_len),
        stop=req.stop_strings(),
    )


def refuse(state: ServerState, job: Job, exc: Refused, *, counted: bool = False) -> ApiError:
    """Map a refusal for the client, mark the server unsound if the engine failed, and count it
    (unless the request's timer already did, for an error that ended a running request)."""
    if isinstance(exc, EngineFailed):
        state.fail(str(exc))
    err = from_refusal(exc, job.prompt_param)
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
    timer = RequestTimer(state.metrics, job.endpoint)
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
    """A token as text; a token holding part of a UTF-8 character shows its bytes as \\xNN."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="backslashreplace")


def _top(tokenizer: TokenizerLike, token_id: int, logprob: float) -> p.TopLogprob:
    raw = tokenizer.token_bytes(token_id)
    return p.TopLogprob(token=raw.decode("utf-8", errors="backslashreplace"), logprob=logprob, bytes=list(raw))


def chat_logprobs(tokenizer: TokenizerLike, entries: tuple[TokenLogprob, ...]) -> list[p.ChatTokenLogprob]:
    out = []
    for e in entries:
        chosen = _top(tokenizer, e.token_id, e.logprob)
        top = [_top(tokenizer, tid, lp) for tid, lp in e.top]
        out.append(p.ChatTokenLogprob(token=chosen.token, logprob=e.logprob, bytes=chosen.bytes, top_logprobs=top))
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


def response_call(call: Call) -> p.ResponseToolCall:
    return p.ResponseToolCall(id=call.id, function=p.ResponseFunction(name=call.name, arguments=call.arguments))


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
        content, calls = parse(text, job.tools.schemas) if job.tools is not None else (text, [])
        calls = calls[: job.tools.max_calls] if job.tools is not None and job.tools.max_calls else calls
        message = p.AssistantMessage(content=content, tool_calls=[response_call(c) for c in calls] or None)
        reason = "tool_calls" if calls and finish.reason == "stop" else finish.reason
        choice = p.ChatChoice(message=message, logprobs=lp, finish_reason=reason)
        body = p.ChatCompletion(id=job.response_id, created=p.now(), model=job.model, choices=[choice], usage=usage)
    else:
        clp = completion_logprobs(tokenizer, tuple(entries), 0) if job.want_logprobs else None
        cchoice = p.CompletionChoice(text=text, logprobs=clp, finish_reason=finish.reason)
        body = p.Completion(id=job.response_id, created=p.now(), model=job.model, choices=[cchoice], usage=usage)
    headers = {CAPPED_HEADER: "1"} if finish.capped else {}
    return JSONResponse(body.model_dump(), headers=headers)
