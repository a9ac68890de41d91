"""The queue-wait promise where the wait is for memory, slots or compute (issue 47): a request
that cannot start within --max-queue-wait-s is refused at arrival (client clock, p99 under 1 s),
with 429/503 and Retry-After; a served request gets its first token within the bound; nothing but
200/429/503; the server stays up. Each run is a real `ballast serve` driven by the openai client."""

from __future__ import annotations

import json

import pytest
import wait_refusals

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # timed: run alone (see pyproject's markers)
GiB = 1 << 30
MiB = 1 << 20


def check(f: dict, bound: float, waits_for: str, refused_within: float = 1.0) -> None:
    outcomes = f["outcomes"]
    assert set(outcomes) <= {"200", "429", "503"}, f["examples"]
    assert outcomes.get("200", 0) >= 1 and outcomes.get("429", 0) + outcomes.get("503", 0) >= 1, outcomes
    assert f["refusal_p99_s"] < refused_within, f  # refused at arrival, not after the bound
    assert f["retry_after_min_s"] >= 1
    # every served request's first token within the bound, on the server's clock (from its
    # submission, where the bound starts: the client's adds its own sending and reading, ~0.1 s)
    assert len(f["server_ttft_s"]) == outcomes["200"] and max(f["server_ttft_s"]) <= bound, f
    assert f["refusal_waits_for"].get(waits_for, 0) >= 1, f["refusal_waits_for"]
    assert f["server_alive"] and f["oom_kills"] == 0


def test_memory_bound_a_2gib_container_refuses_at_arrival() -> None:
    # 32 slots, KV room in 2 GiB (256 MiB reserve floor) for 12 requests of 2,040 tokens (a
    # 50-token chat, 1,990 asked): the 13th waits for blocks that come back only after ~2,000
    # decode steps. The served close their streams after a few tokens (the test's time), which the
    # projection cannot know.
    bound = 15.0
    env = {"BALLAST_HOST_RESERVE_MIN_BYTES": str(256 * MiB)}
    try:
        f = wait_refusals.run(2 * GiB, 32, 24, 5, 1990, bound, env=env, read=3)
    except OSError as exc:
        pytest.skip(f"cannot make a child memory cgroup here: {exc}")
    check(f, bound, "KV blocks")


def test_slot_bound_two_slots_refuse_the_burst_tail_at_arrival() -> None:
    bound = 2.0
    f = wait_refusals.run(None, 2, 40, 8, 64, bound, max_len=256, model="builtin:tiny-llama")
    check(f, bound, "a slot")


def test_before_any_step_returns_the_step_in_flight_refuses_before_the_bound() -> None:
    # A fresh server (no warm-up: no step measured) whose first prefill step crawls for 3 s (the
    # `slow` fault, a slow box's big prefill made certain): 8 chats on 2 slots, bound 2 s. Each
    # queued behind that step gets its first token after 3 s. Nothing was projected until a step
    # came back, so each was refused at 2 s, the bound's end (the CPU burst's warm phase: 6 such).
    # The step in flight bounds the costs from below while it runs: they are refused as it passes
    # the bound. The served got their first token after the fault's 3 s, so TTFT is not checked.
    bound = 2.0
    env = {"BALLAST_FAULTS": json.dumps([{"kind": "slow", "when": "prefill", "seconds": 3}])}
    f = wait_refusals.run(
        None, 2, 8, 4, 64, bound, max_len=256, model="builtin:tiny-llama", env=env, warm=False
    )
    outcomes = f["outcomes"]
    assert set(outcomes) <= {"200", "429", "503"}, f["examples"]
    assert outcomes.get("200", 0) >= 1 and outcomes.get("429", 0) + outcomes.get("503", 0) >= 1, outcomes
    assert f["refusal_max_s"] < 0.75 * bound, f  # never at the bound's end
    assert f["server_alive"]


def test_compute_bound_the_prefill_ahead_refuses_at_arrival() -> None:
    # Slots and memory to spare; 24 prompts of ~500 tokens at once: the tail waits for the prefill
    # of the prompts ahead of it (12,000 tokens, several times the bound on a CI box's two cores).
    bound = 6.0
    f = wait_refusals.run(None, 32, 24, 70, 4, bound)
    # A request that came while the first prompts were prefilled was projected as if that step had
    # ended (sent tokens count as done), queued at 1.7 s and served at 4.3 s; at load average 6-7 a
    # served first token came at 7.0 s (this test allowed 1.5x the bound then). Now nothing starts
    # before the step in flight ends. A request queued at arrival can still fall behind once the
    # burst's own steps are measured, and is refused at that step, as the projection is re-read
    # every step (s25: the last refusal at 2.5 and 2.7 s of the bound's 6 in two runs of five).
    check(f, bound, "prefill compute", refused_within=0.5 * bound)
