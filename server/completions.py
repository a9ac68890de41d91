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
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, cast

from ballast.engine.interface import TokenizerLike
from ballast.engine.plan import SamplingParams
from ballast.engine.text.grammar import Constraint
from ballast.engine.text.tokenizer import Tokenizer
from ballast.scheduler.errors import ContextTooLong
from ballast.scheduler.request import (
    GenerationRequest,
)
from ballast.server import chat, replies
from ballast.server import protocol as p
from ballast.server.answer import Reading
from ballast.server.errors import ApiError, bad_request, from_refusal
from ballast.server.state import ServerState

Endpoint = Literal["chat", "completion"]
CAPPED_HEADER = "X-Ballast-Capped"


@dataclass(frozen=True)
class Job:
    """One validated generation request and how to answer it."""

    endpoint: Endpoint
    response_id: str
    model: str
    gens: tuple[GenerationRequest, ...]  # one per choice, in choice order: n per prompt, prompt by prompt
    stream: bool
    include_usage: bool
    want_logprobs: bool
    prompt_param: str  # the parameter a context-length error names
    reading: Reading = Reading()  # what to read out of the answer: thinking, tool calls
    n: int = 1  # choices per prompt
    echo: tuple[str, ...] = ()  # per choice, the prompt text put before its answer (completions' echo)
    # When the request arrived (intake.arrived_at; monotonic): a refusal's time and TTFT run from here.
    received_at: float = field(default_factory=time.monotonic)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request: each prompt once, however many choices it has."""
        return sum(len(g.prompt_ids) for g in self.gens[:: self.n])


def check_model(state: ServerState, requested: str) -> str:
    name = state.model_name
    if name is None:
        raise ApiError(
            503,
            "the model is still loading",
            "server_overloaded",
            code="model_loading",
            headers={"Retry-After": "1"},
        )
    if requested != name and requested not in state.model_aliases:
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; this server serves `{name}`",
            param="model",
            code="model_not_found",
        )
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
    return state.engine.sampling_defaults if state.engine is not None else {}


def _sampling(
    req: p.GenerationFields,
    defaults: dict[str, float],
    logprobs: int | None,
    bias: tuple[tuple[int, float], ...] = (),
    constraint: Constraint | None = None,
) -> SamplingParams:
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


def check_context(prompt_len: int, asked: int | None, max_len: int, param: str) -> None:
    """The scheduler's context check, made before a request is built: a prompt that cannot fit is
    refused before anything is copied per choice (n choices of a 1M-token prompt were 512 MiB of
    tuples before the scheduler's 400)."""
    max_tokens = _max_tokens(asked, prompt_len, max_len)
    if prompt_len + max_tokens > max_len:
        raise from_refusal(ContextTooLong(prompt_len, max_tokens, max_len), param)


def _max_tokens(asked: int | None, prompt_len: int, max_model_len: int) -> int:
    # Unset: whatever is left of the context. Never below 1, so a prompt that fills the context is
    # refused by the scheduler's one context check (ContextTooLong), not by a second one here.
    return asked if asked is not None else max(1, max_model_len - prompt_len)


def _common_checks(req: p.GenerationFields) -> None:
    refused = req.refused_field()
    if refused is not None:
        raise bad_request(refused[1], param=refused[0], code="unsupported_parameter")


def ready_engine(state: ServerState) -> tuple[TokenizerLike, int]:
    """The tokenizer and the context window a request may fill (prompt + new tokens)."""
    if state.engine is None or state.scheduler is None:
        raise ApiError(
            503,
            "the model is still loading",
            "server_overloaded",
            code="model_loading",
            headers={"Retry-After": "1"},
        )
    return state.engine.tokenizer, state.context_window


def refuse_early(state: ServerState) -> None:
    """Raise the scheduler's refusal that no prompt would change (a `Refused`: the caller maps it
    with `submit.refusal`) before the prompt is built: a chat template and tokens take the event
    loop milliseconds a request, and refused requests waited behind each other's."""
    assert state.scheduler is not None  # ready_engine said so
    try:  # the scheduler's state is the event loop's: a job built in a worker thread (a grammar)
        asyncio.get_running_loop()  # leaves its refusals to submit, on the loop
    except RuntimeError:
        return
    state.scheduler.refuse_early()


def check_token_ids(tokenizer: TokenizerLike, ids: Sequence[int], param: str = "prompt") -> None:
    """A client's token ids reach the embedding as they are; one out of range would fail the step
    and with it the whole engine, so it is refused here as bad input. The protocol states no
    vocabulary size, so the bound comes from the real tokenizer when it is one."""
    limit = tokenizer.vocab_size if isinstance(tokenizer, Tokenizer) else None
    bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
    if bad:
        accepted = f"0..{limit - 1}" if limit is not None else ">= 0"
        raise bad_request(f"token id {bad[0]} is outside the vocabulary ({accepted})", param=param)


def _prompts(
    tokenizer: TokenizerLike, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[tuple[str | None, tuple[int, ...]]]:
    """(text, token ids) of each completion prompt: text, token ids, or a list of either (text is
    None for prompts given as ids). Each prompt's ids are one tuple, shared by all its choices."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):  # pydantic made the list homogeneous: one prompt of ids
        batch: list[str] | list[list[int]] = [cast(list[int], prompt)]
    else:
        batch = cast("list[str] | list[list[int]]", prompt)
    out: list[tuple[str | None, tuple[int, ...]]] = []
    for item in batch:
        if isinstance(item, str):
            out.append((item, tuple(tokenizer.encode(item))))
        else:
            ids = tuple(item)
            check_token_ids(tokenizer, ids)
            out.append((None, ids))
    if any(not ids for _, ids in out):
        raise bad_request("the prompt is empty", param="prompt")
    return out


def completion_checks(state: ServerState, req: p.CompletionRequest) -> tuple[str, TokenizerLike, int]:
    """The request's own checks (400s), then the refusals no prompt changes (on the event loop):
    what may run before its prompt is built. (model id, tokenizer, context limit)"""
    model = check_model(state, req.model)
    tokenizer, max_len = ready_engine(state)
    _common_checks(req)
    if req.echo and req.logprobs is not None and req.stream:
        raise bad_request(
            "echo with logprobs is not supported when streaming (ask without stream)", param="echo"
        )
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1, req.n):
        raise bad_request("best_of must equal n (no server-side ranking)", param="best_of")
    refuse_early(state)
    return model, tokenizer, max_len


def completion_built(
    state: ServerState, req: p.CompletionRequest, model: str, tokenizer: TokenizerLike, max_len: int
) -> Job:
    """The job of a request `completion_checks` passed: its prompt's tokens and generations."""
    prompts = _prompts(tokenizer, req.prompt)
    for _, ids in prompts:  # before anything is built per choice
        check_context(len(ids), req.max_tokens, max_len, "prompt")
    params = _sampling(req, sampling_defaults(state), req.logprobs, _logit_bias(tokenizer, req))
    rid = replies.new_id("cmpl")
    # (index among its prompt's, prompt, given as text)
    choices = [(i, ids, text is not None) for text, ids in prompts for i in range(req.n)]
    scoring = req.logprobs if req.echo else None  # echo with logprobs: the prompt's own logprobs too
    gens = tuple(
        replace(
            _generation(
                _choice_id(rid, k, len(choices)),
                ids,
                req,
                _choice_params(params, i),
                req.max_tokens,
                max_len,
                text,
            ),
            prompt_logprobs=scoring,
        )
        for k, (i, ids, text) in enumerate(choices)
    )
    echoed = [
        (text if text is not None else tokenizer.decode(ids)) if req.echo else "" for text, ids in prompts
    ]
    echo = tuple(text for text in echoed for _ in range(req.n))
    return Job(
        "completion",
        rid,
        model,
        gens,
        req.stream,
        _usage(req),
        req.logprobs is not None,
        "prompt",
        n=req.n,
        echo=echo,
    )


def chat_checks(state: ServerState, req: p.ChatCompletionRequest) -> tuple[str, TokenizerLike, int]:
    """As `completion_checks`, for a chat request."""
    model = check_model(state, req.model)
    tokenizer, max_len = ready_engine(state)
    _common_checks(req)
    chat.check_tools(req)
    refuse_early(state)
    return model, tokenizer, max_len


async def built(state: ServerState, req: p.ChatCompletionRequest | p.CompletionRequest) -> Job:
    """The request's job, its checks and early refusals on the event loop, its prompt (tokens,
    a grammar) built in a worker thread. On the loop a 2k-token prompt's tokens took 8.5 ms on a
    2-core CPU, and every other request's refusal and every stream's tokens waited behind them;
    threads encode side by side (the tokenizer releases the GIL)."""
    if isinstance(req, p.ChatCompletionRequest):
        return await asyncio.to_thread(chat_built, state, req, *chat_checks(state, req))
    return await asyncio.to_thread(completion_built, state, req, *completion_checks(state, req))


def chat_built(
    state: ServerState, req: p.ChatCompletionRequest, model: str, tokenizer: TokenizerLike, max_len: int
) -> Job:
    """The job of a request `chat_checks` passed: its prompt (template, tokens, any grammar)."""
    ids = tuple(chat.chat_prompt(state, tokenizer, req))  # one tuple, shared by every choice
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    check_context(len(ids), asked, max_len, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(
        req, sampling_defaults(state), top, _logit_bias(tokenizer, req), chat.constraint(state, req, len(ids))
    )
    rid = replies.new_id("chatcmpl")
    gens = tuple(
        _generation(_choice_id(rid, i, req.n), ids, req, _choice_params(params, i), asked, max_len, True)
        for i in range(req.n)
    )
    return Job(
        "chat",
        rid,
        model,
        gens,
        req.stream,
        _usage(req),
        req.logprobs,
        "messages",
        chat.reading(state, tokenizer, req, ids),
        n=req.n,
    )


def _choice_id(response_id: str, index: int, count: int) -> str:
    return response_id if count == 1 else f"{response_id}-{index}"


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n draws with seed + i: a seeded request stays reproducible, its choices differ."""
    return (
        params if params.seed is None or index == 0 else dataclasses.replace(params, seed=params.seed + index)
    )


def _usage(req: p.GenerationFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _generation(
    rid: str,
    ids: tuple[int, ...],
    req: p.GenerationFields,
    params: SamplingParams,
    asked: int | None,
    max_len: int,
    text: bool,
) -> GenerationRequest:
    """text: the prompt came as text (chat messages, a text completion), and so will a next turn."""
    return GenerationRequest(
        request_id=rid,
        prompt_ids=ids,
        params=params,
        max_tokens=_max_tokens(asked, len(ids), max_len),
        stop=req.stop_strings(),
        resent_as_text=text,
    )
