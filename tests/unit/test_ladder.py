"""The degradation ladder: exact rungs per level, and reduce-only / monotonic for every config."""

from __future__ import annotations

from itertools import pairwise

import pytest
from ballast.memory.ladder import LadderConfig, plan_for, plan_from_state
from ballast.memory.types import HostSample, LadderPlan, Level, MemState
from hypothesis import given
from hypothesis import strategies as st

CFG = LadderConfig(max_slots=8, context_window=4096)


def test_ok_plan_is_the_config_exactly() -> None:
    assert plan_for(Level.OK, CFG) == LadderPlan(level=Level.OK, max_slots=8, context_window=4096)


def test_watch_quantizes_and_sheds_the_prefix_cache_only() -> None:
    p = plan_for(Level.WATCH, CFG)
    assert (p.max_slots, p.context_window) == (8, 4096)
    assert p.force_quantized_kv and p.shed_prefix_cache and p.degraded and not p.kv_evict
    assert "quantized KV" in p.note and "prefix cache" in p.note


def test_tight_halves_and_evicts() -> None:
    p = plan_for(Level.TIGHT, CFG)
    assert (p.max_slots, p.context_window, p.kv_evict) == (4, 2048, True)
    assert p.force_quantized_kv and p.shed_prefix_cache
    assert "slots 8 -> 4" in p.note and "context window 4096 -> 2048" in p.note


def test_critical_one_slot_quarter_window() -> None:
    p = plan_for(Level.CRITICAL, CFG)
    assert (p.max_slots, p.context_window, p.kv_evict) == (1, 1024, True)
    assert p.note.startswith("CRITICAL")


def test_floors_at_one() -> None:
    tiny = LadderConfig(max_slots=1, context_window=3)
    assert (plan_for(Level.TIGHT, tiny).max_slots, plan_for(Level.TIGHT, tiny).context_window) == (1, 1)
    assert plan_for(Level.CRITICAL, tiny).context_window == 1


@pytest.mark.parametrize("level", list(Level))
def test_disabled_is_the_config_at_every_level(level: Level) -> None:
    p = plan_for(level, CFG, disabled=True)
    assert (
        p.max_slots,
        p.context_window,
        p.force_quantized_kv,
        p.kv_evict,
        p.shed_prefix_cache,
        p.degraded,
    ) == (8, 4096, False, False, False, False)
    assert p.level is level


def test_plan_from_state_reads_the_overall_level() -> None:
    state = MemState(host=HostSample(total_bytes=1, available_bytes=1), level=Level.TIGHT)
    assert plan_from_state(state, CFG) == plan_for(Level.TIGHT, CFG)


@pytest.mark.parametrize("slots,window", [(0, 10), (1, 0), (-1, -1)])
def test_config_is_validated(slots: int, window: int) -> None:
    with pytest.raises(ValueError):
        LadderConfig(max_slots=slots, context_window=window)


def _restriction(p: LadderPlan) -> tuple[int, int, bool, bool, bool]:
    return (p.max_slots, p.context_window, p.force_quantized_kv, p.kv_evict, p.shed_prefix_cache)


@given(slots=st.integers(1, 1 << 12), window=st.integers(1, 1 << 22))
def test_reduce_only_and_monotonic_for_every_config(slots: int, window: int) -> None:
    cfg = LadderConfig(max_slots=slots, context_window=window)
    plans = [plan_for(level, cfg) for level in Level]
    for p in plans:
        assert 1 <= p.max_slots <= slots and 1 <= p.context_window <= window  # reduce-only
    for lower, higher in pairwise(plans):
        assert higher.max_slots <= lower.max_slots and higher.context_window <= lower.context_window
        for was_on, is_on in zip(_restriction(lower)[2:], _restriction(higher)[2:], strict=True):
            assert is_on or not was_on, "a higher level relaxed a rung a lower one engaged"
        assert higher.degraded or not lower.degraded
