"""bench/ttft_split's arithmetic: a request's segments come from the first of each mark inside its
own window (another request's marks, or its own later steps, do not move them)."""

from __future__ import annotations

from ballast.bench.ttft_split import SEGMENTS, split


def test_segments_are_the_gaps_between_the_first_marks_in_the_window() -> None:
    path = ["recv>", "chat_job>", "chat_job<", "launch>", "launch<", "mailbox>", "send>"]
    marks = [(0.5, "launch>"), (0.6, "mailbox>")]  # an earlier request's: outside the window
    marks += [(1.0 + 0.001 * (i + 1) * (i + 2), m) for i, m in enumerate(path)]
    marks += [(1.2, "launch>"), (1.3, "mailbox>")]  # its decode steps after the first token
    marks += [(1.05, "launch>")]  # after the first launch: not the prefill's
    sent, first = 1.0, 1.06
    got = split(sorted(marks), [(sent, first)])
    points = [sent, *(1.0 + 0.001 * (i + 1) * (i + 2) for i in range(len(path))), first]
    for name, a, b in zip(SEGMENTS, points[:-1], points[1:], strict=True):
        assert abs(got[name][0] - 1e3 * (b - a)) < 1e-9, name
    assert abs(got["total"][0] - 60.0) < 1e-9
    assert abs(sum(got[name][0] for name in SEGMENTS) - got["total"][0]) < 1e-9


def test_a_request_missing_a_mark_is_left_out() -> None:
    marks = [(1.001, "recv>"), (1.002, "chat_job>"), (1.003, "chat_job<")]  # it never reached the engine
    got = split(marks, [(1.0, 1.01)])
    assert all(v == [] for v in got.values())
