"""The degradation ladder: a pure planner from a pressure level to what may run.

Given a level and the operator's config, `plan_for` returns absolute values the scheduler and
engine apply, never deltas, so applying the same plan twice is harmless and a lost update cannot
drift the system. Rungs are reduce-only and monotonic: a higher level never relaxes what a lower
one engaged, and at OK the plan is the config exactly (so a calm ballast behaves as if the memory
layer were not there).

| level    | rungs                                                                    |
|----------|--------------------------------------------------------------------------|
| WATCH    | quantized KV for new caches; shed the prefix/checkpoint cache            |
| TIGHT    | + slots / 2, context window / 2 (each >= 1), KV eviction flag           |
| CRITICAL | + 1 slot, context window / 4 (>= 1)                                      |

Shedding cached state comes first (beyond the seed): it is the cheapest memory to give back,
since nothing running depends on it. Quantized KV only affects caches built from now on; a live
cache is never converted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ballast.memory.types import LadderPlan, Level, MemState


@dataclass(frozen=True)
class LadderConfig:
    """What the operator configured: the plan at OK, and the ceiling every other plan stays under."""

    max_slots: int
    context_window: int

    def __post_init__(self) -> None:
        if self.max_slots < 1 or self.context_window < 1:
            raise ValueError(f"LadderConfig needs max_slots >= 1 and context_window >= 1, got {self}")


def plan_for(level: Level, config: LadderConfig, *, disabled: bool = False) -> LadderPlan:
    """The plan at `level`. With `disabled` (BALLAST_LADDER_DISABLE) the config applies at every level."""
    if disabled or level is Level.OK:
        note = "ladder disabled" if disabled and level is not Level.OK else ""
        return LadderPlan(
            level=level, max_slots=config.max_slots, context_window=config.context_window, note=note
        )

    slots, window = config.max_slots, config.context_window
    reduced = ["quantized KV for new caches", "prefix cache shed"]
    if level is Level.TIGHT:
        slots, window = max(1, slots // 2), max(1, window // 2)
    elif level is Level.CRITICAL:
        slots, window = 1, max(1, window // 4)
    if slots < config.max_slots:
        reduced.append(f"slots {config.max_slots} -> {slots}")
    if window < config.context_window:
        reduced.append(f"context window {config.context_window} -> {window}")
    kv_evict = level >= Level.TIGHT
    if kv_evict:
        reduced.append("KV eviction on")
    return LadderPlan(
        level=level,
        max_slots=slots,
        context_window=window,
        force_quantized_kv=True,
        kv_evict=kv_evict,
        shed_prefix_cache=True,
        degraded=True,
        note=f"{level.name}: " + ", ".join(reduced),
    )


def plan_from_state(state: MemState, config: LadderConfig, disabled: bool = False) -> LadderPlan:
    """The plan for a MemWatch snapshot's overall level."""
    return plan_for(state.level, config, disabled=disabled)
