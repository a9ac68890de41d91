"""A deadline on the header phase of every HTTP request (uvicorn has none).

A client may open a connection and send its request headers a byte at a time, or nothing at all;
uvicorn waits for them forever, and each such connection holds a socket and a parser. (The body is
bounded by the app's `BodyLimit` once the headers are in; an idle keep-alive connection by
uvicorn's keep-alive timeout until its next request's first byte.) Here every connection gets
`timeout_s` from its opening, and from the first byte of each later request on it, to complete
the request's headers: past that, a client that had sent part of them gets a 408 with an OpenAI
error body, one that had sent nothing is closed silently, and either way the connection closes.
It is a total deadline, not an idle one: a byte every few seconds does not extend it.

The protocol classes are uvicorn's own (httptools where installed, as uvicorn picks, else h11)
with three hooks added; "the headers are complete" is uvicorn starting a new request cycle.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

from ballast.server.errors import ApiError
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ballast.server")


def _timeout_response(timeout_s: float) -> bytes:
    error = ApiError(
        408, f"the request headers did not arrive within {timeout_s:g} s", code="request_timeout"
    )
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class HeaderClock:
    """One connection's header deadline: started when a request's headers are awaited, stopped when
    they are complete; when it expires the connection is closed (with a 408 if bytes had come)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, timeout_s: float):
        self._loop = loop
        self._transport = transport
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._received = 0  # bytes of the awaited request so far

    @property
    def running(self) -> bool:
        return self._timer is not None

    def start(self) -> None:
        if self._timer is None:
            self._received = 0
            self._timer = self._loop.call_later(self._timeout_s, self._expire)

    def received(self, n_bytes: int) -> None:
        self._received += n_bytes

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._transport.is_closing():
            return
        # Debug level: a client that causes this at will must not be able to flood the log.
        log.debug("request headers not complete within %g s: connection closed", self._timeout_s)
        if self._received:
            self._transport.write(_timeout_response(self._timeout_s))
        self._transport.close()


class _HeaderDeadline(asyncio.Protocol):
    """The hooks, for a uvicorn HTTP protocol class listed after this one among the bases."""

    header_timeout_s: float = 30.0
    _clock: HeaderClock
    loop: asyncio.AbstractEventLoop
    cycle: Any  # uvicorn's RequestResponseCycle of the latest request whose headers were complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # A stream transport (uvicorn serves TCP and Unix sockets; uvloop's is no asyncio subclass).
        self._clock = HeaderClock(self.loop, cast(asyncio.Transport, transport), self.header_timeout_s)
        self._clock.start()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # the next request's headers come
            self._clock.start()
        awaited = self.cycle
        if self._clock.running:
            self._clock.received(len(data))
        super().data_received(data)
        if self.cycle is not awaited:  # a request's headers were complete: the app has it now
            self._clock.stop()

    def connection_lost(self, exc: Exception | None) -> None:
        self._clock.stop()
        super().connection_lost(exc)


class H11HeaderTimeout(_HeaderDeadline, H11Protocol):
    pass


# uvicorn's protocol classes with the deadline, the one uvicorn would pick first.
HEADER_TIMEOUT_PROTOCOLS: list[type[_HeaderDeadline]] = [H11HeaderTimeout]
try:  # uvicorn prefers httptools when it is installed; so does this
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeout(_HeaderDeadline, HttpToolsProtocol):
        pass

    HEADER_TIMEOUT_PROTOCOLS.insert(0, HttpToolsHeaderTimeout)
except ImportError:
    pass


def protocol_with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    """The HTTP protocol class to give uvicorn (`uvicorn.Config(http=...)`)."""
    base = HEADER_TIMEOUT_PROTOCOLS[0]
    return type(base.__name__, (base,), {"header_timeout_s": timeout_s})
