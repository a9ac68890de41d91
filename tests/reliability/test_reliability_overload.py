"""Scenario 1 (overload) at test size: `ballast serve` on CPU, 6x the slots in streams plus a
burst, a short queue-wait bound (1 s). Every request completes or is refused with 429/503 +
Retry-After; no other outcome; everything is back to idle afterwards."""

from __future__ import annotations

import overload
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # timed: run alone (see pyproject's markers)


def test_overload_every_request_completes_or_is_refused_fast() -> None:
    # 124 requests x 64 tokens on 4 slots: several seconds of work even on a fast, quiet box, so
    # the tail cannot start within the bound.
    bound = 1.0
    f = overload.run(slots=4, streams=24, burst=100, max_tokens=64, extra=("--max-queue-wait-s", str(bound)))
    assert f["other"] == 0, f["other_examples"]
    assert f["completed"] + f["refused_429"] + f["refused_503"] == f["requests"]
    assert f["completed"] >= 4 and f["refused_429"] > 0
    assert f["queue_wait_refusals_on_metrics"] + f["queue_full_refusals_on_metrics"] == f["refused_429"]
    assert f["retry_after_min_s"] >= 1
    # Refused within the bound (plus the time to read the refusal on a loaded box), not at the
    # 600 s request deadline as before the bound existed.
    assert f["refusal_p99_s"] < bound + 10
    assert f["idle_slots_active"] == f["idle_queue_depth"] == f["idle_kv_blocks_used"] == 0
