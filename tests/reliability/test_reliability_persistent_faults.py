"""Scenario 6 (faults that persist) at test size: `ballast serve` on CPU with BALLAST_FAULTS. A
step that never returns ends every request with a fast 503 and the process; steps that keep
failing for want of memory take the server out of rotation and turn new work into fast refusals,
and it serves again once they stop; one prompt failing on memory costs only itself."""

from __future__ import annotations

import persistent_faults
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # timed: run alone (see pyproject's markers)


def test_a_hung_step_ends_every_request_reports_unsound_and_exits() -> None:
    f = persistent_faults.run_hang(watchdog_s=1.0, streams=3, queued=2)
    assert f["clients_engine_stalled"] == f["clients"] == 5, f
    # Each client's 503 comes within the deadline the watchdog applied (plus a second for the
    # tick and the client), not never.
    assert f["deadline_s"] >= 1.0 and f["detect_s_max"] <= f["deadline_s"] + 1.0, f
    assert f["health_503_code"] == "engine_stalled" and f["exit_code"] == 1, f


def test_steps_failing_on_memory_refuse_fast_then_the_server_serves_again() -> None:
    f = persistent_faults.run_oom(count=4, seconds=14.0, workers=3)
    assert f["other"] == 0 and f["retry_after_missing"] == 0, f
    assert f["ready_503_seen"] and "want of memory" in f["ready_503_reason"], f
    assert f["health_not_200"] == 0, f  # failing steps are pressure, not an unsound process
    assert f["fast_refusals"] > 0 and f["server_refusals"] >= f["fast_refusals"], f
    assert f["served_after_the_faults"] > 0, f
    assert f["idle_slots_active"] == f["idle_queue_depth"] == f["idle_kv_blocks_used"] == 0, f


def test_a_prompt_failing_on_memory_costs_only_itself() -> None:
    f = persistent_faults.run_prompt(streams=8, max_tokens=48)
    assert f["failed_steps"] == 1 and f["last_step_failure"] == "out_of_memory", f
    assert f["calm_completed"] == f["faulted_completed"] == f["same_text_as_calm"] == 8, f
    assert f["newcomer_ok"] and f["requests_failed_on_metrics"] == 0, f
    assert f["idle_slots_active"] == f["idle_queue_depth"] == f["idle_kv_blocks_used"] == 0, f


def test_a_hung_rank_under_tensor_parallel_ends_every_request_and_leaves_no_worker() -> None:
    f = persistent_faults.run_hang(watchdog_s=1.0, streams=3, queued=2, ranks=2)
    assert f["clients_engine_stalled"] == f["clients"] == 5, f
    assert f["detect_s_max"] <= f["deadline_s"] + 1.0, f
    assert f["health_503_code"] == "engine_stalled" and f["exit_code"] == 1, f
    assert f["workers"] >= 1 and f["workers_alive_after_exit"] == 0, f  # none left in a collective
