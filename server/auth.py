"""Optional Bearer API key on /v1 (`--api-key` / `BALLAST_API_KEY`), also taken from `x-api-key`.

The compare is constant-time (`hmac.compare_digest` over SHA-256 digests) so response timing
leaks neither how much of a guessed key was right nor its length. /health, /ready, /metrics and the
/dashboard page stay open: liveness and readiness probes (kubelet, load balancers) and Prometheus
scrapers rarely carry credentials, and what they show is figures about memory and load, never a
prompt, a completion or the key; an operator who must hide them keeps the port on a private
network. The key itself is never logged (the request log has no headers; the config is never
printed); pass it as BALLAST_API_KEY rather than --api-key where other users can read the process
list.
"""

from __future__ import annotations

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
