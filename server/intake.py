"""What a request may hold before admission sees it: its body, and the Python heap parsing it.

Admission counts a request's KV and state, but the server holds host memory for it earlier: the
body as it arrives, and the objects JSON parsing makes of it (a list of token ids is about eight
bytes of heap per byte of body: an 8 MiB body held 64 MiB). So, in front of the app, before any
route parses a byte:

- one body over `max_body_bytes` is refused with 413 (by Content-Length up front, or counted as a
  chunked upload arrives);
- bodies being parsed at once are bounded: beyond `max_parsing_bytes` of them, or beyond
  `max_concurrent_requests` requests in flight, a request gets 429 with Retry-After;
- what parsing will take (the body's bytes x PARSE_HEAP_PER_BODY_BYTE) is booked in the host book
  against the host budget while the request is parsed (until its response starts), for bodies
  over HOST_BOOKING_FLOOR; a host short of it answers 503 with Retry-After, like any other memory
  refusal;
- a body that stalls gets 408 (a slowloris client cannot hold a handler).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from ballast.memory.host_book import HostGrant
from ballast.memory.watch import MemWatch
from ballast.server import errors
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Heap bytes that parsing one byte of a request body can take: a JSON list of token ids, the
# densest case, is ~7 bytes of text an id and becomes a Python int (28 bytes; ids above 256 are
# not cached) behind an 8-byte list slot, then pydantic's validated copy (8 more a slot) and the
# prompt tuple (8): ~7.4x, measured 64 MiB of heap for an 8 MiB body. Rounded up.
PARSE_HEAP_PER_BODY_BYTE = 8
RETRY_AFTER_S = 1.0
# Bodies up to this size are not booked in the host book (they still count toward the bodies read
# at once): their parse is under half a MiB of heap, inside the host reserve, and booking them
# would refuse every request of a host at its reserve before the scheduler, which refuses those
# itself, with its own reason and after re-planning the ladder, ever saw them.
HOST_BOOKING_FLOOR = 64 << 10
# Never refused for being busy: a load balancer's or kubelet's probe must see the server's own
# state, and a scrape must go on under load.
PROBES = frozenset({"/health", "/ready", "/metrics", "/metrics/gateway"})


class BodyTooLarge(HTTPException):
    # An HTTPException so FastAPI's body reader re-raises it as is (it turns other errors into 400).
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive: nothing received for {timeout_s:g} s")


class IntakeBusy(HTTPException):
    def __init__(self, what: str) -> None:
        super().__init__(
            429, f"too many requests being read at once: {what}", errors.retry_after_header(RETRY_AFTER_S)
        )


class NoRoomToParse(HTTPException):
    def __init__(self, nbytes: int) -> None:
        super().__init__(
            503,
            f"host memory budget: no room to parse a {nbytes}-byte body",
            errors.retry_after_header(RETRY_AFTER_S),
        )


@dataclass(frozen=True)
class IntakeLimits:
    max_body_bytes: int
    max_parsing_bytes: int
    max_concurrent_requests: int
    body_timeout_s: float = 30.0


class Intake:
    """ASGI middleware; all its counters live on the event loop's thread."""

    def __init__(
        self,
        app: ASGIApp,
        limits: IntakeLimits,
        watch: MemWatch | None = None,
        on_refused: Callable[[int], None] | None = None,
    ) -> None:
        """on_refused(status): counts a refusal for load (429, 503) where metrics are kept."""
        self.app = app
        self.limits = limits
        self.watch = watch
        self.on_refused = on_refused
        self.requests = 0  # HTTP requests in flight
        self.parsing_bytes = 0  # bytes of bodies whose requests have not started their response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.monotonic()  # `arrived_at` reads it
        lim = self.limits
        length = dict(scope["headers"]).get(b"content-length")
        request = _Reading(self)
        try:
            if length is not None and not length.isdigit():
                raise HTTPException(400, "invalid Content-Length header")
            if length is not None and int(length) > lim.max_body_bytes:
                raise BodyTooLarge(lim.max_body_bytes)
            if self.requests >= lim.max_concurrent_requests and scope["path"] not in PROBES:
                raise self.refused(
                    IntakeBusy(f"{self.requests} requests in flight, limit {lim.max_concurrent_requests}")
                )
            if length is not None and int(length) > 0:
                request.book(int(length))  # the whole body up front: refused before a byte is read
        except HTTPException as exc:
            await errors.from_http(exc).response()(scope, receive, send)
            return
        self.requests += 1
        try:
            await self.app(scope, request.receive(receive), request.send(send))
        finally:
            self.requests -= 1
            request.done()

    def refused(self, exc: HTTPException) -> HTTPException:
        if self.on_refused is not None:
            self.on_refused(exc.status_code)
        return exc


class _Reading:
    """One request's share of the intake: its body bytes counted, its heap booked."""

    def __init__(self, intake: Intake) -> None:
        self._intake = intake
        self._counted = 0  # body bytes booked (declared or arrived)
        self._seen = 0  # body bytes arrived
        self._grants: list[HostGrant] = []
        self._body_done = False

    def book(self, nbytes: int) -> None:
        intake, lim = self._intake, self._intake.limits
        if intake.parsing_bytes + nbytes > lim.max_parsing_bytes:
            raise intake.refused(
                IntakeBusy(f"{intake.parsing_bytes} body bytes being parsed, limit {lim.max_parsing_bytes}")
            )
        watch = intake.watch
        if watch is not None and self._counted + nbytes > HOST_BOOKING_FLOOR:
            heap = nbytes * PARSE_HEAP_PER_BODY_BYTE
            grant = watch.host_book.take(heap, lambda: watch.exact().host_budget_bytes)
            if grant is None:
                raise intake.refused(NoRoomToParse(nbytes))
            self._grants.append(grant)
        intake.parsing_bytes += nbytes
        self._counted += nbytes

    def done(self) -> None:
        """Parsed (the response started) or finished: the body's share goes back."""
        self._intake.parsing_bytes -= self._counted
        self._counted = 0
        for grant in self._grants:
            grant.release()
        self._grants.clear()

    def receive(self, receive: Receive) -> Receive:
        lim = self._intake.limits

        async def counted() -> Message:
            if self._body_done:  # after the body only a disconnect comes, maybe much later: no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), lim.body_timeout_s)
            except asyncio.TimeoutError:
                raise BodyTimeout(lim.body_timeout_s) from None
            if message["type"] == "http.request":
                chunk = len(message.get("body", b""))
                self._seen += chunk
                if self._seen > lim.max_body_bytes:
                    raise BodyTooLarge(lim.max_body_bytes)
                if self._seen > self._counted:  # a chunked upload: book as it arrives
                    self.book(self._seen - self._counted)
                self._body_done = not message.get("more_body", False)
            return message

        return counted

    def send(self, send: Send) -> Send:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.done()
            await send(message)

        return sending


def arrived_at(request: Request) -> float:
    """When the request's head reached the intake (monotonic): a refusal's time and the time to
    first token run from here, with the body's reading, parsing and prompt building in them (they
    started after the prompt was built: under a burst of long chats the server's refusals read
    25 ms while the clients waited 0.2-1.0 s). Now, where no intake stamped it."""
    return float(getattr(request.state, "arrived", None) or time.monotonic())
