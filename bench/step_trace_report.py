"""What a step trace (bench/step_trace/sitecustomize.py) says about a serving bench's last burst: the
level starts after the longest idle gap between steps, its burst at the first step with >= 2
prompt chunks and ends at the last step with prompt tokens.

    python bench/step_trace_report.py TRACE [TRACE ...]

Per trace: the burst's steps and wall; when the level's requests reached the scheduler against
the burst's start; each new sequence's first decode step after the burst starts (p50: in a burst of
simultaneous prompts, the engine's share of their time to first token); the engine thread's
launch and finish (wall and CPU, in the burst and after it); the steps' submit-to-done and period.
"""

from __future__ import annotations

import statistics
import sys


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(path: str) -> str:
    rows: dict[str, list[tuple[float, ...]]] = {"S": [], "L": [], "F": [], "A": []}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] in rows:
                rows[parts[0]].append(tuple(float(x) for x in parts[1:]))
    steps = sorted(rows["S"])
    if len(steps) < 2:
        return f"{path}: fewer than two steps"
    _, start = max((steps[i + 1][0] - steps[i][5], i + 1) for i in range(len(steps) - 1))
    level = steps[start:]
    t0 = level[0][0]
    first = next((i for i, r in enumerate(level) if r[3] >= 2), None)
    if first is None:
        return f"{path}: no step with two prompt chunks after the longest idle gap"
    burst_t = level[first][0]
    last = max(i for i, r in enumerate(level) if r[2] > 0)
    burst = level[first : last + 1]
    firsts: list[float] = []
    for r in level[first:]:
        firsts.extend([r[0] - burst_t] * (int(r[4]) - len(firsts)))
    lines = [
        f"{path}: burst steps {len(burst)}, wall {1e3 * (burst[-1][5] - burst[0][0]):.0f} ms; first decode "
        f"from the burst's start p50 {1e3 * firsts[len(firsts) // 2]:.0f} ms (n={len(firsts)})"
    ]
    # the burst's own requests: those after the level's warm-up (as many as sequences decode)
    arrivals = sorted(a[0] for a in rows["A"] if a[0] >= t0 - 0.05)[-len(firsts) :]
    if arrivals:
        came, went = 1e3 * (arrivals[0] - t0), 1e3 * (arrivals[-1] - t0)
        lines.append(
            f"  the burst's requests reached the scheduler {came:.0f} to {went:.0f} ms after the level's "
            f"first step; the burst started {1e3 * (burst_t - t0):.0f} ms"
        )
    end = burst[-1][5]
    for name, tag in (("launch", "L"), ("finish", "F")):
        inside = [r for r in rows[tag] if burst[0][0] <= r[0] <= end]
        after = [r for r in rows[tag] if r[0] > end]
        if inside:
            wall_in, cpu_in = (1e3 * _median([r[k] for r in inside]) for k in (1, 2))
            wall_after, cpu_after = (1e3 * _median([r[k] for r in after]) for k in (1, 2))
            lines.append(
                f"  {name} in the burst: n {len(inside)}, wall p50 {wall_in:.2f} ms, "
                f"cpu p50 {cpu_in:.2f} ms; "
                f"after it: wall p50 {wall_after:.2f} ms, cpu p50 {cpu_after:.2f} ms"
            )
    done = [r[5] for r in burst]
    lines.append(
        f"  burst submit->done p50 {_median([1e3 * (r[5] - r[0]) for r in burst]):.1f} ms, "
        f"period p50 {_median([1e3 * (b - a) for a, b in zip(done, done[1:], strict=False)]):.1f} ms"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(report(p))
