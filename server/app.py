"""The FastAPI app factory and its lifecycle.

Start-up: MemWatch starts (one synchronous poll, so the first /metrics is real), then the engine
loads on a worker thread while the server already answers (/health 200, /ready 503 "loading"),
then the scheduler starts and /ready turns 200. Shut-down runs the other way: the scheduler
aborts everything and stops, the engine shuts down, MemWatch stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ballast.engine.interface import EngineLike
from ballast.engine.runner.loading import LOAD_ERRORS
from ballast.memory.metrics import AdmissionMetrics, LadderCollector, PoolCollector, register_memory_metrics
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.scheduler import Scheduler
from ballast.server import dashboard, errors, routes
from ballast.server.completions import CAPPED_HEADER
from ballast.server.config import ServerConfig
from ballast.server.gateway_metrics import GatewayCollector
from ballast.server.intake import Intake, IntakeLimits
from ballast.server.metrics import HttpMetrics
from ballast.server.state import Phase, ServerState, SnapshotWatch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from ballast import __version__

if TYPE_CHECKING:  # the pool pulls in torch; the app only hands it around
    from ballast.memory.pool import CheckpointPool

log = logging.getLogger("ballast.server")

EngineFactory = Callable[[], EngineLike]


@dataclass(frozen=True)
class _Wiring:
    """How the scheduler is built once the engine has loaded."""

    scheduler_config: SchedulerConfig
    admission: AdmissionMetrics | None
    on_idle: Callable[[], None] | None  # trims the checkpoint pool while the scheduler idles


def _trim(pool: CheckpointPool, max_idle_s: float) -> None:
    pool.trim(max_idle_s)  # the released byte count is on /metrics (trimmed_bytes)


def _build(factory: EngineFactory) -> EngineLike:
    engine = factory()
    try:
        # The tokenizer may load lazily; its first use must not be a request on the event loop.
        engine.tokenizer.encode("warm-up")
        engine.sampling_defaults  # noqa: B018 - read now: a bad generation_config.json fails the load
    except BaseException:
        engine.shutdown()  # nobody else holds it yet: release its thread and leases here
        raise
    return engine


async def _load(state: ServerState, factory: EngineFactory, wiring: _Wiring) -> None:
    """Load the engine off the event loop, then start the scheduler; a failure makes us unsound."""
    try:
        engine = await asyncio.to_thread(_build, factory)
    except LOAD_ERRORS as exc:  # the operator can fix these (a bad path, too little memory): no trace
        log.error("model load failed: %s", exc)
        state.fail(f"model load failed: {type(exc).__name__}: {exc}", "load_failed")
        return
    except Exception as exc:
        log.exception("model load failed")
        state.fail(f"model load failed: {type(exc).__name__}: {exc}", "load_failed")
        return
    state.engine = engine
    if state.phase is not Phase.LOADING:  # shut down while we were loading
        return
    # The scheduler refuses prompt + max_tokens beyond this window (ContextTooLong); the server
    # needs it to fill in an unset max_tokens.
    state.context_window = wiring.scheduler_config.window_for(engine.max_model_len)
    try:
        scheduler = Scheduler(
            engine,
            wiring.scheduler_config,
            memwatch=state.memwatch,
            admission_metrics=wiring.admission,
            on_idle=wiring.on_idle,
            on_unsound=lambda code, reason: state.fail(reason, code),
        )
        await scheduler.start()
        state.scheduler = scheduler  # from here on, shut-down stops it
        if state.memwatch is not None:
            state.registry.register(LadderCollector(lambda: scheduler.ladder))
    except Exception as exc:
        log.exception("scheduler start failed")
        state.fail(f"scheduler start failed: {type(exc).__name__}: {exc}")
        return
    state.phase = Phase.READY
    log.info("ready: serving %s", state.model_name)


def _lifespan(
    factory: EngineFactory, wiring: _Wiring
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state: ServerState = app.state.ballast
        if state.memwatch is not None:
            state.memwatch.start()
        loader = asyncio.create_task(_load(state, factory, wiring), name="ballast-load")
        try:
            yield
        finally:
            if state.phase is not Phase.FAILED:
                state.phase = Phase.STOPPING
            await loader  # a load in progress runs to its end so its engine can be shut down
            if state.scheduler is not None:
                await state.scheduler.stop()
            if state.engine is not None and state.scheduler is not None and state.scheduler.stalled:
                # Its thread is stuck in the step: waiting for it would hang the exit forever.
                log.error("not shutting the engine down: its thread is stuck in a step")
                await asyncio.to_thread(state.engine.abandon)
            elif state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)
            if state.memwatch is not None:
                state.memwatch.stop()

    return lifespan


def create_app(
    config: ServerConfig,
    scheduler_config: SchedulerConfig,
    engine_factory: EngineFactory,
    *,
    memwatch: SnapshotWatch | None = None,
    on_fatal: Callable[[str], None] | None = None,
    pool: CheckpointPool | None = None,
    pool_max_idle_s: float = 30.0,
    model_aliases: tuple[str, ...] = (),
    collectors: Sequence[Collector] = (),
) -> FastAPI:
    """An app serving the engine `engine_factory` builds (called once, on a worker thread).

    `memwatch` is started and stopped with the app and its figures are on /metrics; `on_fatal(reason)`
    is called once if the engine becomes unsound (`ballast serve` uses it to exit non-zero);
    `pool` is
    the checkpoint buffer pool the engine's prefix cache uses: its figures go on /metrics and the
    idle scheduler trims buffers pooled longer than `pool_max_idle_s`; `model_aliases` are other
    names requests may give the model (responses always carry the served name); `collectors` add
    their series to /metrics (the KV-event publisher's)."""
    registry = CollectorRegistry(auto_describe=True)
    metrics = HttpMetrics(registry)
    state = ServerState(
        config=config, registry=registry, metrics=metrics, memwatch=memwatch, model_aliases=model_aliases
    )
    if on_fatal is not None:
        state.on_fatal = on_fatal
    metrics.watch_scheduler(state.scheduler_figures)
    registry.register(GatewayCollector(state))  # the vLLM-named load series gateways read
    for collector in collectors:
        registry.register(collector)
    admission = register_memory_metrics(registry, memwatch.read, pool=pool) if memwatch is not None else None
    if pool is not None and memwatch is None:
        registry.register(PoolCollector(pool))
    on_idle = None if pool is None else lambda: _trim(pool, pool_max_idle_s)
    wiring = _Wiring(scheduler_config, admission, on_idle)
    app = FastAPI(
        title="ballast",
        version=__version__,
        lifespan=_lifespan(engine_factory, wiring),
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.ballast = state
    errors.install(app)
    routes.install(app, config.api_key)
    if config.dashboard:
        dashboard.install(app, config.api_key)
    limits = IntakeLimits(
        config.max_body_bytes, config.max_parsing_bytes, config.max_concurrent_requests, config.body_timeout_s
    )
    watch = memwatch if isinstance(memwatch, MemWatch) else None
    app.add_middleware(Intake, limits=limits, watch=watch, on_refused=metrics.rejected)
    if config.origins():  # outermost: a browser's preflight is answered before any other check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.origins()),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After", CAPPED_HEADER],
        )
    return app
