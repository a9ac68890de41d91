"""Admission verdicts: table tests for the decision order and property tests for the byte maths."""

from __future__ import annotations

import pytest
from ballast.memory.admission import (
    DieSlice,
    admit_load_spike,
    admit_model_load,
    admit_model_load_split,
    admit_request,
    die_request_bytes,
    largest_fitting_window,
    reason_class,
)
from ballast.memory.errors import UnknownDie
from ballast.memory.types import (
    CostModel,
    DieState,
    GiB,
    HostSample,
    MemState,
    MiB,
    PoolRoom,
    Verdict,
    VerdictKind,
)
from hypothesis import given, settings
from hypothesis import strategies as st

PSI_REJECT = 15.0


def host_state(
    available: int,
    reserve: int = GiB,
    total: int = 64 * GiB,
    psi_full: float = 0.0,
    dies: tuple[DieState, ...] = (),
) -> MemState:
    return MemState(
        host=HostSample(total_bytes=total, available_bytes=available, psi_full_avg10=psi_full),
        dies=dies,
        host_reserve_bytes=reserve,
    )


def die(index: int = 0, ceiling: int = 8 * GiB, ledger: int = 0, free: int = 10 * GiB) -> DieState:
    return DieState(
        index=index,
        total_bytes=16 * GiB,
        free_bytes=free,
        budget_bytes=15 * GiB,
        ledger_bytes=ledger,
        ceiling_bytes=ceiling,
    )


COST = CostModel(
    kv_bytes_per_token=1000,
    state_bytes_per_slot=5000,
    activation_bytes_per_prefill_token=0,
    quantized_kv_bytes_per_token=250,
)


def admit(
    n_prompt: int,
    n_new: int,
    state: MemState,
    cost: CostModel = COST,
    *,
    max_window: int = 1 << 20,
    gpu_die: int | None = None,
    quantized_kv: bool = False,
    min_window: int = 1,
    pool: PoolRoom | None = None,
) -> Verdict:
    return admit_request(
        n_prompt,
        n_new,
        state,
        cost,
        max_window=max_window,
        gpu_die=gpu_die,
        quantized_kv=quantized_kv,
        psi_full_reject_pct=PSI_REJECT,
        min_window=min_window,
        pool=pool,
    )


# --- decision order -------------------------------------------------------------------------


def test_psi_full_stall_guard_comes_first() -> None:
    # Plenty of bytes, and a die that does not exist: the stall guard answers before either matters.
    state = host_state(available=32 * GiB, psi_full=PSI_REJECT)
    v = admit(10, 10, state, gpu_die=7)
    assert v.kind is VerdictKind.REJECT
    assert v.reason.startswith("sustained memory stall — retry")
    assert reason_class(v) == "stall"


def test_psi_full_below_threshold_is_byte_maths() -> None:
    v = admit(10, 10, host_state(available=32 * GiB, psi_full=PSI_REJECT - 0.1))
    assert v == Verdict(VerdictKind.ADMIT, 20)
    assert reason_class(v) == "none"


def test_gpu_path_rejects_when_host_inside_reserve() -> None:
    state = host_state(available=GiB, reserve=GiB, dies=(die(),))
    v = admit(10, 10, state, gpu_die=0)
    assert v.kind is VerdictKind.REJECT and reason_class(v) == "host_reserve"


def test_gpu_path_ignores_host_activations() -> None:
    # Activations live on the die in scratch reserved at load: a host that could not hold them
    # (1 MiB budget vs 1 GiB of activations) still admits a GPU-resident request.
    cost = CostModel(kv_bytes_per_token=1000, state_bytes_per_slot=0, activation_bytes_per_prefill_token=GiB)
    state = host_state(available=GiB + MiB, reserve=GiB, dies=(die(),))
    assert admit(100, 0, state, cost, gpu_die=0).kind is VerdictKind.ADMIT
    assert admit(100, 0, state, cost, gpu_die=None).kind is VerdictKind.REJECT


def test_gpu_path_caps_at_max_window() -> None:
    v = admit(3000, 1000, host_state(available=8 * GiB, dies=(die(),)), gpu_die=0, max_window=2048)
    assert v.kind is VerdictKind.CAP and v.fit_tokens == 2048 and reason_class(v) == "window"


def test_gpu_path_caps_at_ledger_headroom() -> None:
    # headroom 105_000 bytes = state 5000 + 100 tokens x 1000
    state = host_state(available=8 * GiB, dies=(die(ceiling=1_105_000, ledger=1_000_000),))
    v = admit(120, 30, state, gpu_die=0)
    assert v.kind is VerdictKind.CAP and v.fit_tokens == 100 and reason_class(v) == "die_budget"
    assert admit(60, 40, state, gpu_die=0) == Verdict(VerdictKind.ADMIT, 100)


def test_gpu_path_counts_only_what_the_driver_has_free_now() -> None:
    """Another process took the die's VRAM after the load: the ledger's ceiling still has room,
    but new memory is what the driver has free above the die's reserve (1 GiB here); blocks the
    pool already holds still count."""
    squeezed = host_state(available=8 * GiB, dies=(die(free=GiB + 105_000),))
    v = admit(120, 30, squeezed, gpu_die=0)  # 105_000 bytes above the reserve: 100 tokens
    assert v.kind is VerdictKind.CAP and v.fit_tokens == 100 and reason_class(v) == "die_budget"
    gone = host_state(available=8 * GiB, dies=(die(free=GiB // 2),))
    assert admit(10, 10, gone, gpu_die=0).kind is VerdictKind.REJECT
    pool = PoolRoom(free_bytes=200_000, promised_bytes=0, addable_bytes=GiB)
    assert admit(10, 10, gone, gpu_die=0, pool=pool).kind is VerdictKind.ADMIT


def test_gpu_path_die_without_ceiling_rejects() -> None:
    v = admit(1, 1, host_state(available=8 * GiB, dies=(die(ceiling=0),)), gpu_die=0)
    assert v.kind is VerdictKind.REJECT and reason_class(v) == "die_budget"


def test_gpu_path_unknown_die_raises() -> None:
    with pytest.raises(UnknownDie):
        admit(1, 1, host_state(available=8 * GiB, dies=(die(index=0),)), gpu_die=1)


def test_host_path_admit_cap_reject() -> None:
    # budget = available - reserve = 105_000 = state 5000 + 100 tokens x 1000
    state = host_state(available=GiB + 105_000, reserve=GiB)
    assert admit(50, 50, state) == Verdict(VerdictKind.ADMIT, 100)
    capped = admit(100, 50, state)
    assert (
        capped.kind is VerdictKind.CAP and capped.fit_tokens == 100 and reason_class(capped) == "host_budget"
    )
    tiny = host_state(available=GiB + 5000, reserve=GiB)  # the slot's state fits, not one token
    v = admit(1, 1, tiny)
    assert v.kind is VerdictKind.REJECT and reason_class(v) == "host_budget"


def test_host_path_quantized_kv_fits_more() -> None:
    state = host_state(available=GiB + 105_000, reserve=GiB)
    v = admit(300, 100, state, quantized_kv=True)  # 400 x 250 + 5000 = 105_000
    assert v == Verdict(VerdictKind.ADMIT, 400)


def test_min_window_refuses_instead_of_truncating_the_prompt() -> None:
    state = host_state(available=GiB + 105_000, reserve=GiB)
    assert admit(100, 50, state, min_window=101).kind is VerdictKind.REJECT
    assert admit(99, 50, state, min_window=100).fit_tokens == 100
    v = admit(300, 10, state, max_window=200, min_window=301)
    assert v.kind is VerdictKind.REJECT and reason_class(v) == "window"


def test_failed_host_read_is_no_budget() -> None:
    # total and available unknown (0): the host path must refuse, never treat it as room.
    state = host_state(available=0, total=0)
    assert admit(1, 1, state).kind is VerdictKind.REJECT


@pytest.mark.parametrize("args", [(-1, 1), (0, 0), (1, -1)])
def test_invalid_request_raises(args: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        admit(args[0], args[1], host_state(available=8 * GiB))


def test_invalid_window_raises() -> None:
    with pytest.raises(ValueError):
        admit(1, 1, host_state(available=8 * GiB), max_window=0)


# --- properties -----------------------------------------------------------------------------

costs = st.builds(
    CostModel,
    kv_bytes_per_token=st.integers(1, 1 << 20),
    state_bytes_per_slot=st.integers(0, 1 << 30),
    activation_bytes_per_prefill_token=st.integers(0, 1 << 16),
    quantized_kv_bytes_per_token=st.integers(0, 1 << 18),
)


@settings(max_examples=300, deadline=None)
@given(
    cost=costs,
    n_prompt=st.integers(0, 1 << 17),
    n_new=st.integers(1, 1 << 14),
    budget=st.integers(0, 1 << 36),
    max_window=st.integers(1, 1 << 18),
    min_window=st.integers(1, 1 << 10),
    quantized=st.booleans(),
)
def test_host_verdict_within_budget_and_cap_is_largest(
    cost: CostModel, n_prompt: int, n_new: int, budget: int, max_window: int, min_window: int, quantized: bool
) -> None:
    state = host_state(available=GiB + budget, reserve=GiB)
    assert state.host_budget_bytes == budget
    v = admit(
        n_prompt, n_new, state, cost, max_window=max_window, min_window=min_window, quantized_kv=quantized
    )
    n = n_prompt + n_new
    fits = lambda w: cost.request_bytes(w, quantized) <= budget  # noqa: E731
    if v.kind is VerdictKind.REJECT:
        lo = min(min_window, n)
        assert lo > max_window or not fits(lo)
        return
    assert fits(v.fit_tokens), "an admitted window exceeded the budget it was given"
    assert min(min_window, n) <= v.fit_tokens <= min(n, max_window)
    if v.kind is VerdictKind.ADMIT:
        assert v.fit_tokens == n
    else:
        assert v.fit_tokens < n
        assert v.fit_tokens == max_window or not fits(v.fit_tokens + 1), (
            "CAP was not the largest fitting window"
        )


@settings(max_examples=300, deadline=None)
@given(
    cost=costs,
    n_prompt=st.integers(0, 1 << 17),
    n_new=st.integers(1, 1 << 14),
    headroom=st.integers(0, 1 << 36),
    ledger=st.integers(0, 1 << 34),
    max_window=st.integers(1, 1 << 18),
    quantized=st.booleans(),
)
def test_gpu_verdict_within_ledger_headroom(
    cost: CostModel, n_prompt: int, n_new: int, headroom: int, ledger: int, max_window: int, quantized: bool
) -> None:
    # the driver has more free than the ledger allows: the ledger's headroom binds
    state = host_state(available=8 * GiB, dies=(die(ceiling=ledger + headroom, ledger=ledger, free=1 << 40),))
    v = admit(n_prompt, n_new, state, cost, gpu_die=0, max_window=max_window, quantized_kv=quantized)
    n = n_prompt + n_new
    fits = lambda w: die_request_bytes(cost, w, quantized) <= headroom  # noqa: E731
    if v.kind is VerdictKind.REJECT:
        assert not fits(1)
        return
    assert fits(v.fit_tokens) and v.fit_tokens <= min(n, max_window)
    if v.kind is VerdictKind.CAP:
        assert v.fit_tokens == max_window or not fits(v.fit_tokens + 1)


@given(lo=st.integers(0, 1000), span=st.integers(0, 1000), boundary=st.integers(-10, 2100))
def test_largest_fitting_window_is_the_boundary(lo: int, span: int, boundary: int) -> None:
    hi = lo + span
    got = largest_fitting_window(lo, hi, lambda w: w <= boundary)
    expected = min(hi, boundary) if boundary >= lo else None
    assert got == expected


# --- model load and load spike --------------------------------------------------------------


def test_admit_model_load_boundary() -> None:
    assert admit_model_load(6 * GiB, GiB, GiB, die_free=9 * GiB, die_reserve=GiB).kind is VerdictKind.ADMIT
    v = admit_model_load(6 * GiB, GiB, GiB + 1, die_free=9 * GiB, die_reserve=GiB)
    assert v.kind is VerdictKind.REJECT and reason_class(v) == "load"


def test_admit_model_load_split_names_each_short_die() -> None:
    scratch = 512 * MiB
    ok = DieSlice(die=0, weights_bytes=4 * GiB, kv_bytes=GiB, free_bytes=7 * GiB, reserve_bytes=GiB)
    short = DieSlice(die=1, weights_bytes=4 * GiB, kv_bytes=GiB, free_bytes=6 * GiB, reserve_bytes=GiB)
    assert admit_model_load_split([ok, ok], scratch).kind is VerdictKind.ADMIT
    v = admit_model_load_split([ok, short, DieSlice(3, 0, 0, 0, 0)], scratch)
    assert v.kind is VerdictKind.REJECT
    assert "GPU 1" in v.reason and "GPU 3" in v.reason and "GPU 0" not in v.reason


def test_admit_load_spike_counts_cpu_weights() -> None:
    state = host_state(available=3 * GiB, reserve=GiB)  # 2 GiB above the reserve
    assert admit_load_spike(GiB, state).kind is VerdictKind.ADMIT
    v = admit_load_spike(GiB, state, host_weights_bytes=GiB + 1)
    assert v.kind is VerdictKind.REJECT and reason_class(v) == "load_spike"


def test_requests_pay_whole_kv_blocks_and_no_preallocated_state() -> None:
    """KV is charged in whole blocks of the pool; a slot's recurrent state, allocated for every
    slot at load, is not charged again."""
    cost = CostModel(
        kv_bytes_per_token=1000,
        state_bytes_per_slot=5000,
        activation_bytes_per_prefill_token=10,
        prefill_chunk_tokens=64,
        kv_block_tokens=32,
        state_preallocated=True,
    )
    assert die_request_bytes(cost, 1, False) == 32 * 1000
    assert die_request_bytes(cost, 32, False) == 32 * 1000
    assert die_request_bytes(cost, 33, False) == 64 * 1000
    assert cost.request_bytes(100) == 128 * 1000 + 64 * 10
    fresh = CostModel(
        kv_bytes_per_token=1000, state_bytes_per_slot=5000, activation_bytes_per_prefill_token=10
    )
    assert fresh.request_bytes(100) == 100 * 1000 + 5000 + 100 * 10
