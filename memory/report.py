"""`ballast memory`: the live snapshot as text, the first thing an operator runs on a new box."""

from __future__ import annotations

from ballast.memory.types import DieState, GiB, LadderPlan, MemState


def gib(nbytes: int) -> str:
    """Bytes in GiB with two decimals ("-" for 0: not known / not set)."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes else "-"


def _host_lines(state: MemState) -> list[str]:
    h = state.host
    lines = [
        f"host     level {state.host_level.name}",
        f"  total        {gib(h.total_bytes):>12}   effective {gib(h.effective_total_bytes)}",
        f"  available    {gib(h.available_bytes):>12}   effective {gib(h.effective_available_bytes)}",
        f"  reserve      {gib(state.host_reserve_bytes):>12}   budget {gib(state.host_budget_bytes)} "
        "(available above the reserve)",
        f"  PSI avg10    some {h.psi_some_avg10:.2f}%   full {h.psi_full_avg10:.2f}%",
    ]
    if h.cgroup_version:
        lines.append(
            f"  cgroup v{h.cgroup_version}    usage {gib(h.cgroup_usage_bytes)} (page cache excluded)   "
            f"high {gib(h.cgroup_high_bytes)}   max {gib(h.cgroup_max_bytes)}"
        )
    else:
        lines.append("  cgroup       none found")
    if not h.total_bytes:
        lines.append("  warning: MemTotal unreadable; host figures unknown")
    return lines


def _die_lines(dies: tuple[DieState, ...]) -> list[str]:
    if not dies:
        return ["gpus     none"]
    header = (
        f"{'gpu':<4} {'name':<24} {'total':>11} {'free':>11} {'budget':>11} {'ledger':>11} "
        f"{'ceiling':>11}  level"
    )
    lines = [header]
    for d in dies:
        level = d.level.name if d.budget_bytes else "not tracked"
        lines.append(
            f"{d.index:<4} {(d.name or '?')[:24]:<24} {gib(d.total_bytes):>11} {gib(d.free_bytes):>11} "
            f"{gib(d.budget_bytes):>11} {gib(d.ledger_bytes):>11} {gib(d.ceiling_bytes):>11}  {level}"
        )
    return lines


def _plan_lines(plan: LadderPlan) -> list[str]:
    rungs = [
        f"max slots {plan.max_slots}",
        f"context window {plan.context_window or 'unclamped'}",
        f"quantized KV {'forced' if plan.force_quantized_kv else 'off'}",
        f"KV eviction {'on' if plan.kv_evict else 'off'}",
        f"prefix cache {'shed' if plan.shed_prefix_cache else 'kept'}",
    ]
    state = "degraded" if plan.degraded else "as configured"
    lines = [f"ladder   at {plan.level.name}: {state}", "  " + ", ".join(rungs)]
    if plan.note:
        lines.append(f"  note: {plan.note}")
    return lines


def render(state: MemState, plan: LadderPlan | None = None) -> str:
    """The snapshot as text: overall level, host signals, cgroup, per-GPU figures, ladder plan."""
    if state.seq == 0:
        return "ballast memory: no snapshot yet (MemWatch has not polled)\n"
    lines = [f"ballast memory   level {state.level.name}   (snapshot {state.seq})", ""]
    lines += _host_lines(state)
    lines.append("")
    lines += _die_lines(state.dies)
    if plan is not None:
        lines.append("")
        lines += _plan_lines(plan)
    return "\n".join(lines) + "\n"
