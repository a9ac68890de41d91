"""HTTP-level Prometheus metrics (prefix `ballast_`), in a registry of the app's own.

One registry per app (not the process-global one) so several apps in one test process do not
collide, and so /metrics shows exactly what this server registered: these HTTP figures, the
scheduler's live gauges and counters (read at scrape time, never pushed) and the memory layer's
collectors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ballast.engine.spec.governor import DraftStats
from ballast.server import events
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets, seconds: from one fast CPU token to a long queued generation.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# Refusals must be fast (the aim is p99 under 100 ms): fine buckets below a second.
_REFUSAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# Generated tokens are counted live, as the scheduler hands each sampled token to its request
# (a step at a time), not when the request ends: a long stream shows in rate() while it runs
# instead of as one jump at its end.
GENERATION_TOKENS_HELP = (
    "Tokens the engine generated for requests, counted live as each sampled token reaches its "
    "request (every step), however the request ends (finished, aborted, disconnected, failed). Each "
    "request adds exactly its completion tokens (usage.completion_tokens when it completes), which "
    "include the token that completed a stop string (its text is cut from the answer; the engine "
    "generated it) and an end-of-sequence token"
)
PROMPT_TOKENS_HELP = (
    "Prompt tokens of requests, counted when a request ends (however it ends; not one refused "
    "before its first token), each prompt once however many choices (n) it has: usage.prompt_tokens"
)


@dataclass(frozen=True)
class SchedulerFigures:
    """What the scheduler gauges show at one scrape."""

    queue_depth: int
    active_slots: int
    slot_limit: int
    pressure_level: int
    reused_prompt_tokens: int = 0  # prompt tokens restored from prefix checkpoints, not prefilled
    # Per KV pool ("main", "int8"): (bytes of its live segments, blocks in use, spare blocks).
    kv_pools: tuple[tuple[str, int, int, int], ...] = ()
    preemptions: int = 0  # sequences moved out of the KV pool for want of blocks (all resumed)
    kv_cached: tuple[
        tuple[str, int], ...
    ] = ()  # per pool: of the used blocks, those only the prefix cache holds
    generated_tokens: int = 0  # tokens the scheduler has handed requests so far (every one)
    drafts: DraftStats | None = None  # speculative decoding's counters (None: drafting is off)
    queue_wait_factor: float = 1.0  # what a new request's queue-wait projection is read times


class _SchedulerCollector(Collector):
    """Reads the scheduler's figures when scraped; while the engine is loading only the generated
    tokens counter (at 0) shows."""

    def __init__(self, read: Callable[[], SchedulerFigures | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        figures = self._read()
        # Present from the start (0 while loading) so rate() has a series before the first token.
        yield CounterMetricFamily(
            "ballast_generation_tokens",
            GENERATION_TOKENS_HELP,
            value=figures.generated_tokens if figures is not None else 0,
        )
        if figures is None:
            return
        yield GaugeMetricFamily(
            "ballast_queue_depth", "Requests waiting for a slot", value=figures.queue_depth
        )
        yield GaugeMetricFamily("ballast_slots_active", "Slots running a request", value=figures.active_slots)
        yield GaugeMetricFamily(
            "ballast_slots_limit", "Slots the scheduler may use now (ladder-capped)", value=figures.slot_limit
        )
        yield GaugeMetricFamily(
            "ballast_scheduler_pressure_level",
            "Scheduler's pressure level (0 OK .. 3 CRITICAL)",
            value=figures.pressure_level,
        )
        yield GaugeMetricFamily(
            "ballast_queue_wait_factor",
            "Median ratio of queued requests' real waits for a first token to the waits projected as "
            "each was queued (waits projected at 0.35 of the bound or more); a new request's "
            "projection is read times it, queued ones' are not (1 until measured)",
            value=figures.queue_wait_factor,
        )
        yield CounterMetricFamily(
            "ballast_prompt_tokens_reused",
            "Prompt tokens restored from prefix checkpoints instead of prefilled",
            value=figures.reused_prompt_tokens,
        )
        if figures.drafts is not None:
            yield from _draft_metrics(figures.drafts)
        if not figures.kv_pools:
            return
        held = GaugeMetricFamily(
            "ballast_kv_pool_bytes", "Bytes of the KV pool's live segments", labels=["pool"]
        )
        blocks = GaugeMetricFamily(
            "ballast_kv_blocks", "KV blocks in use and spare (free or cache-only)", labels=["pool", "state"]
        )
        for pool, nbytes, used, spare in figures.kv_pools:
            held.add_metric([pool], nbytes)
            blocks.add_metric([pool, "used"], used)
            blocks.add_metric([pool, "spare"], spare)
        yield held
        yield blocks
        cached = GaugeMetricFamily(
            "ballast_kv_blocks_cached",
            "Of the used KV blocks, those held only by the prefix cache "
            "(used minus cached = blocks running sequences hold)",
            labels=["pool"],
        )
        for pool, n in figures.kv_cached:
            cached.add_metric([pool], n)
        yield cached
        yield CounterMetricFamily(
            "ballast_kv_preemptions",
            "Sequences preempted for want of KV blocks (resumed later)",
            value=figures.preemptions,
        )


def _draft_metrics(stats: DraftStats) -> Iterator[Metric]:
    yield CounterMetricFamily(
        "ballast_spec_draft_tokens", "Speculative tokens proposed (prompt lookup)", value=stats.drafted
    )
    yield CounterMetricFamily(
        "ballast_spec_accepted_tokens", "Speculative tokens the target accepted", value=stats.accepted
    )
    steps = CounterMetricFamily(
        "ballast_spec_steps", "Decode steps with drafts and without", labels=["drafting"]
    )
    steps.add_metric(["yes"], stats.steps_drafting)
    steps.add_metric(["no"], stats.steps_plain)
    yield steps
    by_position = GaugeMetricFamily(
        "ballast_spec_acceptance",
        "Share of drafts accepted at each draft position (0 = the first after the fed token)",
        labels=["position"],
    )
    drafted_at = CounterMetricFamily(
        "ballast_spec_position_drafted", "Drafts proposed at each draft position", labels=["position"]
    )
    accepted_at = CounterMetricFamily(
        "ballast_spec_position_accepted", "Drafts accepted at each draft position", labels=["position"]
    )
    for j, rate in enumerate(stats.acceptance_at()):
        by_position.add_metric([str(j)], rate)
        drafted_at.add_metric([str(j)], stats.drafted_at[j])
        accepted_at.add_metric([str(j)], stats.accepted_at[j])
    yield by_position
    yield drafted_at
    yield accepted_at
    declined = CounterMetricFamily(
        "ballast_spec_declined",
        "Steps the governor ran without drafts, by why (streams: the load rule; memory: WATCH or "
        "worse; loses: measured slower; measuring)",
        labels=["reason"],
    )
    for reason, n in sorted(stats.declined.items()):
        declined.add_metric([reason], n)
    yield declined


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "ballast_requests",
            "Generation requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.rejections = Counter(
            "ballast_http_rejections",
            "Requests refused for load (503 pressure, 429 queue full)",
            ["status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "ballast_time_to_first_token_seconds",
            "Time to first token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "ballast_inter_token_latency_seconds",
            "Time between tokens",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "ballast_e2e_request_latency_seconds",
            "Request latency, arrival to last byte",
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        self.refusal_seconds = Histogram(
            "ballast_refusal_seconds",
            "Time from a request's arrival to its 429 or 503 refusal, for refusals before a first token",
            ["status"],
            buckets=_REFUSAL_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter("ballast_prompt_tokens", PROMPT_TOKENS_HELP, registry=registry)
        for status in ("503", "429"):  # present from the start so rate() works before the first one
            self.rejections.labels(status=status)
            self.refusal_seconds.labels(status=status)

    def watch_scheduler(self, read: Callable[[], SchedulerFigures | None]) -> None:
        self.registry.register(_SchedulerCollector(read))

    def refused(self, endpoint: str, status: int, outcome: str, after_s: float | None = None) -> None:
        """A request refused (after_s: seconds since it arrived, when it had no token yet)."""
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        self.rejected(status, after_s)

    def rejected(self, status: int, after_s: float | None = None) -> None:
        """A refusal for load, before or after a request was read (429, 503; others are not);
        after_s: how long the client waited for it, where known."""
        if status in (429, 503):
            self.rejections.labels(status=str(status)).inc()
            if after_s is not None:
                self.refusal_seconds.labels(status=str(status)).observe(after_s)


class RequestTimer:
    """Token timing of one request: TTFT at the first token, inter-token latency after it."""

    def __init__(
        self, metrics: HttpMetrics, endpoint: str, request_id: str = "", start: float | None = None
    ) -> None:
        """start: when the request arrived (monotonic; now when None)."""
        self._metrics = metrics
        self._endpoint = endpoint
        self._request_id = request_id
        self._start = time.monotonic() if start is None else start
        self._last: float | None = None
        self._ttft: float | None = None
        self.generated = 0  # tokens seen so far
        self.done = False  # finished() has counted the request

    def tokens(self, n: int) -> None:
        """n tokens arrived together (a slow reader's mailbox merges events): spread the gap."""
        if n <= 0:
            return
        self.generated += n
        now = time.monotonic()
        if self._last is None:
            self._ttft = now - self._start
            self._metrics.ttft.observe(self._ttft)
            n -= 1
        elif n:
            gap = (now - self._last) / n
            for _ in range(n):
                self._metrics.itl.observe(gap)
        self._last = now

    def finished(self, outcome: str, prompt_tokens: int, completion_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        m = self._metrics
        e2e = time.monotonic() - self._start
        m.e2e.observe(e2e)
        events.request_finished(
            self._request_id, self._endpoint, outcome, prompt_tokens, completion_tokens, self._ttft, e2e
        )
        m.requests.labels(endpoint=self._endpoint, outcome=outcome).inc()
        m.prompt_tokens.inc(prompt_tokens)  # generated tokens were counted as they came (the scheduler)
