"""The ONE place that maps typed errors to HTTP status codes and OpenAI error JSON.

Body shape everywhere: `{"error": {"message", "type", "param", "code"}}`. Bad input is a 400 (never
FastAPI's default 422 shape, never a 500 with a traceback); memory pressure is a 503 with
`Retry-After`; a full queue, or a wait for a slot longer than the queue-wait bound, is a 429
with `Retry-After`; a failed engine step the engine recovered from is a 503 with `Retry-After`
(only that step's requests are lost); an engine failure is a 500 and makes
`/health` fail (the engine reports itself unsound; see `routes.health`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from ballast.engine.text.tokenizer import TokenizerInputError
from ballast.memory.errors import MemoryRefused
from ballast.scheduler.errors import (
    ContextTooLong,
    EngineFailed,
    EngineStalled,
    Overloaded,
    QueueFull,
    QueueWaitTooLong,
    Refused,
    RequestFailed,
    RequestTimeout,
    StepAborted,
)
from ballast.server.protocol import ParamError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ballast.server")

# Seconds a client is told to wait when the refusal names no figure of its own.
DEFAULT_RETRY_AFTER_S = 1.0


class ApiError(Exception):
    """An error the client sees: status, OpenAI error fields, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def retry_after_header(seconds: float) -> dict[str, str]:
    # Retry-After takes whole seconds; round up so a client never comes back too early.
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


# Refusals a client should retry later: (status, OpenAI error type, code). Each carries the wait
# it advertises (Retry-After).
_RETRYABLE: tuple[tuple[type[Refused], int, str, str], ...] = (
    (Overloaded, 503, "server_overloaded", "server_overloaded"),
    (QueueFull, 429, "rate_limit_exceeded", "queue_full"),
    (QueueWaitTooLong, 429, "rate_limit_exceeded", "queue_wait_exceeded"),
    # The server is sound (only this step's requests were lost): 503, so clients retry.
    (StepAborted, 503, "server_error", "engine_step_failed"),
    # The server is going away (a step never returned): 503, so clients go to another replica.
    (EngineStalled, 503, "server_error", "engine_stalled"),
)


def from_refusal(exc: Refused | MemoryRefused, prompt_param: str = "messages") -> ApiError:
    """Map a scheduler or memory refusal to what the client sees."""
    for kind, status, type_, code in _RETRYABLE:
        if isinstance(exc, kind):
            wait = retry_after_header(exc.retry_after_s)  # type: ignore[attr-defined]
            return ApiError(status, str(exc), type_, code=code, headers=wait)
    if isinstance(exc, RequestFailed):  # this request only: the server stays sound
        return ApiError(500, str(exc), "server_error", code="request_failed")
    if isinstance(exc, ContextTooLong):
        return ApiError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout", code="request_timeout")
    if isinstance(exc, EngineFailed):
        return ApiError(500, str(exc), "server_error", code="engine_failed")
    if isinstance(exc, MemoryRefused) or exc.retryable:
        wait = retry_after_header(DEFAULT_RETRY_AFTER_S)
        return ApiError(503, str(exc), "server_overloaded", code="server_overloaded", headers=wait)
    return ApiError(500, str(exc), "server_error")


def _loc_param(loc: Sequence[int | str]) -> str | None:
    """`("body", "messages", 0, "content")` -> "messages[0].content" (OpenAI's spelling, which
    the handlers' own checks use too); None for the body itself."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def from_validation(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    param = _loc_param(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return bad_request("request body is not valid JSON", code="invalid_json")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):  # a check across fields, which names its own parameter
        return bad_request(cause.message, param=cause.param)
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return bad_request(message, param=param)


# Codes for statuses Starlette raises itself (unknown route, wrong method, a chunked body too large)
# and the intake raises (server/intake.py: too many bodies being read, no host room to parse one).
_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    429: "intake_busy",
    503: "server_overloaded",
}
_HTTP_TYPES = {429: "rate_limit_exceeded", 503: "server_overloaded"}


def from_http(exc: StarletteHTTPException) -> ApiError:
    kind = _HTTP_TYPES.get(exc.status_code) or (
        "server_error" if exc.status_code >= 500 else "invalid_request_error"
    )
    code = _HTTP_CODES.get(exc.status_code)
    return ApiError(exc.status_code, str(exc.detail), kind, code=code, headers=dict(exc.headers or {}))


def api_error_of(request: Request, exc: Exception) -> ApiError:
    """What the client sees for any exception a handler raised."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        return from_validation(exc)
    if isinstance(exc, StarletteHTTPException):
        kind = from_http(exc).type
        message = str(exc.detail)
        if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            # Say what was asked: a client that reports "Not Found" as a missing model misleads.
            what = "no route" if exc.status_code == 404 else "method not allowed"
            message = f"{message}: {what} for {request.method} {request.url.path}"
        code = _HTTP_CODES.get(exc.status_code)
        return ApiError(exc.status_code, message, kind, code=code, headers=dict(exc.headers or {}))
    if isinstance(exc, Refused | MemoryRefused):
        return from_refusal(exc)
    if isinstance(exc, TokenizerInputError):
        return bad_request(str(exc), code="invalid_text")
    # A bug, not bad input: log the traceback here, never send it to the client.
    log.exception("unhandled error while serving a request", exc_info=exc)
    return ApiError(500, "internal server error", "server_error")


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into an OpenAI error response."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error_of(request, exc).response()

    for kind in (ApiError, RequestValidationError, StarletteHTTPException, Refused, MemoryRefused):
        app.add_exception_handler(kind, on_error)
    app.add_exception_handler(TokenizerInputError, on_error)
    app.add_exception_handler(Exception, on_error)


# Anthropic's error types by status. Memory pressure stays a 503 (with Retry-After) rather than
# Anthropic's own 529: load balancers, proxies and ballast's metrics read 503 as "retry elsewhere
# or later", and the anthropic SDK retries both, honouring Retry-After.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class AnthropicRoute(APIRoute):
    """A route that answers errors in Anthropic's shape (`{"type": "error", "error": {...}}`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                err = api_error_of(request, exc)
                return JSONResponse(anthropic_body(err), status_code=err.status, headers=err.headers)

        return route
