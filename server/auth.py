"""Optional Bearer API key on /v1 (`--api-key` / `BALLAST_API_KEY`).

The compare is constant-time (`hmac.compare_digest` over bytes) so response timing does not leak
how much of a guessed key was right. /health, /ready and /metrics stay open: probes and scrapers
of a private network should not need the key.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from ballast.server.errors import ApiError
from fastapi import Request


def key_matches(expected: str, authorization: str | None) -> bool:
    """True if the Authorization header is exactly `Bearer <expected>` (scheme case-insensitive)."""
    if authorization is None:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), expected.encode())


def bearer_dependency(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that refuses requests without the key (a no-op when no key is set)."""

    async def require_key(request: Request) -> None:
        if api_key is not None and not key_matches(api_key, request.headers.get("authorization")):
            raise ApiError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_key
