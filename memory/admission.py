"""Admission control: pure functions that say ADMIT, CAP(fit) or REJECT(reason) before work starts.

Nothing here reads a file, a clock or a global: the caller hands in the snapshot (`MemState`), the
cost of a token (`CostModel`) and the operator's numbers, so every decision is a table lookup a
test can reproduce. The order of checks:

1. PSI-full stall guard: a box that is already stalling on memory refuses everything, whatever
   the byte maths says, because the byte figures lag a stall (MemAvailable stays high while the
   kernel thrashes reclaim).
2. GPU-resident path (a die is named): the request's KV + recurrent state must fit the die's
   ledger headroom, and the host must not already be inside its reserve; prefill activations live
   on the die in bounded scratch that was reserved when the model was admitted, so the host pays
   nothing per token here.
3. Host path (no die): KV + state + prefill activations must fit the host budget (effective
   available minus the reserve); when the whole request does not fit, the largest window that
   does is found by binary search and offered as a CAP.

Reasons are short operator-readable strings that start with a `Cause` phrase, so metrics can
count refusals by class without another field on `Verdict` (see `reason_class`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ballast.memory.errors import UnknownDie
from ballast.memory.types import CostModel, DieState, MemState, MiB, PoolRoom, Verdict, VerdictKind


class Cause(enum.Enum):
    """Why a verdict is not a plain ADMIT. The value is the phrase a reason string starts with."""

    STALL = "sustained memory stall — retry"
    HOST_RESERVE = "host memory inside its reserve"
    HOST_BUDGET = "host memory budget"
    DIE_BUDGET = "GPU memory budget"
    WINDOW = "context window limit"
    LOAD = "model does not fit"
    LOAD_SPIKE = "load spike does not fit"


def reason_class(verdict: Verdict) -> str:
    """A low-cardinality label for a verdict's reason ("none" for a plain ADMIT, "other" if foreign)."""
    if not verdict.reason:
        return "none"
    for cause in Cause:
        if verdict.reason.startswith(cause.value):
            return cause.name.lower()
    return "other"


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def _reason(cause: Cause, detail: str = "") -> str:
    return f"{cause.value}: {detail}" if detail else cause.value


def largest_fitting_window(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """Largest w in [lo, hi] with fits(w), for a `fits` that is true up to some w and false after.

    None when not even `lo` fits. Costs grow with the window, so the predicate is monotone and a
    binary search finds the boundary in log2(hi - lo) probes.
    """
    if lo > hi or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def die_request_bytes(cost: CostModel, n_tokens: int, quantized_kv: bool) -> int:
    """Bytes a request takes on its die: KV blocks for n_tokens (and a slot's recurrent state
    unless every slot's was allocated at load). Activations are not counted here: they live in
    the scratch reserved when the model was loaded."""
    return cost.cache_bytes(n_tokens, quantized_kv)


def _find_die(state: MemState, die: int) -> DieState:
    for d in state.dies:
        if d.index == die:
            return d
    raise UnknownDie(die)


def _decide(
    n_tokens: int, max_window: int, min_window: int, fits: Callable[[int], bool], cause: Cause, budget: int
) -> Verdict:
    """ADMIT when the whole request fits under both limits, else CAP at the largest fitting window."""
    lo = min(min_window, n_tokens)
    hi = min(n_tokens, max_window)
    if lo > hi:
        return Verdict(
            VerdictKind.REJECT,
            0,
            _reason(Cause.WINDOW, f"{n_tokens} tokens need a window of at least {lo}, limit is {max_window}"),
        )
    fit = largest_fitting_window(lo, hi, fits)
    if fit is None:
        return Verdict(VerdictKind.REJECT, 0, _reason(cause, f"not even {lo} tokens fit in {_mib(budget)}"))
    if fit == n_tokens:
        return Verdict(VerdictKind.ADMIT, n_tokens)
    if fit == hi:  # memory would take more: the window limit is what binds
        return Verdict(VerdictKind.CAP, fit, _reason(Cause.WINDOW, f"{n_tokens} tokens capped to {fit}"))
    return Verdict(VerdictKind.CAP, fit, _reason(cause, f"{fit} of {n_tokens} tokens fit in {_mib(budget)}"))


def admit_request(
    n_prompt: int,
    max_new_tokens: int,
    state: MemState,
    cost: CostModel,
    *,
    max_window: int,
    gpu_die: int | None,
    quantized_kv: bool,
    psi_full_reject_pct: float,
    min_window: int = 1,
    pool: PoolRoom | None = None,
) -> Verdict:
    """Decide whether a request of n_prompt + max_new_tokens tokens may start now.

    max_window is the operator's context limit already clamped by the ladder's context window.
    min_window is the smallest window worth running: 1 follows the seed (a CAP may cut the
    prompt); a scheduler that would rather refuse than truncate passes n_prompt + 1.
    pool: the KV pool's room; its spare blocks count on top of new memory, and it never grows past
    its limits (None: no pool, every byte is new memory).
    ADMIT's fit_tokens is the whole request; CAP's is the largest window that fits.
    Raises ValueError for impossible arguments and UnknownDie for a die not in the snapshot.
    """
    if n_prompt < 0 or max_new_tokens < 0 or n_prompt + max_new_tokens < 1:
        raise ValueError(
            f"request must hold at least one token (n_prompt={n_prompt}, max_new_tokens={max_new_tokens})"
        )
    if max_window < 1 or min_window < 1:
        raise ValueError(f"windows must be >= 1 (max_window={max_window}, min_window={min_window})")
    n_tokens = n_prompt + max_new_tokens

    psi_full = state.host.psi_full_avg10
    if psi_full >= psi_full_reject_pct:
        return Verdict(
            VerdictKind.REJECT,
            0,
            _reason(Cause.STALL, f"PSI full avg10 {psi_full:.1f}% >= {psi_full_reject_pct:.1f}%"),
        )

    if gpu_die is not None:
        die = _find_die(state, gpu_die)
        host_avail = state.host.effective_available_bytes
        if host_avail <= state.host_reserve_bytes:
            return Verdict(
                VerdictKind.REJECT,
                0,
                _reason(
                    Cause.HOST_RESERVE,
                    f"{_mib(host_avail)} available, reserve {_mib(state.host_reserve_bytes)}",
                ),
            )
        # A die with no ceiling yet (model not loaded there) has no headroom: refusing is the safe
        # reading of "unknown", as a failed host total is never read as "huge".
        # New memory is bounded by the ledger's ceiling (fixed at load) and by what the driver has
        # free now above the die's reserve: another process may have taken the rest since the load,
        # and a grant the allocator cannot deliver stalls the request instead of refusing it.
        room = pool or PoolRoom()
        free_now = max(0, die.free_bytes - (die.total_bytes - die.budget_bytes))
        new = min(max(0, die.ceiling_bytes - die.ledger_bytes), free_now, room.addable_bytes)
        headroom = new + room.spare_bytes
        return _decide(
            n_tokens,
            max_window,
            min_window,
            lambda w: die_request_bytes(cost, w, quantized_kv) <= headroom,
            Cause.DIE_BUDGET,
            headroom,
        )

    room = pool or PoolRoom()
    budget = state.host_budget_bytes + room.spare_bytes
    kv_room = room.addable_bytes + room.spare_bytes

    def fits(w: int) -> bool:
        return cost.request_bytes(w, quantized_kv) <= budget and cost.kv_bytes(w, quantized_kv) <= kv_room

    return _decide(n_tokens, max_window, min_window, fits, Cause.HOST_BUDGET, budget)


def admit_model_load(
    weights_bytes: int,
    kv_bytes_at_max_ctx: int,
    activation_reserve_bytes: int,
    die_free: int,
    die_reserve: int,
) -> Verdict:
    """Gate a model upload to one die: weights + KV at max context + activation reserve must fit
    in the die's free VRAM minus its reserve."""
    if min(weights_bytes, kv_bytes_at_max_ctx, activation_reserve_bytes, die_free, die_reserve) < 0:
        raise ValueError("model-load figures must be non-negative")
    need = weights_bytes + kv_bytes_at_max_ctx + activation_reserve_bytes
    room = max(0, die_free - die_reserve)
    if need <= room:
        return Verdict(VerdictKind.ADMIT)
    detail = (
        f"needs {_mib(need)} (weights {_mib(weights_bytes)}, KV {_mib(kv_bytes_at_max_ctx)}, "
        f"activations {_mib(activation_reserve_bytes)}), {_mib(room)} free above reserve"
    )
    return Verdict(VerdictKind.REJECT, 0, _reason(Cause.LOAD, detail))


@dataclass(frozen=True)
class DieSlice:
    """The part of a split model that one die would hold, and what that die has."""

    die: int
    weights_bytes: int
    kv_bytes: int
    free_bytes: int
    reserve_bytes: int

    def __post_init__(self) -> None:
        if min(self.weights_bytes, self.kv_bytes, self.free_bytes, self.reserve_bytes) < 0:
            raise ValueError(f"invalid DieSlice {self}")


def admit_model_load_split(slices: Sequence[DieSlice], scratch_bytes: int) -> Verdict:
    """Gate a model split over several dies: each die's weights + KV slice + scratch
    (MemoryConfig.die_scratch_bytes) must fit that die's free VRAM minus its reserve.
    The reason names every die that does not fit."""
    if not slices:
        raise ValueError("a split load needs at least one die slice")
    if scratch_bytes < 0:
        raise ValueError(f"scratch_bytes must be non-negative, got {scratch_bytes}")
    short: list[str] = []
    for s in slices:
        need = s.weights_bytes + s.kv_bytes + scratch_bytes
        room = max(0, s.free_bytes - s.reserve_bytes)
        if need > room:
            short.append(f"GPU {s.die} needs {_mib(need)}, has {_mib(room)}")
    if short:
        return Verdict(VerdictKind.REJECT, 0, _reason(Cause.LOAD, "; ".join(short)))
    return Verdict(VerdictKind.ADMIT)


def admit_load_spike(spike_bytes: int, state: MemState, *, host_weights_bytes: int = 0) -> Verdict:
    """Gate the start of a load on host headroom for its staging burst.

    On a CPU load the weights themselves land in host RAM, so the caller passes them as
    host_weights_bytes; on a GPU load they pass through in chunks covered by spike_bytes.
    """
    if spike_bytes < 0 or host_weights_bytes < 0:
        raise ValueError("load-spike figures must be non-negative")
    need = spike_bytes + host_weights_bytes
    budget = state.host_budget_bytes
    if need <= budget:
        return Verdict(VerdictKind.ADMIT)
    return Verdict(
        VerdictKind.REJECT,
        0,
        _reason(Cause.LOAD_SPIKE, f"needs {_mib(need)} of host memory, {_mib(budget)} above the reserve"),
    )
