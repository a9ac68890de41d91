"""Optional Bearer API key on /v1 (`--api-key` / `BALLAST_API_KEY`), also taken from `x-api-key`.

The compare is constant-time (`hmac.compare_digest` over SHA-256 digests) so response timing
leaks neither how much of a guessed key was right nor its length. /health, /ready and /metrics
stay open: liveness and readiness probes (kubelet, load balancers) and Prometheus scrapers rarely
carry credentials, and what they show is figures about memory and load, never a prompt, a
completion, the model's name or the key; an operator who must hide them keeps the port on a
private network. /dashboard and /dashboard/state follow the key (the state names the model that
/v1/models keeps behind it, and shows requests live): a browser cannot send a Bearer header when
it opens a page, so they also take HTTP Basic credentials whose password is the key (any user
name), which the browser asks for once and sends with the page's own requests.

The key itself is never logged (the request log has no headers; the config is never printed);
pass it as BALLAST_API_KEY rather than --api-key where other users can read the process list.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Awaitable, Callable

from ballast.server.errors import ApiError
from fastapi import Request


def key_matches(expected: str, authorization: str | None) -> bool:
    """True if the Authorization header is exactly `Bearer <expected>` (scheme case-insensitive)."""
    if authorization is None:
        return False
    scheme, _, given = authorization.partition(" ")
    # Digests of equal length are compared, so not even the key's length shows in the timing
    # (compare_digest on raw strings of different lengths returns at once).
    given_digest = hashlib.sha256(given.strip().encode("utf-8", "surrogateescape")).digest()
    match = hmac.compare_digest(given_digest, hashlib.sha256(expected.encode()).digest())
    return match and scheme.lower() == "bearer"


def basic_matches(expected: str, authorization: str | None) -> bool:
    """True if the Authorization header is HTTP Basic with `expected` as the password."""
    if authorization is None:
        return False
    scheme, _, encoded = authorization.partition(" ")
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8", "surrogateescape")
    except (binascii.Error, ValueError):
        decoded = ""
    password = decoded.partition(":")[2]
    given_digest = hashlib.sha256(password.encode("utf-8", "surrogateescape")).digest()
    match = hmac.compare_digest(given_digest, hashlib.sha256(expected.encode()).digest())
    return match and scheme.lower() == "basic"


def page_dependency(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The key for pages a browser opens (Bearer, or Basic with the key as password); a no-op
    when no key is set."""

    async def require_key(request: Request) -> None:
        given = request.headers.get("authorization")
        if api_key is not None and not (key_matches(api_key, given) or basic_matches(api_key, given)):
            raise ApiError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>', or the key as the "
                "password of HTTP Basic",
                code="invalid_api_key",
                headers={"WWW-Authenticate": 'Basic realm="ballast", charset="UTF-8"'},
            )

    return require_key


def bearer_dependency(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that refuses requests without the key (a no-op when no key is set)."""

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        # Anthropic's clients send the key as `x-api-key`; it is accepted as a bearer key would be.
        x_api_key = request.headers.get("x-api-key")
        given = request.headers.get("authorization") if x_api_key is None else f"Bearer {x_api_key}"
        if not key_matches(api_key, given):
            raise ApiError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_key
