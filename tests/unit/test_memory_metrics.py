"""Memory metrics: the exposition parses with prometheus_client's parser and carries real figures."""

from __future__ import annotations

import pytest
import torch
from ballast.memory.admission import admit_request
from ballast.memory.ladder import LadderConfig, plan_for
from ballast.memory.metrics import register_memory_metrics
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import (
    CostModel,
    DieState,
    GiB,
    HostSample,
    Level,
    MemState,
    MiB,
    Verdict,
    VerdictKind,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

HOST = HostSample(
    total_bytes=64 * GiB,
    available_bytes=20 * GiB,
    psi_some_avg10=3.5,
    psi_full_avg10=0.25,
    cgroup_version=2,
    cgroup_usage_bytes=10 * GiB,
    cgroup_high_bytes=0,
    cgroup_max_bytes=32 * GiB,
)
DIE = DieState(
    index=0,
    name="H200",
    total_bytes=140 * GiB,
    free_bytes=100 * GiB,
    budget_bytes=139 * GiB,
    ledger_bytes=30 * GiB,
    ceiling_bytes=90 * GiB,
    level=Level.WATCH,
)
STATE = MemState(
    host=HOST,
    dies=(DIE,),
    host_level=Level.TIGHT,
    level=Level.TIGHT,
    host_reserve_bytes=5 * GiB,
    seq=42,
    taken_at=1.0,
)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """name+labels -> value, through the real text format and parser."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_level_and_signal_gauges() -> None:
    reg = CollectorRegistry()
    register_memory_metrics(reg, lambda: STATE)
    m = scrape(reg)
    assert m[("ballast_memory_pressure_level", ())] == 2
    for state, value in (("ok", 0), ("watch", 0), ("tight", 1), ("critical", 0)):
        assert m[("ballast_memory_pressure_state", (("state", state),))] == value
    assert m[("ballast_host_memory_total_bytes", ())] == 64 * GiB
    assert m[("ballast_host_memory_available_bytes", ())] == 20 * GiB
    assert m[("ballast_host_memory_effective_total_bytes", ())] == 32 * GiB
    assert m[("ballast_host_memory_effective_available_bytes", ())] == 20 * GiB  # min(20, 32 - 10)
    assert m[("ballast_host_memory_reserve_bytes", ())] == 5 * GiB
    assert m[("ballast_host_memory_budget_bytes", ())] == 15 * GiB
    assert m[("ballast_memory_psi_some_avg10", ())] == 3.5
    assert m[("ballast_memory_psi_full_avg10", ())] == 0.25
    assert m[("ballast_cgroup_version", ())] == 2
    assert m[("ballast_cgroup_memory_usage_bytes", ())] == 10 * GiB
    assert m[("ballast_cgroup_memory_max_bytes", ())] == 32 * GiB
    assert m[("ballast_memwatch_snapshot_seq", ())] == 42
    gpu = (("gpu", "0"),)
    assert m[("ballast_gpu_memory_free_bytes", gpu)] == 100 * GiB
    assert m[("ballast_gpu_memory_budget_bytes", gpu)] == 139 * GiB
    assert m[("ballast_gpu_memory_ledger_bytes", gpu)] == 30 * GiB
    assert m[("ballast_gpu_memory_ceiling_bytes", gpu)] == 90 * GiB
    assert m[("ballast_gpu_memory_level", gpu)] == 1


def test_scrape_reads_the_live_snapshot() -> None:
    current = [STATE]
    reg = CollectorRegistry()
    register_memory_metrics(reg, lambda: current[0])
    assert scrape(reg)[("ballast_memory_pressure_level", ())] == 2
    current[0] = MemState(host=HOST, level=Level.CRITICAL, seq=43)
    m = scrape(reg)
    assert m[("ballast_memory_pressure_level", ())] == 3
    assert ("ballast_gpu_memory_free_bytes", (("gpu", "0"),)) not in m
    assert ("ballast_memwatch_snapshot_age_seconds", ()) not in m  # a placeholder has no age


def test_pool_ladder_and_admission_counters() -> None:
    pool = CheckpointPool(lambda: 64 * MiB, 0.5, 4, 1024, pin=False)
    pool.put(torch.empty(MiB, dtype=torch.uint8))
    pool.get(512 * 1024)  # hit
    pool.get(4 * MiB)  # miss
    pool.put(torch.empty(2 * MiB, dtype=torch.uint8))
    pool.trim(0)
    plan = plan_for(Level.TIGHT, LadderConfig(max_slots=8, context_window=4096))
    reg = CollectorRegistry()
    admission = register_memory_metrics(reg, lambda: STATE, pool=pool, plan=lambda: plan)

    cost = CostModel(kv_bytes_per_token=1000, state_bytes_per_slot=0, activation_bytes_per_prefill_token=0)
    stalled = MemState(host=HostSample(total_bytes=GiB, available_bytes=GiB, psi_full_avg10=50.0))
    admission.record(
        admit_request(
            10, 10, STATE, cost, max_window=4096, gpu_die=None, quantized_kv=False, psi_full_reject_pct=15.0
        )
    )
    admission.record(
        admit_request(
            10, 10, stalled, cost, max_window=4096, gpu_die=None, quantized_kv=False, psi_full_reject_pct=15.0
        )
    )
    admission.record(
        admit_request(
            10, 10, STATE, cost, max_window=16, gpu_die=None, quantized_kv=False, psi_full_reject_pct=15.0
        )
    )
    admission.record(Verdict(VerdictKind.REJECT, 0, "something the scheduler decided"))

    m = scrape(reg)
    assert m[("ballast_checkpoint_pool_hits_total", ())] == 1
    assert m[("ballast_checkpoint_pool_misses_total", ())] == 1
    assert m[("ballast_checkpoint_pool_bytes", ())] == 0
    assert m[("ballast_checkpoint_pool_high_water_bytes", ())] == 2 * MiB
    assert m[("ballast_checkpoint_pool_buffers", ())] == 0
    assert m[("ballast_checkpoint_pool_trimmed_bytes_total", ())] == 2 * MiB
    assert m[("ballast_ladder_max_slots", ())] == 4
    assert m[("ballast_ladder_context_window", ())] == 2048
    assert m[("ballast_ladder_kv_evict", ())] == 1
    assert m[("ballast_ladder_force_quantized_kv", ())] == 1
    assert m[("ballast_ladder_shed_prefix_cache", ())] == 1
    assert m[("ballast_ladder_degraded", ())] == 1
    verdicts = "ballast_admission_verdicts_total"
    assert m[(verdicts, (("reason", "none"), ("result", "admit")))] == 1
    assert m[(verdicts, (("reason", "stall"), ("result", "reject")))] == 1
    assert m[(verdicts, (("reason", "window"), ("result", "cap")))] == 1
    assert m[(verdicts, (("reason", "other"), ("result", "reject")))] == 1


def test_registering_twice_is_an_error() -> None:
    reg = CollectorRegistry()
    register_memory_metrics(reg, lambda: STATE)
    with pytest.raises(ValueError, match="Duplicated"):
        register_memory_metrics(reg, lambda: STATE)
