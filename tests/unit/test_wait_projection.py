"""The queue-wait projection on given step costs: what a queued request waits for (a slot, KV
blocks coming back, the prefill ahead of it) and when it would get its first token."""

from __future__ import annotations

import pytest
from ballast.scheduler.gate import ARRIVAL_SHARE
from ballast.scheduler.service_rate import WAIT_FACTOR_RANGE, LengthShare, StepCosts, WaitAccuracy
from ballast.scheduler.wait_projection import Demand, Placement, WaitProjection


def costs(decode_s: float = 0.01, prefill_token_s: float = 0.001) -> StepCosts:
    c = StepCosts()
    c.stepped(5.0, 1, 0)  # the first step of a size class is not counted (a cold one)
    c.stepped(5.0, 1, 100)
    c.stepped(decode_s, 1, 0)
    c.stepped(decode_s + 100 * prefill_token_s, 1, 100)
    return c


def test_before_a_warm_step_the_first_steps_refuse_a_burst_at_arrival() -> None:
    """Issue 47's CPU burst (default model, 2 slots, bound 2 s): the warm-up's only prefill was a
    first step (two 400-token prompts in 2.8 s), which was not counted; with no prefill cost known
    the gate queued all 24 requests of the burst and refused 22 at the end of the bound. With the
    first steps standing in, every request after the first is projected past the bound."""
    c = StepCosts()
    c.stepped(2.8, 0, 800)  # the warm-up's one prefill step: a first one
    c.stepped(0.040, 2, 0)  # its first decode step
    assert c.known and c.prefill_token_s == pytest.approx(2.8 / 800)
    p = WaitProjection(c, 2, [])
    first, second = (p.place(Demand(400, 32, 4), always) for _ in range(2))
    assert first.at_once and first.first_token_s == pytest.approx(1.44)
    # the second has a slot but waits for the first's prefill: its first token (2.9 s, as the
    # served ones' 2.8-3.5 s were) is past the bound, and it is refused at arrival
    assert second.waits_for == "prefill compute" and second.first_token_s > 2.0
    # ... and as soon as a warm step is measured it is the cost, not the first one
    c.stepped(0.030, 2, 0)
    assert c.decode_s(2) == pytest.approx(0.030)
    c.stepped(0.030 + 400 * 0.001, 2, 400)  # another first step (its class's): the lesser stands in
    assert c.prefill_token_s == pytest.approx(0.001)
    c.stepped(0.030 + 800 * 0.0012, 2, 800)  # a warm one: the cost from now on
    assert c.prefill_token_s == pytest.approx(0.0012)


def always(gain: int) -> bool:
    return True


def test_before_any_step_returns_the_step_in_flight_bounds_the_wait_from_below() -> None:
    """Issue 47's CPU burst, its warm phase: 8 requests of ~400 tokens asking 32 reach a fresh
    server (2 slots, bound 2 s). The first step, the first two prompts, is in flight and nothing is
    measured: there was no projection, the other 6 were queued and each refused at 2 s. The step
    in flight bounds every cost from below as it runs (e x min(tokens, its tokens) / its tokens);
    the third's projection passes the bound while it runs, and never exceeds what the measured
    costs project."""
    now = [0.0]
    c = StepCosts(clock=lambda: now[0])
    assert not c.known
    c.sent(0, 800, since=0.0)
    assert c.known
    running = [Demand(0, 32, 4), Demand(0, 32, 4)]  # their prompts are the step in flight

    def third() -> Placement:
        return WaitProjection(c, 0, running).place(Demand(400, 32, 4), always)

    now[0] = 0.1
    early = third()
    assert early.waits_for == "a slot" and not early.at_once
    assert 0.1 + early.first_token_s < 2.0 * ARRIVAL_SHARE  # queued on arrival
    now[0] = 1.3
    late = third()
    assert 1.3 + late.first_token_s > 2.0  # refused at this tick, 0.7 s before the bound
    # a floor, not a guess: a prompt longer than the step in flight is not scaled up from it
    assert c.prefill_s(8000, 0) == pytest.approx(1.3) and c.decode_s(2) == pytest.approx(1.3 * 2 / 800)
    c.stepped(1.9, 0, 800)  # the step came back (2.4 ms a prompt token); then a 2-row decode step
    assert c.prefill_s(8000, 0) == pytest.approx(8000 * 1.9 / 800)
    c.sent(2, 0, since=1.9)
    now[0] = 1.94
    c.stepped(0.04, 2, 0)
    assert third().first_token_s >= late.first_token_s


def test_nothing_starts_before_the_step_in_flight_ends() -> None:
    """The compute-bound burst (32 slots, bound 6 s, ~440-token prompts at ~4 ms a token): a
    request came while the first two prompts were prefilled together. Their tokens count as done
    once sent, and the projection started now: the newcomer, behind nothing it could see, was
    projected at 1.7 s, queued, and got its first token at 4.3 s (7.0 s on a loaded box). Now it
    starts when the step in flight is projected to end, and is refused at arrival."""
    now = [0.0]
    c = StepCosts(clock=lambda: now[0])
    c.stepped(2.0, 1, 440)  # a first prefill: it stands in
    c.stepped(0.02, 1, 0)
    c.sent(0, 880, since=0.0)  # the two prompts
    now[0] = 0.1
    placed = WaitProjection(c, 30, [Demand(0, 4, 4), Demand(0, 4, 4)]).place(Demand(440, 4, 4), always)
    whole = 880 * c.prefill_token_s + 0.02
    assert placed.at_once and placed.start_s == pytest.approx(whole - 0.1)  # behind the step alone
    assert placed.waits_for == "prefill compute"
    assert placed.first_token_s > 6.0 * ARRIVAL_SHARE and not placed.unblamed(6.0 * ARRIVAL_SHARE)
    # a prompt whose own prefill alone passes the bound is not the wait's doing: it is served
    long = WaitProjection(c, 30, []).place(Demand(2000, 4, 16), always)
    assert long.at_once and long.unblamed(6.0)
    # past its projection the step in flight is taken to end now
    now[0] = 9.0
    assert (
        c.in_flight_s() == 0.0 and WaitProjection(c, 30, []).place(Demand(440, 4, 4), always).start_s == 0.0
    )


def test_step_costs_interpolate_and_extrapolate_by_rows() -> None:
    c = StepCosts()
    assert not c.known and c.decode_s(4) is None
    c.stepped(1.0, 2, 0)  # a cold first decode step: it stands in until a warm one is measured
    assert c.decode_s(2) == 1.0 and c.known  # no prefill cost yet: a prompt costs its step's base
    assert c.prefill_s(100, 2) == 1.0
    c.stepped(0.010, 2, 0)
    assert c.decode_s(1) == 0.010 and c.decode_s(4) == pytest.approx(0.020)  # one size: in proportion
    c.stepped(0.014, 4, 0)
    assert c.decode_s(3) == pytest.approx(0.012)  # between two sizes
    assert c.decode_s(8) == pytest.approx(0.022)  # above: the slope of the two largest
    c.stepped(1.0, 2, 100)  # the first prefill: its cost until a warm one
    assert c.known and c.prefill_token_s == pytest.approx(0.0099)
    c.stepped(0.010 + 0.050, 2, 100)  # a step of 2 decodes and 100 prompt tokens
    assert c.known and c.prefill_token_s == pytest.approx(0.0005)


def test_step_costs_shrug_off_a_spike_average_an_alternation_and_follow_a_change() -> None:
    c = StepCosts()
    c.stepped(1.0, 4, 0)  # cold
    for _ in range(11):
        c.stepped(0.100, 4, 0)
    c.stepped(3.4, 4, 0)  # a step of a process the OS put aside
    assert c.decode_s(4) == pytest.approx(0.100)
    for _ in range(6):  # steps sent ahead of the one before: timed ~1 ms / ~100 ms by turns
        c.stepped(0.001, 4, 0)
        c.stepped(0.199, 4, 0)
    assert c.decode_s(4) == pytest.approx(0.100, rel=0.05)
    for _ in range(9):  # a real change (the batch's contexts grew), followed within 3/4 of a window
        c.stepped(0.300, 4, 0)
    assert c.decode_s(4) == pytest.approx(0.300)


def test_length_share_is_the_whole_cap_until_measured() -> None:
    lengths = LengthShare(window=16, min_samples=4)
    assert lengths.remaining(10, 100) == 90
    for used in (20, 25, 30, 30):
        lengths.finished(used, 100)
    assert lengths.share == pytest.approx(0.30)
    assert lengths.remaining(10, 100) == 20
    assert lengths.remaining(50, 100) == 50  # past the usual share: the rest of its cap


def test_a_free_slot_and_room_start_at_once() -> None:
    p = WaitProjection(costs(), free_slots=2, running=[])
    placed = p.place(Demand(100, 10, 5), always)
    assert placed.at_once and placed.waits_for == "nothing"
    assert placed.first_token_s == pytest.approx(0.1 + 0.01)  # its tokens and the step carrying them


def test_slot_bound_the_head_waits_for_the_first_end() -> None:
    running = [Demand(0, 50, 2), Demand(0, 20, 2)]  # decoding, 50 and 20 tokens left
    p = WaitProjection(costs(), free_slots=0, running=running)
    head = p.place(Demand(0, 30, 2), always)
    assert head.waits_for == "a slot" and not head.at_once
    # two rows decode: the step of two is twice one (measured one size only)
    assert head.start_s == pytest.approx(20 * 0.02)
    second = p.place(Demand(0, 30, 2), always)
    assert second.start_s == pytest.approx(50 * 0.02)


def test_blocks_bound_a_free_slot_does_not_make_a_start() -> None:
    # Slots to spare, but the head's blocks fit only once 6 blocks have come back.
    running = [Demand(0, 40, 4), Demand(0, 10, 4)]
    p = WaitProjection(costs(), free_slots=6, running=running)
    head = p.place(Demand(0, 10, 4), lambda gain: gain >= 6)
    assert head.waits_for == "KV blocks"
    assert head.start_s == pytest.approx(40 * 0.02)  # both ends were needed
    # Behind it, a request needs 4 blocks more than the head left: it waits for the head's end.
    behind = p.place(Demand(0, 10, 4), lambda gain: gain >= 6)
    assert behind.start_s > head.start_s


def test_prefill_bound_the_prompts_ahead_come_first() -> None:
    p = WaitProjection(costs(prefill_token_s=0.002), free_slots=8, running=[Demand(1000, 10, 1)])
    first = p.place(Demand(500, 10, 1), always)
    assert first.waits_for == "prefill compute"
    assert first.start_s == pytest.approx(2.01) and first.first_token_s == pytest.approx(3.02)


def test_undo_takes_a_placement_back() -> None:
    p = WaitProjection(costs(), free_slots=0, running=[Demand(0, 10, 2), Demand(0, 30, 2)])
    a = p.place(Demand(0, 5, 2), always)
    b = p.place(Demand(0, 5, 2), always)
    p.undo(b)
    again = p.place(Demand(0, 5, 2), always)
    assert again.start_s == b.start_s and again.first_token_s == b.first_token_s
    assert a.start_s < b.start_s


def test_what_it_waits_for_is_what_held_the_queue_longest() -> None:
    """CI's 2-core box: 2 slots decoding 40 tokens each, a queue of short prompts behind them. Two
    requests that start on two ends a few ms apart serialise their prefills, so the second's last
    hold was the prompt just ahead of it (~30 ms) after ~0.4 s of waiting for a slot: it was
    refused as "waiting for prefill compute". The name is the cause that held the queue longest."""
    c = costs(decode_s=0.005, prefill_token_s=0.002)  # a slow prefill: 30 ms a 10-token prompt
    p = WaitProjection(c, free_slots=0, running=[Demand(0, 40, 1), Demand(0, 41, 1)])
    placed = [p.place(Demand(10, 40, 1), always) for _ in range(6)]
    assert [x.waits_for for x in placed] == ["a slot"] * 6
    # the second of each pair did start on the prefill ahead of it, not on its slot's end
    assert placed[1].start_s == pytest.approx(placed[0].first_token_s)
    # where the prompts ahead are most of the wait, they are named
    q = WaitProjection(costs(prefill_token_s=0.01), free_slots=0, running=[Demand(0, 2, 1), Demand(0, 2, 1)])
    assert [q.place(Demand(100, 2, 1), always).waits_for for _ in range(3)][-1] == "prefill compute"


def test_wait_accuracy_is_the_median_real_over_projected_wait_once_measured() -> None:
    acc = WaitAccuracy(bound_s=1.0, window=8, min_samples=4)  # waits projected at 1 s or more count
    for projected, waited in ((10.0, 8.0), (2.0, 1.7), (4.0, 3.6)):
        acc.first_token(projected, waited)
    assert acc.factor == 1.0  # three measured: not yet
    acc.first_token(0.3, 3.0)  # projected under 1 s: the step in flight, not the queue
    assert acc.factor == 1.0
    acc.first_token(5.0, 4.5)
    assert acc.factor == pytest.approx((0.85 + 0.9) / 2)  # ratios 0.8, 0.85, 0.9, 0.9
    for _ in range(8):  # the window moves on: a projection that now errs short reads above 1
        acc.first_token(2.0, 3.0)
    assert acc.factor == pytest.approx(1.5)
    for _ in range(8):  # and the range holds it: never under the arrival share, at most 2
        acc.first_token(10.0, 1.0)
    assert acc.factor == WAIT_FACTOR_RANGE[0] == ARRIVAL_SHARE
    for _ in range(8):
        acc.first_token(1.0, 9.0)
    assert acc.factor == WAIT_FACTOR_RANGE[1]
    # A 30 s bound counts waits projected at 10.5 s or more: where admission decides, not the
    # queue's head (an H100 squeeze, s32: 2.0-2.8x at 1-10 s, 0.81-0.96x at 15-21 s)
    far = WaitAccuracy(bound_s=30.0, min_samples=1)
    far.first_token(10.0, 25.0)
    assert far.factor == 1.0
    far.first_token(12.0, 9.6)
    assert far.factor == pytest.approx(0.8)


def test_placements_are_read_times_the_factor() -> None:
    running = [Demand(0, 50, 2), Demand(0, 20, 2)]
    p = WaitProjection(costs(), 0, running)
    for _ in range(3):
        a = p.place(Demand(100, 30, 2), always)
        b = a.read(0.7)
        assert b.start_s == pytest.approx(0.7 * a.start_s)
        assert b.first_token_s == pytest.approx(0.7 * a.first_token_s)
        assert (a.at_once, a.waits_for) == (b.at_once, b.waits_for)
    last = p.place(Demand(100, 30, 2), always)
    p.undo(last.read(0.7))  # taken back as read: the queue after it is as before it came
    again = p.place(Demand(100, 30, 2), always)
    assert again.first_token_s == pytest.approx(last.first_token_s)
