"""A generation request as the server hands it in, and the events its handle yields back.

The only shared object is the `RequestHandle`, whose mailbox the scheduler fills and the HTTP
handler drains, all on the event loop thread (not thread-safe by design).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from ballast.engine.plan import SamplingParams
from ballast.scheduler.errors import Refused

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    # Absolute time.monotonic() to end it with RequestTimeout; None: request_timeout_s applies.
    deadline_s: float | None = None
    # The prompt's own logprobs (echo with logprobs): how many alternatives per prompt token. Such
    # a prompt is prefilled, never restored from the prefix cache (every position is scored).
    prompt_logprobs: int | None = None
    # The next turn resends this answer as text, not ids: the checkpoint at the answer's end is
    # saved only where they tokenize the same (`TurnSaves` checks).
    resent_as_text: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) of the n most likely


@dataclass(frozen=True)
class TokenEvent:
    """New text ("" while a stop-string prefix or a partial character is held back) and the token
    ids that produced it: several in one event when the reader is slow."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id when asked for


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    capped: bool = False  # admission CAP shortened max_tokens to fit memory (reason is "length")
    error: Refused | None = None  # set when reason == "error" (Overloaded, RequestTimeout, ...)
    cached_tokens: int = 0  # prompt tokens restored from a prefix checkpoint, not prefilled
    # Prompt tokens 1 .. n-1 as the model scored them, when the request asked (prompt_logprobs).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


Event = TokenEvent | FinishEvent


class Mailbox:
    """Bounded per-request output. The scheduler never blocks on a slow reader: when full, a new
    TokenEvent merges into the last pending one, so the reader still sees every token, in order."""

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 2:
            raise ValueError("mailbox capacity must be >= 2")
        self._capacity = capacity
        self._events: deque[Event] = deque()
        self._ready = asyncio.Event()
        self.closed = False  # a FinishEvent was put: nothing more will come

    def put(self, event: Event) -> None:
        if self.closed:
            raise RuntimeError("mailbox already finished")
        if isinstance(event, TokenEvent) and len(self._events) >= self._capacity - 1:
            last = self._events[-1]
            if isinstance(last, TokenEvent):
                self._events[-1] = _merge(last, event)
                return
        self._events.append(event)
        self.closed = isinstance(event, FinishEvent)
        self._ready.set()

    async def get(self) -> Event:
        while not self._events:
            self._ready.clear()
            await self._ready.wait()
        return self._events.popleft()

    def __len__(self) -> int:
        return len(self._events)


def _merge(a: TokenEvent, b: TokenEvent) -> TokenEvent:
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or ()) + (b.logprobs or ())
    return TokenEvent(a.text + b.text, a.token_ids + b.token_ids, logprobs)


class RequestHandle:
    """What `Scheduler.submit` returns: `async for` yields TokenEvents, then the FinishEvent.
    `abort()` (a client disconnect) frees the slot within one step; `async with` aborts on exit."""

    def __init__(self, request: GenerationRequest, mailbox: Mailbox, on_abort: Callable[[], None]) -> None:
        self.request = request
        self._mailbox = mailbox
        self._on_abort = on_abort
        self._aborted = False
        self.finish: FinishEvent | None = None  # set once the reader has received it

    @property
    def finished(self) -> bool:
        """Its FinishEvent is in the mailbox or read."""
        return self._mailbox.closed

    def abort(self) -> None:
        """Idempotent; a no-op once the request has finished."""
        if not self._aborted and not self._mailbox.closed:
            self._aborted = True
            self._on_abort()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        while self.finish is None:
            event = await self._mailbox.get()
            if isinstance(event, FinishEvent):
                self.finish = event
            yield event

    async def collect(self) -> tuple[str, tuple[int, ...], FinishEvent]:
        """Drain the stream: (text, generated token ids, finish) for non-streaming responses."""
        parts: list[str] = []
        ids: list[int] = []
        async for event in self:
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                ids.extend(event.token_ids)
        assert self.finish is not None  # the iterator only ends after the FinishEvent
        return "".join(parts), tuple(ids), self.finish

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
