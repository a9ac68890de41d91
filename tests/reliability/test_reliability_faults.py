"""Scenario 5 (faults) against a real server with the built-in tiny Llama: each recoverable fault
costs only the requests of its step, the server keeps serving and /health tells the truth; only a
device fault makes it unsound."""

from __future__ import annotations

from pathlib import Path

import faults
import pytest
from ballast.memory.types import Level
from memfixtures import level_tree

pytestmark = pytest.mark.slow


def test_faults_cost_only_their_own_requests(tmp_path: Path) -> None:
    # The host at OK from a tree: on a busy shared box the real one may sit a rung up already, and
    # the memory fault's rung then takes admission to CRITICAL (queued requests refused).
    level_tree(tmp_path, Level.OK)
    f = faults.run(stale_s=1.0, root=str(tmp_path))
    for n, name in enumerate(("python_exception", "memory_error_in_prefill", "cuda_oom_in_prefill"), start=1):
        step = f[name]
        assert step["other"] == 0 and step["failed_in_step"] + step["completed"] == 8, step
        if name == "python_exception":
            # A bug hit by the step that held the three decoding requests and the newcomer's
            # prefill: those four get a retryable 503; the four that were queued complete.
            assert step["failed_in_step"] >= 1 and step["completed"] >= 4, step
        else:
            # Out of memory in the newcomer's chunk: it is retried with half the chunk and the
            # decodes beside it run again; all eight complete.
            assert step["failed_in_step"] == 0 and step["completed"] == 8, step
        assert step["health"] == "ok" and step["step_failures"] == n and step["blocks_after"] == 0, step
    tok = f["tokenizer_error"]
    assert tok["status"] == 500 and tok["has_openai_body"] and not tok["traceback_leaked"], tok
    assert tok["next_request"] == "ok" and tok["health"] == "ok"
    slow = f["slow_consumer"]
    assert slow["others"] == ["ok"] * 3 and slow["blocks_after"] == 0
    stale = f["stale_memwatch"]
    assert stale["polls_failed"] > 0 and stale["status"] == 503 and stale["refused"] == "server_overloaded", (
        stale
    )
    assert (
        stale["ready_status"] == 503 and "unknown" in stale["ready_reason"] and stale["health_status"] == 200
    )
    assert stale["after_recovery"] == "ok"
    dev = f["device_fault"]
    assert dev["status"] == 500 and dev["health_status"] == 503 and dev["on_fatal_called"], dev
