"""The scheduler's memory governance, fed by a real MemWatch reading a fixture /proc tree."""

from __future__ import annotations

from pathlib import Path

import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.device import StaticDeviceReader
from ballast.memory.ladder import LadderConfig
from ballast.memory.metrics import AdmissionMetrics
from ballast.memory.types import CostModel, GiB, Level, MiB, PoolRoom
from ballast.memory.watch import MemWatch
from ballast.scheduler.errors import Overloaded
from ballast.scheduler.governor import Governor, GovernorSettings
from memfixtures import level_tree, write_tree
from prometheus_client import CollectorRegistry

CHEAP = CostModel(
    kv_bytes_per_token=64 << 10, state_bytes_per_slot=MiB, activation_bytes_per_prefill_token=4 << 10
)


def verdicts(registry: CollectorRegistry, result: str, reason: str) -> float:
    return (
        registry.get_sample_value("ballast_admission_verdicts_total", {"result": result, "reason": reason})
        or 0.0
    )


def make(
    tmp_path: Path, *, cost: CostModel = CHEAP, disable: bool = False
) -> tuple[Governor, MemWatch, MemoryConfig, CollectorRegistry]:
    cfg = MemoryConfig(root=str(tmp_path))
    level_tree(tmp_path, Level.OK, config=cfg)
    watch = MemWatch(cfg, StaticDeviceReader())
    watch.poll_now()
    registry = CollectorRegistry()
    gov = Governor(
        GovernorSettings(LadderConfig(8, 1024), disable, 15.0, 3.0, None),
        cost,
        watch,
        AdmissionMetrics(registry),
    )
    gov.refresh()
    return gov, watch, cfg, registry


def go(tmp_path: Path, watch: MemWatch, cfg: MemoryConfig, level: Level, gov: Governor) -> None:
    level_tree(tmp_path, level, config=cfg)
    watch.poll_now()
    gov.refresh()


def test_plan_follows_the_snapshot_and_only_critical_refuses_submits(tmp_path: Path) -> None:
    gov, watch, cfg, _ = make(tmp_path)
    seen = []
    for level in (Level.OK, Level.WATCH, Level.TIGHT, Level.CRITICAL, Level.OK):
        go(tmp_path, watch, cfg, level, gov)
        try:
            gov.check_submit()
            refused = False
        except Overloaded as e:
            refused = True
            assert e.retry_after_s == 3.0
        seen.append(
            (gov.snapshot_level, gov.ladder.max_slots, gov.ladder.context_window, gov.pressure_level, refused)
        )
    assert seen == [
        (Level.OK, 8, 1024, Level.OK, False),
        (Level.WATCH, 8, 1024, Level.OK, False),
        # TIGHT alone halves slots and window but holds nothing (only a reject does).
        (Level.TIGHT, 4, 512, Level.OK, False),
        (Level.CRITICAL, 1, 256, Level.CRITICAL, True),
        (Level.OK, 8, 1024, Level.OK, False),
    ]


def test_admit_caps_max_tokens_to_the_ladder_window(tmp_path: Path) -> None:
    gov, watch, cfg, registry = make(tmp_path)
    full = gov.admit(100, 500)
    assert (full.max_tokens, full.capped) == (500, False)
    go(tmp_path, watch, cfg, Level.TIGHT, gov)  # window 512
    capped = gov.admit(100, 500)
    assert (capped.max_tokens, capped.capped) == (412, True)
    assert verdicts(registry, "admit", "none") == 1 and verdicts(registry, "cap", "window") == 1


def test_the_ladder_window_binds_only_requests_that_need_new_memory(tmp_path: Path) -> None:
    """At TIGHT the window halves (512 here) for requests that would take new memory; one whose
    whole window the pool's spare blocks hold costs none and runs at the operator's window (1,024).
    Blocks running requests are promised do not count."""
    gov, watch, cfg, _ = make(tmp_path)
    go(tmp_path, watch, cfg, Level.TIGHT, gov)
    need = CHEAP.cache_bytes(700, False)
    held = PoolRoom(free_bytes=need, addable_bytes=0)
    whole = gov.admit(600, 100, held)
    assert (whole.max_tokens, whole.capped) == (100, False)
    promised = PoolRoom(free_bytes=need, promised_bytes=need // 2, addable_bytes=0)
    with pytest.raises(Overloaded) as refused:
        gov.admit(600, 100, promised)  # the prompt alone is past the TIGHT window
    assert "context window limit" in refused.value.reason
    capped = gov.admit(100, 500, PoolRoom(free_bytes=CHEAP.cache_bytes(600, False) - 1, addable_bytes=0))
    assert (capped.max_tokens, capped.capped) == (412, True)  # short of the whole: the window binds


def test_admit_caps_to_the_host_budget(tmp_path: Path) -> None:
    # 256 MiB of KV per token: the 4.8 GiB budget above the reserve holds ~18 tokens of context.
    gov, _, _, _ = make(
        tmp_path,
        cost=CostModel(
            kv_bytes_per_token=256 * MiB, state_bytes_per_slot=0, activation_bytes_per_prefill_token=0
        ),
    )
    budget = gov.snapshot.host_budget_bytes if gov.snapshot else 0
    fit = budget // (256 * MiB)
    a = gov.admit(10, 100)
    assert a.capped and a.max_tokens == fit - 10 and 0 < a.max_tokens < 100


def test_reject_raises_pressure_until_a_fresh_snapshot(tmp_path: Path) -> None:
    gov, watch, _, registry = make(
        tmp_path,
        cost=CostModel(kv_bytes_per_token=GiB, state_bytes_per_slot=0, activation_bytes_per_prefill_token=0),
    )
    with pytest.raises(Overloaded) as refused:
        gov.admit(50, 10)  # 50 GiB of prompt can never fit: refused, not cut
    assert "host memory budget" in refused.value.reason
    assert verdicts(registry, "reject", "host_budget") == 1
    assert gov.pressure_level == Level.TIGHT and gov.holding and gov.denials == 1
    gov.refresh()  # same snapshot: still held
    assert gov.holding
    watch.poll_now()  # memory looked at again, no worse: retry allowed
    gov.refresh()
    assert not gov.holding and gov.pressure_level == Level.OK


def test_pin_follows_a_worsening_level_and_decays_with_it(tmp_path: Path) -> None:
    gov, watch, cfg, _ = make(tmp_path)
    go(tmp_path, watch, cfg, Level.TIGHT, gov)
    with pytest.raises(Overloaded):
        gov.admit(600, 10)  # longer than the TIGHT window (512)
    assert gov.pressure_level == Level.TIGHT
    go(tmp_path, watch, cfg, Level.CRITICAL, gov)
    assert gov.pressure_level == Level.CRITICAL
    with pytest.raises(Overloaded):
        gov.check_submit()
    go(tmp_path, watch, cfg, Level.WATCH, gov)
    assert gov.pressure_level == Level.OK and not gov.holding
    gov.check_submit()


def test_psi_stall_refuses_and_holds(tmp_path: Path) -> None:
    gov, watch, _, _ = make(tmp_path)
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=12 * GiB, psi_some=40.0, psi_full=20.0)
    watch.poll_now()
    gov.refresh()
    assert gov.snapshot_level == Level.CRITICAL
    with pytest.raises(Overloaded) as refused:
        gov.admit(10, 10)
    assert "stall" in refused.value.reason


def test_disabled_ladder_keeps_the_config_but_backpressure_stays(tmp_path: Path) -> None:
    gov, watch, cfg, _ = make(tmp_path, disable=True)
    go(tmp_path, watch, cfg, Level.CRITICAL, gov)
    assert (gov.ladder.max_slots, gov.ladder.context_window) == (8, 1024)
    with pytest.raises(Overloaded):
        gov.check_submit()


def test_without_memwatch_only_the_window_applies() -> None:
    gov = Governor(GovernorSettings(LadderConfig(4, 64), False, 15.0, 1.0, None), CHEAP)
    gov.refresh()
    assert gov.admit(10, 20).max_tokens == 20
    assert gov.admit(10, 100).max_tokens == 54
    gov.check_submit()
    assert gov.pressure_level == Level.OK and gov.ladder.max_slots == 4


def test_quantized_caches_use_the_quantized_kv_cost(tmp_path: Path) -> None:
    cost = CostModel(
        kv_bytes_per_token=256 * MiB,
        state_bytes_per_slot=0,
        activation_bytes_per_prefill_token=0,
        quantized_kv_bytes_per_token=64 * MiB,
    )
    plain, watch, _, _ = make(tmp_path, cost=cost)
    quant = Governor(
        GovernorSettings(LadderConfig(8, 1024), False, 15.0, 3.0, None, quantized_kv=True), cost, watch
    )
    quant.refresh()
    budget = plain.snapshot.host_budget_bytes if plain.snapshot else 0
    assert plain.admit(10, 500).max_tokens == budget // (256 * MiB) - 10
    assert quant.admit(10, 500).max_tokens == budget // (64 * MiB) - 10
