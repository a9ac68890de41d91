"""Scenario 6 (disconnect storm) at test size: streaming clients drop while queued, after the
first chunk or mid-stream; afterwards nothing is held and /metrics counts each request once."""

from __future__ import annotations

import disconnects
import pytest

pytestmark = pytest.mark.slow


def test_disconnect_storm_leaves_nothing_held_and_counts_aborts() -> None:
    f = disconnects.run(clients=120, slots=8, max_tokens=32)
    assert f["refused"] == f["metrics_refused"]  # only refusals with a status (429 + Retry-After)
    assert f["metrics_total"] == f["clients"]  # every request counted exactly once
    assert f["dropped"] > 50 and f["metrics_aborted"] >= f["dropped"] * 0.9
    assert f["metrics_finished"] + f["metrics_aborted"] + f["metrics_refused"] == f["clients"]
    assert f["metrics_finished"] >= f["read_to_end"]
    assert f["idle_slots_active"] == f["idle_queue_depth"] == f["idle_kv_blocks_used"] == 0
