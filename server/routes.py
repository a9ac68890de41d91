"""The endpoints. Generation flows live in `completions` and `streaming`; this file only routes.

/health, /ready, /metrics (and /metrics/gateway), /version and /docs are open (probes, scrapers,
people); /v1, /tokenize, /detokenize and /tokenizer_info need the API key when one is set, and take
and give what vLLM's do. Anthropic Messages and OpenAI Responses have routes of their own (`messages_api`,
`responses_api`).
"""

from __future__ import annotations

from dataclasses import replace

from ballast.scheduler.errors import Refused
from ballast.server import chat, replies
from ballast.server import protocol as p
from ballast.server.auth import bearer_dependency
from ballast.server.completions import Job, built, check_model, check_token_ids, ready_engine
from ballast.server.errors import ApiError
from ballast.server.gateway_metrics import gateway_page
from ballast.server.intake import arrived_at
from ballast.server.messages_api import messages_router
from ballast.server.respond import respond
from ballast.server.responses_api import responses_router
from ballast.server.state import ServerState
from ballast.server.streaming import stream_response
from ballast.server.submit import refusal, start_unless_gone
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ballast import __version__


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.ballast
    return state


ops = APIRouter()


@ops.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the process and the engine are sound (loading counts as sound); 503 with a code
    (load_failed, engine_failed, engine_stalled) and the reason once it is not."""
    state = state_of(request)
    if state.sound():
        body: dict[str, object] = {"status": "ok", "phase": state.phase.value}
        if state.scheduler is not None and state.scheduler.step_failures:
            # Sound, but steps have failed (each cost only its own requests): say so, by code.
            body["step_failures"] = state.scheduler.step_failures
            body["last_step_failure"] = state.scheduler.last_step_failure
        return JSONResponse(body)
    return JSONResponse(
        {"status": "unsound", "code": state.failure_code, "reason": state.failure}, status_code=503
    )


@ops.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 when a load balancer should send work here: loaded, sound, and not at CRITICAL."""
    state = state_of(request)
    reason = state.not_ready_reason()
    if reason is None:
        return JSONResponse({"status": "ready", "level": state.level().name})
    return JSONResponse(
        {"status": "not ready", "reason": reason}, status_code=503, headers={"Retry-After": "1"}
    )


@ops.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@ops.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(state_of(request).registry), media_type=CONTENT_TYPE_LATEST)


@ops.get("/metrics/gateway")
async def gateway_metrics(request: Request) -> Response:
    """The vLLM-named load series alone, for a picker that scrapes every 50 ms (see gateway_metrics)."""
    return Response(gateway_page(state_of(request)), media_type=CONTENT_TYPE_LATEST)


async def _answer(state: ServerState, job: Job, request: Request) -> Response:
    started = await start_unless_gone(state, job, request)
    if started is None:  # nobody is listening; the status is for the access log only
        return Response(status_code=499)
    if job.stream:
        return stream_response(state, job, started)
    return await respond(state, job, started, request)


def _invalid(state: ServerState, endpoint: str, exc: ApiError) -> ApiError:
    state.metrics.requests.labels(
        endpoint=endpoint, outcome="invalid" if exc.status < 500 else "unavailable"
    ).inc()
    return exc


def v1_router(api_key: str | None) -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_dependency(api_key))])

    @v1.get("/models")
    async def models(request: Request) -> replies.ModelList:
        state = state_of(request)
        name = state.model_name
        if name is None or state.engine is None:
            return replies.ModelList(data=[])
        # Every name requests may give (a gateway routes only to the ids listed here).
        names = dict.fromkeys((name, *state.model_aliases))
        created = replies.now()
        return replies.ModelList(
            data=[replies.ModelCard(id=n, created=created, max_model_len=state.context_window) for n in names]
        )

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> replies.ModelCard:
        state = state_of(request)
        check_model(state, model_id)
        ready_engine(state)
        return replies.ModelCard(id=model_id, created=replies.now(), max_model_len=state.context_window)

    @v1.post("/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        state, arrived = state_of(request), arrived_at(request)
        try:
            job = replace(await built(state, body), received_at=arrived)
        except ApiError as exc:
            raise _invalid(state, "completion", exc) from exc
        except Refused as exc:  # before its prompt was built (refuse_early)
            raise refusal(state, exc, replies.new_id("cmpl"), "completion", "prompt", arrived) from exc
        return await _answer(state, job, request)

    @v1.post("/chat/completions", response_model=None)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        state, arrived = state_of(request), arrived_at(request)
        try:
            job = await built(state, body)
        except ApiError as exc:
            raise _invalid(state, "chat", exc) from exc
        except Refused as exc:  # before its prompt was built (refuse_early)
            raise refusal(state, exc, replies.new_id("chatcmpl"), "chat", "messages", arrived) from exc
        return await _answer(state, replace(job, received_at=arrived), request)

    return v1


def tokens_router(api_key: str | None) -> APIRouter:
    tokens = APIRouter(dependencies=[Depends(bearer_dependency(api_key))])

    @tokens.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest, request: Request) -> replies.TokenizeResponse:
        state = state_of(request)
        if body.model is not None:
            check_model(state, body.model)
        tokenizer, max_len = ready_engine(state)
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            req = p.ChatCompletionRequest(
                model=state.model_name or "", messages=body.messages or [], tools=body.tools
            )
            ids = chat.chat_prompt(state, tokenizer, req)
        return replies.TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids)

    @tokens.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> JSONResponse:
        """The tokenizer's special tokens and chat template, as vLLM gives them (lm-eval's remote
        tokenizer reads them before it tokenizes anything)."""
        tokenizer, max_len = ready_engine(state_of(request))
        hf = getattr(tokenizer, "hf", None)
        info: dict[str, object] = {"model_max_length": max_len}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template"):
            value = getattr(hf, name, None)
            info[name] = None if value is None else str(value)
        info["tokenizer_class"] = type(hf).__name__ if hf is not None else None
        return JSONResponse(info)

    @tokens.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest, request: Request) -> replies.DetokenizeResponse:
        state = state_of(request)
        if body.model is not None:
            check_model(state, body.model)
        tokenizer, _ = ready_engine(state)
        check_token_ids(tokenizer, body.tokens, "tokens")
        return replies.DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    return tokens


def install(app: FastAPI, api_key: str | None) -> None:
    app.include_router(ops)
    app.include_router(messages_router(api_key))
    app.include_router(responses_router(api_key))
    app.include_router(v1_router(api_key))
    app.include_router(tokens_router(api_key))
