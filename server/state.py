"""What one running app knows about itself: its parts, its phase, and whether it is sound.

Two failure kinds are kept apart: one request failing is the client's error and
the server goes on; the engine failing (a load that raised, a step that raised, `healthy` false)
makes the server unsound: /health fails and `on_fatal` is called, which in `ballast serve` stops
uvicorn so the process exits non-zero and a supervisor restarts it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ballast.engine.interface import EngineLike
from ballast.memory.types import Level, MemState
from ballast.server.config import ServerConfig
from ballast.server.metrics import HttpMetrics, SchedulerFigures
from prometheus_client import CollectorRegistry

if TYPE_CHECKING:
    from ballast.engine.text.grammar import GrammarCompiler
    from ballast.scheduler.scheduler import Scheduler

log = logging.getLogger("ballast.server")


class SnapshotWatch(Protocol):
    """What the server needs of MemWatch: start/stop with the app, and a non-blocking read."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def read(self) -> MemState: ...


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


def _log_fatal(reason: str) -> None:
    log.error("engine unsound: %s", reason)


@dataclass
class ServerState:
    config: ServerConfig
    registry: CollectorRegistry
    metrics: HttpMetrics
    memwatch: SnapshotWatch | None = None
    engine: EngineLike | None = None
    scheduler: Scheduler | None = None
    context_window: int = 0  # prompt + new tokens one request may use; known once loaded
    phase: Phase = Phase.LOADING
    failure: str | None = None
    failure_code: str | None = None  # load_failed, engine_failed or engine_stalled
    on_fatal: Callable[[str], None] = field(default=_log_fatal)
    # Other names clients may use for the served model: `ballast serve --model default` also
    # answers to "default", as vLLM answers to its --model argument.
    model_aliases: tuple[str, ...] = ()
    grammars: GrammarCompiler | None = None  # the GrammarCompiler of the loaded tokenizer, built on first use

    @property
    def model_name(self) -> str | None:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.engine.model_name if self.engine is not None else None

    def fail(self, reason: str, code: str = "engine_failed") -> None:
        """The engine is unsound. Idempotent: only the first reason is kept and reported."""
        if self.phase is Phase.FAILED:
            return
        self.phase = Phase.FAILED
        self.failure = reason
        self.failure_code = code
        self.on_fatal(reason)

    def sound(self) -> bool:
        """The process and the engine can still serve (loading counts as sound)."""
        if self.phase is Phase.FAILED:
            return False
        if self.engine is not None and not self.engine.healthy:
            self.fail("the engine reports itself unhealthy")
            return False
        if self.scheduler is not None and not self.scheduler.healthy:
            stalled = self.scheduler.stalled is not None
            self.fail(
                f"the scheduler stopped: {self.scheduler.unsound_reason}",
                "engine_stalled" if stalled else "engine_failed",
            )
            return False
        return True

    def level(self) -> Level:
        """The live memory level. Not the scheduler's pressure level: that one is refreshed only
        when the scheduler steps or takes a request, so while idle it can stay at a past CRITICAL,
        and a load balancer that never routes to us would never let it refresh. Its pin reaches
        CRITICAL only from a CRITICAL snapshot, which this reading sees first anyway."""
        return self.memwatch.read().level if self.memwatch is not None else Level.OK

    def not_ready_reason(self) -> str | None:
        """None when a load balancer should route here; else why not."""
        if not self.sound():
            return f"engine unsound: {self.failure}"
        if self.phase is not Phase.READY:
            return f"server is {self.phase.value}"
        level = self.level()
        if level >= Level.CRITICAL:
            return f"memory pressure {level.name}"
        if self.scheduler is None:
            return None
        stale = self.scheduler.memory_stale
        if stale is not None:  # the scheduler refuses new work until memory is seen again
            return stale
        # Steps failing for want of memory: at TIGHT the queue waits, at CRITICAL work is refused,
        # so a load balancer should send it elsewhere until they calm. And a queue a new request
        # would wait near the bound in: it is about to be refused here.
        return self.scheduler.failing_steps or self.scheduler.wait_not_ready

    def scheduler_figures(self) -> SchedulerFigures | None:
        s = self.scheduler
        if s is None:
            return None
        pools = tuple((name, f.bytes_held, f.used_blocks, f.spare_blocks) for name, f in s.kv_pools)
        cached = tuple((name, f.evictable_blocks) for name, f in s.kv_pools)
        return SchedulerFigures(
            s.queue_depth,
            s.active_slots,
            s.slot_limit,
            int(s.pressure_level),
            s.reused_tokens,
            pools,
            s.preemptions,
            cached,
            s.generated_tokens,
            s.draft_stats,
            s.wait_factor,
        )
