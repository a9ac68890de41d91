"""Prometheus collectors for the memory layer (prefix `ballast_`).

The gauges are read at scrape time from callables (the MemWatch snapshot, the pool's stats, the
current ladder plan), never pushed: a scrape reads one immutable snapshot, so every figure in it
comes from the same poll, and nothing here runs between scrapes. Admission verdicts are events,
so they are counted as they happen by `AdmissionMetrics.record`, which the scheduler calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ballast.memory.admission import reason_class
from ballast.memory.types import LadderPlan, Level, MemState, Verdict
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the pool pulls in torch; a scrape of host figures should not need it
    from ballast.memory.pool import CheckpointPool


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _Described(Collector):
    """describe() names the families, so registering a collector twice on one registry is an
    error instead of duplicated samples on every scrape."""

    def describe(self) -> list[Metric]:
        return list(self.collect())


class MemoryCollector(_Described):
    """Level, host, PSI, cgroup and per-GPU gauges from one `MemState` per scrape."""

    def __init__(self, snapshot: Callable[[], MemState], clock: Callable[[], float] = time.monotonic) -> None:
        self._snapshot = snapshot
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        h = s.host
        yield _gauge(
            "ballast_memory_pressure_level",
            "Overall memory pressure level (0 OK, 1 WATCH, 2 TIGHT, 3 CRITICAL)",
            int(s.level),
        )
        state = GaugeMetricFamily(
            "ballast_memory_pressure_state",
            "1 for the current overall pressure level, 0 for the others",
            labels=["state"],
        )
        for level in Level:
            state.add_metric([level.name.lower()], 1.0 if s.level is level else 0.0)
        yield state
        yield _gauge("ballast_host_memory_level", "Host-side pressure level (0-3)", int(s.host_level))
        yield _gauge("ballast_host_memory_total_bytes", "Host MemTotal (0 = unknown)", h.total_bytes)
        yield _gauge("ballast_host_memory_available_bytes", "Host MemAvailable", h.available_bytes)
        yield _gauge(
            "ballast_host_memory_effective_total_bytes",
            "Smaller of host total and cgroup limit",
            h.effective_total_bytes,
        )
        yield _gauge(
            "ballast_host_memory_effective_available_bytes",
            "Host available, capped by the cgroup's headroom",
            h.effective_available_bytes,
        )
        yield _gauge(
            "ballast_host_memory_reserve_bytes", "Host reserve admission keeps free", s.host_reserve_bytes
        )
        yield _gauge(
            "ballast_host_memory_budget_bytes",
            "Host bytes admission may still hand out (available minus reserve)",
            s.host_budget_bytes,
        )
        yield _gauge("ballast_memory_psi_some_avg10", "PSI memory 'some' avg10, percent", h.psi_some_avg10)
        yield _gauge("ballast_memory_psi_full_avg10", "PSI memory 'full' avg10, percent", h.psi_full_avg10)
        yield _gauge("ballast_cgroup_version", "Memory cgroup version found (0 = none)", h.cgroup_version)
        yield _gauge(
            "ballast_cgroup_memory_usage_bytes",
            "Cgroup usage minus reclaimable page cache",
            h.cgroup_usage_bytes,
        )
        yield _gauge(
            "ballast_cgroup_memory_high_bytes", "Cgroup memory.high (0 = unset)", h.cgroup_high_bytes
        )
        yield _gauge(
            "ballast_cgroup_memory_max_bytes",
            "Cgroup memory.max / limit_in_bytes (0 = unset)",
            h.cgroup_max_bytes,
        )
        yield _gauge("ballast_memwatch_snapshot_seq", "Sequence number of the snapshot scraped", s.seq)
        if s.taken_at > 0:  # a placeholder before the first poll has no age
            yield _gauge(
                "ballast_memwatch_snapshot_age_seconds",
                "Seconds since the scraped snapshot was polled",
                max(0.0, self._clock() - s.taken_at),
            )
        yield from self._gpus(s)

    @staticmethod
    def _gpus(s: MemState) -> Iterator[Metric]:
        fields: list[tuple[str, str, Callable[..., float]]] = [
            ("ballast_gpu_memory_free_bytes", "Free VRAM per GPU", lambda d: d.free_bytes),
            ("ballast_gpu_memory_total_bytes", "Total VRAM per GPU", lambda d: d.total_bytes),
            (
                "ballast_gpu_memory_budget_bytes",
                "VRAM budget per GPU (total minus reserve; 0 = not ours)",
                lambda d: d.budget_bytes,
            ),
            ("ballast_gpu_memory_ledger_bytes", "VRAM leased by ballast per GPU", lambda d: d.ledger_bytes),
            ("ballast_gpu_memory_ceiling_bytes", "VRAM ledger ceiling per GPU", lambda d: d.ceiling_bytes),
            ("ballast_gpu_memory_level", "Pressure level per GPU (0-3)", lambda d: int(d.level)),
        ]
        for name, doc, get in fields:
            family = GaugeMetricFamily(name, doc, labels=["gpu"])
            for d in s.dies:
                family.add_metric([str(d.index)], get(d))
            yield family


class PoolCollector(_Described):
    """The checkpoint buffer pool's counters and gauges."""

    def __init__(self, pool: CheckpointPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        p = self._pool.stats()
        yield CounterMetricFamily(
            "ballast_checkpoint_pool_hits",
            "Checkpoint buffer requests served without allocating",
            value=p.hits,
        )
        yield CounterMetricFamily(
            "ballast_checkpoint_pool_misses", "Checkpoint buffer requests that allocated", value=p.misses
        )
        yield CounterMetricFamily(
            "ballast_checkpoint_pool_evictions", "Pooled buffers displaced by larger ones", value=p.evictions
        )
        yield CounterMetricFamily(
            "ballast_checkpoint_pool_declines",
            "Buffers the pool declined (floor, caps, no pool)",
            value=p.declines,
        )
        yield CounterMetricFamily(
            "ballast_checkpoint_pool_trimmed_bytes", "Bytes released by trim", value=p.trimmed_bytes
        )
        yield _gauge(
            "ballast_checkpoint_pool_bytes",
            "Bytes held: pooled buffers and those pending free (the next gauge)",
            p.bytes_held,
        )
        yield _gauge(
            "ballast_checkpoint_pool_pending_free_bytes",
            "Of the bytes held, buffers let go of and freed once their device copies have run",
            p.pending_free_bytes,
        )
        yield _gauge("ballast_checkpoint_pool_buffers", "Buffers pooled (not those pending free)", p.buffers)
        yield _gauge(
            "ballast_checkpoint_pool_high_water_bytes",
            "Most bytes ever held (not reset by trim)",
            p.high_water_bytes,
        )
        yield _gauge("ballast_checkpoint_pool_cap_bytes", "Byte cap at the last put or trim", p.cap_bytes)
        yield _gauge(
            "ballast_checkpoint_pool_pinned",
            "1 if pooled buffers are pinned host memory",
            1.0 if p.pinned else 0.0,
        )


class LadderCollector(_Described):
    """The ladder rung in force, from a callable giving the current plan."""

    def __init__(self, plan: Callable[[], LadderPlan]) -> None:
        self._plan = plan

    def collect(self) -> Iterator[Metric]:
        p = self._plan()
        yield _gauge("ballast_ladder_level", "Level the ladder plan was made for (0-3)", int(p.level))
        yield _gauge("ballast_ladder_max_slots", "Slot ceiling the ladder allows", p.max_slots)
        yield _gauge(
            "ballast_ladder_context_window", "Context window the ladder allows, tokens", p.context_window
        )
        yield _gauge(
            "ballast_ladder_force_quantized_kv",
            "1 if new KV caches are forced to a quantized format",
            float(p.force_quantized_kv),
        )
        yield _gauge("ballast_ladder_kv_evict", "1 if KV eviction is on", float(p.kv_evict))
        yield _gauge(
            "ballast_ladder_shed_prefix_cache",
            "1 if the prefix/checkpoint cache is being shed",
            float(p.shed_prefix_cache),
        )
        yield _gauge("ballast_ladder_degraded", "1 if any rung reduced a configured value", float(p.degraded))


class AdmissionMetrics:
    """Counts admission verdicts by result (admit/cap/reject) and reason class."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._verdicts = Counter(
            "ballast_admission_verdicts",
            "Admission verdicts by result and reason class",
            ["result", "reason"],
            registry=registry,
        )

    def record(self, verdict: Verdict) -> None:
        self._verdicts.labels(verdict.kind.value, reason_class(verdict)).inc()


def register_memory_metrics(
    registry: CollectorRegistry,
    snapshot: Callable[[], MemState],
    pool: CheckpointPool | None = None,
    plan: Callable[[], LadderPlan] | None = None,
) -> AdmissionMetrics:
    """Register the memory layer's collectors on `registry`; returns the verdict counter."""
    registry.register(MemoryCollector(snapshot))
    if pool is not None:
        registry.register(PoolCollector(pool))
    if plan is not None:
        registry.register(LadderCollector(plan))
    return AdmissionMetrics(registry)
