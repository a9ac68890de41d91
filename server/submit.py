"""A job's way into the scheduler and out again: submitting it (`start`), a refusal as the client
sees it (`refuse`), and an abort when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ballast.scheduler.errors import EngineFailed, Refused, outcome_of
from ballast.scheduler.request import (
    Event,
    FinishEvent,
    GenerationRequest,
    RequestHandle,
)
from ballast.server.completions import Job
from ballast.server.errors import ApiError, from_refusal
from ballast.server.events import request_accepted, request_refused
from ballast.server.metrics import RequestTimer
from ballast.server.state import ServerState
from fastapi import Request


def refuse(state: ServerState, job: Job, exc: Refused, *, counted: bool = False) -> ApiError:
    """Map a refusal for the client, mark the server unsound if the engine failed, and count it
    (unless the request's timer already did, for an error that ended a running request)."""
    since = None if counted else job.received_at
    return refusal(state, exc, job.response_id, job.endpoint, job.prompt_param, since)


def refusal(
    state: ServerState, exc: Refused, request_id: str, endpoint: str, prompt_param: str, since: float | None
) -> ApiError:
    """`refuse` for a request whose job may not be built yet (refused before its prompt was:
    Scheduler.refuse_early); `since`: when it arrived, None when it is counted already."""
    if isinstance(exc, EngineFailed):
        state.fail(str(exc))
    err = from_refusal(exc, prompt_param)
    request_refused(request_id, endpoint, err.status, err.code, str(exc))
    if since is not None:  # refused before its first token: how long the client waited to learn it
        state.metrics.refused(endpoint, err.status, outcome_of(exc), time.monotonic() - since)
    return err


def finish_outcome(finish: FinishEvent) -> str:
    """The metrics label of a finished request: its reason, or the refusal that ended it."""
    return finish.reason if finish.error is None else outcome_of(finish.error)


@dataclass(frozen=True)
class Run:
    """One submitted choice whose first event has arrived."""

    handle: RequestHandle
    events: AsyncIterator[Event]  # the one iterator over the handle's mailbox
    first: Event


@dataclass(frozen=True)
class Started:
    """Every choice of a request, submitted, each with its first event."""

    runs: tuple[Run, ...]
    timer: RequestTimer

    def abort(self) -> None:
        for run in self.runs:
            run.handle.abort()


async def start(state: ServerState, job: Job) -> Started:
    """Submit every choice and wait for their first events; a refusal (now or while queued) of any
    raises an ApiError and aborts the others. With n > 1 the first choice of each prompt goes
    first and the others follow once it has a token: by then its prompt is prefilled, and they
    restore it from the prefix cache (where the model and the interval allow) instead of
    prefilling it again."""
    assert state.scheduler is not None
    timer = RequestTimer(state.metrics, job.endpoint, job.response_id, job.received_at)
    if state.engine is not None:  # one request event per HTTP request, with its first prompt
        request_accepted(job.endpoint, job.gens[0], state.engine.tokenizer, state.config.log_prompts)
    runs: list[Run | None] = [None] * len(job.gens)
    leaders = list(range(0, len(job.gens), job.n))
    followers = [i for i in range(len(job.gens)) if i % job.n]
    try:
        for wave in (leaders, followers):
            started = await asyncio.gather(
                *(_submit(state, job, job.gens[i]) for i in wave), return_exceptions=True
            )
            for i, result in zip(wave, started, strict=True):
                if isinstance(result, Run):
                    runs[i] = result
            failed = [r for r in started if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
    except BaseException:
        for run in runs:
            if run is not None:
                run.handle.abort()  # cancelled or refused: free the slots of the others
        raise
    return Started(tuple(r for r in runs if r is not None), timer)


async def _submit(state: ServerState, job: Job, gen: GenerationRequest) -> Run:
    assert state.scheduler is not None
    try:
        handle = state.scheduler.submit(gen)
    except Refused as exc:
        raise refuse(state, job, exc) from exc
    events = aiter(handle)
    try:
        first = await anext(events)
    except BaseException:
        handle.abort()  # cancelled while waiting (client gone, server stopping): free the slot
        raise
    if isinstance(first, FinishEvent) and first.error is not None:
        raise refuse(state, job, first.error)
    return Run(handle, events, first)


async def abort_on_disconnect(request: Request, started: Started) -> None:
    """The body has been read, so the next ASGI message is the client going away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            started.abort()
            return


async def start_unless_gone(state: ServerState, job: Job, request: Request) -> Started | None:
    """Submit and wait for the first event, as `start` does, but give up (aborting the request,
    which frees its queue entry or slot) if the client disconnects first: a client that left while
    queued must not cost a prefill. None when it left."""
    starting = asyncio.ensure_future(start(state, job))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((starting, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if starting.done():
        return starting.result()
    starting.cancel()  # start() aborts the handle when cancelled
    with contextlib.suppress(asyncio.CancelledError, ApiError):
        await starting
    state.metrics.requests.labels(endpoint=job.endpoint, outcome="abort").inc()
    return None


async def disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so that is the next message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
