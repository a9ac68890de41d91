"""A whole (non-streaming) answer: every choice collected, tool calls read out, logprobs shaped
for the client. The logprob helpers serve the streaming chunks too."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ballast.engine.interface import TokenizerLike
from ballast.scheduler.request import FinishEvent, TokenEvent, TokenLogprob
from ballast.server import replies
from ballast.server.answer import Answer, read_whole
from ballast.server.completions import CAPPED_HEADER, Job
from ballast.server.metrics import RequestTimer
from ballast.server.parts import Call
from ballast.server.state import ServerState
from ballast.server.submit import Run, Started, abort_on_disconnect, finish_outcome, refuse
from fastapi import Request
from fastapi.responses import JSONResponse, Response


def token_text(tokenizer: TokenizerLike, token_id: int) -> str:
    """A token as text; a token holding part of a UTF-8 character shows its bytes as \\xNN."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="backslashreplace")


def _top(tokenizer: TokenizerLike, token_id: int, logprob: float) -> replies.TopLogprob:
    raw = tokenizer.token_bytes(token_id)
    return replies.TopLogprob(
        token=raw.decode("utf-8", errors="backslashreplace"), logprob=logprob, bytes=list(raw)
    )


def chat_logprobs(
    tokenizer: TokenizerLike, entries: tuple[TokenLogprob, ...]
) -> list[replies.ChatTokenLogprob]:
    out = []
    for e in entries:
        chosen = _top(tokenizer, e.token_id, e.logprob)
        top = [_top(tokenizer, tid, lp) for tid, lp in e.top]
        out.append(
            replies.ChatTokenLogprob(
                token=chosen.token, logprob=e.logprob, bytes=chosen.bytes, top_logprobs=top
            )
        )
    return out


def completion_logprobs(
    tokenizer: TokenizerLike, entries: tuple[TokenLogprob, ...], offset: int
) -> replies.CompletionLogprobs:
    out = replies.CompletionLogprobs()
    for e in entries:
        text = token_text(tokenizer, e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({token_text(tokenizer, tid): lp for tid, lp in e.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_logprobs(
    tokenizer: TokenizerLike, prompt_ids: tuple[int, ...], scored: tuple[TokenLogprob, ...]
) -> replies.CompletionLogprobs:
    """An echoed prompt's logprobs, as the legacy completions API gives them: its first token has
    none (nothing predicts it), every later one the model's logprob given the tokens before it."""
    out = replies.CompletionLogprobs()
    first = token_text(tokenizer, prompt_ids[0])
    out.tokens.append(first)
    out.token_logprobs.append(None)
    out.top_logprobs.append(None)
    out.text_offset.append(0)
    rest = completion_logprobs(tokenizer, scored, len(first))
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, name).extend(getattr(rest, name))
    return out


@dataclass(frozen=True)
class Collected:
    text: str
    entries: tuple[TokenLogprob, ...]
    finish: FinishEvent
    token_ids: list[int]  # every token generated, an ending EOS included


async def _collect(run: Run, timer: RequestTimer) -> Collected:
    texts: list[str] = []
    entries: list[TokenLogprob] = []
    ids: list[int] = []
    event = run.first
    while isinstance(event, TokenEvent):
        texts.append(event.text)
        entries.extend(event.logprobs or ())
        timer.tokens(len(event.token_ids))
        ids += event.token_ids
        event = await anext(run.events)
    return Collected("".join(texts), tuple(entries), event, ids)


async def collect_all(state: ServerState, job: Job, started: Started, request: Request) -> list[Collected]:
    """Every choice, whole, counted; a refusal that ended any raises (as an ApiError)."""
    watcher = asyncio.create_task(abort_on_disconnect(request, started))
    try:
        results = [await _collect(run, started.timer) for run in started.runs]
    finally:
        watcher.cancel()
        started.abort()
    finishes = [r.finish for r in results]
    failed = next((f for f in finishes if f.error is not None), None)
    completion_tokens = sum(f.completion_tokens for f in finishes)
    started.timer.finished(finish_outcome(failed or finishes[0]), job.prompt_tokens, completion_tokens)
    if failed is not None and failed.error is not None:
        raise refuse(state, job, failed.error, counted=True)
    return results


async def respond(state: ServerState, job: Job, started: Started, request: Request) -> Response:
    """Collect every choice (non-streaming)."""
    assert state.engine is not None
    tokenizer = state.engine.tokenizer
    results = await collect_all(state, job, started, request)
    finishes = [r.finish for r in results]
    completion_tokens = sum(f.completion_tokens for f in finishes)
    cached = sum(f.cached_tokens for f in finishes[:: job.n])
    usage = replies.Usage.of(job.prompt_tokens, completion_tokens, cached)
    body: replies.ChatCompletion | replies.Completion
    if job.endpoint == "chat":
        choices = [_chat_choice(tokenizer, job, i, r) for i, r in enumerate(results)]
        body = replies.ChatCompletion(
            id=job.response_id, created=replies.now(), model=job.model, choices=choices, usage=usage
        )
    else:
        cchoices = [_completion_choice(tokenizer, job, i, r) for i, r in enumerate(results)]
        body = replies.Completion(
            id=job.response_id, created=replies.now(), model=job.model, choices=cchoices, usage=usage
        )
    headers = {CAPPED_HEADER: "1"} if any(f.capped for f in finishes) else {}
    return JSONResponse(body.model_dump(), headers=headers)


def _chat_choice(tokenizer: TokenizerLike, job: Job, index: int, result: Collected) -> replies.ChatChoice:
    lp = replies.ChatLogprobs(content=chat_logprobs(tokenizer, result.entries)) if job.want_logprobs else None
    if job.reading.plain:
        answer = Answer(None, result.text, [])
    else:
        answer = read_whole(job.reading, result.text, truncated=result.finish.reason == "length")
    calls = answer.calls
    message = replies.AssistantMessage(
        content=answer.content,
        reasoning_content=answer.reasoning,
        reasoning=answer.reasoning,
        tool_calls=[response_call(c) for c in calls] or None,
    )
    reason = "tool_calls" if calls and result.finish.reason == "stop" else result.finish.reason
    return replies.ChatChoice(index=index, message=message, logprobs=lp, finish_reason=reason)


def _completion_choice(
    tokenizer: TokenizerLike, job: Job, index: int, result: Collected
) -> replies.CompletionChoice:
    echo = job.echo[index] if job.echo else ""
    clp = None
    if job.want_logprobs:
        scored = result.finish.prompt_logprobs
        if echo and scored is not None:  # the prompt's own tokens first, then the answer's
            clp = prompt_logprobs(tokenizer, job.gens[index].prompt_ids, scored)
            generated = completion_logprobs(tokenizer, result.entries, len(echo))
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(clp, name).extend(getattr(generated, name))
        else:
            clp = completion_logprobs(tokenizer, result.entries, 0)
    return replies.CompletionChoice(
        index=index, text=echo + result.text, logprobs=clp, finish_reason=result.finish.reason
    )


def response_call(call: Call) -> replies.ResponseToolCall:
    return replies.ResponseToolCall(
        id=call.id, function=replies.ResponseFunction(name=call.name, arguments=call.arguments)
    )
