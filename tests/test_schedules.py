from __future__ import annotations

import dataclasses
import itertools

import pytest

from sixfold.config import ConfigError
from sixfold.parallel.pipeline.delivery import delivered, held_sends
from sixfold.parallel.pipeline.schedules import (
    B, COMPUTE, F, RECV_B, RECV_F, SCHEDULES, SEND_B, SEND_F, W, Action, Schedule, build, placement)
from sixfold.parallel.pipeline.simulate import Costs, ScheduleError, simulate
from sixfold.pictures import draw_timeline, schedule_events

SPLIT = ("zb-h1", "zb-v")  # schedules with a W for every B


def valid(name: str) -> list[Schedule]:
    """Every schedule of this name for pp 1..6, v 1..3, m 1..12 that the name allows."""
    out = []
    for pp, v, m in itertools.product(range(1, 7), range(1, 4), range(1, 13)):
        try:
            out.append(build(name, pp, v, m))
        except ConfigError:
            pass
    return out


def bubbles(name: str, pp: int, v: int, m: int, early: bool = False) -> list[float]:
    return [r.bubble for r in simulate(build(name, pp, v, m), early=early).ranks]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_passes_the_checker(name):
    schedules = valid(name)
    assert len(schedules) >= 30
    for s in schedules:
        for r, acts in enumerate(s.ranks):
            compute = [a for a in acts if a.kind in COMPUTE]
            local = [st for st in range(s.stages) if s.placement[st] == r]
            kinds = (F, B, W) if name in SPLIT else (F, B)
            expected = {Action(k, st, i) for k in kinds for st in local for i in range(s.m)}
            assert len(compute) == len(expected) and set(compute) == expected
        simulate(s)
        simulate(s, batched=True)  # whether a schedule deadlocks does not depend on the costs


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exact(name):
    # F = 1, B = 2 (input and weight gradient) as one block, no latency: makespan 3(m + p - 1) on every rank
    for pp, m in itertools.product(range(1, 7), range(1, 13)):
        sim = simulate(build(name, pp, 1, m), early=False)
        assert sim.makespan == 3 * (m + pp - 1)
        assert [r.bubble for r in sim.ranks] == pytest.approx([(pp - 1) / (m + pp - 1)] * pp)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_sending_the_input_gradient_first_shortens_the_bubble(name):
    # as the runtime runs: each rank idles p - 1 times F + B, not F + B + W (the weight gradient of a B is
    # computed after its input gradient is sent, so the rank before starts its B that much sooner)
    for pp, m in itertools.product(range(1, 7), range(1, 13)):
        s = build(name, pp, 1, m)
        assert s.sends_early(0) == set()
        assert all(s.sends_early(r) == {(r, i) for i in range(m)} for r in range(1, pp))
        for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.3, 0.6), (2.0, 3.0, 1.5)):
            sim = simulate(s, Costs(f, b, w))
            assert sim.makespan == pytest.approx(m * (f + b + w) + (pp - 1) * (f + b))
            assert all(sim.makespan - r.busy == pytest.approx((pp - 1) * (f + b)) for r in sim.ranks)
    assert build("zb-h1", 2, 1, 4).sends_early(1) == set()  # its W actions do the weight gradients


def test_interleaved_bubble_is_exact():
    # each stage costs F = 1, B = 2, a rank's share of one micro-batch is v stages:
    # bubble ((p-1)/v) / (m + (p-1)/v) on every rank
    for pp, v in itertools.product(range(1, 7), (2, 3)):
        for m in range(pp, 13, pp):
            theory = ((pp - 1) / v) / (m + (pp - 1) / v)
            assert bubbles("interleaved", pp, v, m) == pytest.approx([theory] * pp)
            # sending input gradients first: 2(p - 1) idle, not 3(p - 1), as for 1F1B
            assert bubbles("interleaved", pp, v, m, early=True) == pytest.approx(
                [2 * (pp - 1) / (3 * m * v + 2 * (pp - 1))] * pp)


def test_breadth_first_bubble():
    # as interleaved once m >= pp; with fewer micro-batches the first rank waits for the loop to come back
    for pp, v, m in itertools.product(range(1, 7), range(1, 4), range(1, 13)):
        theory = ((pp - 1) / v) / (m + (pp - 1) / v)
        measured = bubbles("breadth-first", pp, v, m)
        if m >= pp:
            assert measured == pytest.approx([theory] * pp)
        else:
            assert min(measured) >= theory - 1e-12


def test_zb_h1_bubble_is_a_third_of_1f1b():
    # F = B = W = 1: once m >= p every rank idles exactly p - 1, a third of 1F1B's 3(p - 1)
    for pp, m in itertools.product(range(1, 7), range(1, 13)):
        zb = simulate(build("zb-h1", pp, 1, m))
        base = simulate(build("1f1b", pp, 1, m), early=False)  # (1F1B as the runtime runs idles 2(p - 1))
        idle = [zb.makespan - r.busy for r in zb.ranks]
        if m >= pp:
            assert idle == [pp - 1] * pp
            assert 3 * max(idle) == max(base.makespan - r.busy for r in base.ranks)
            assert zb.bubble == pytest.approx((pp - 1) / (3 * m + pp - 1))
        assert zb.bubble <= base.bubble + 1e-12


def test_zb_v_bubble_is_near_zero():
    # F = B = W = 1: once m >= 2p - 1 every rank idles only p - 1 (of 6m + p - 1), the least possible:
    # the last rank cannot start before p - 1 forwards
    for pp, m in itertools.product(range(1, 7), range(1, 13)):
        sim = simulate(build("zb-v", pp, 2, m))
        if m >= 2 * pp - 1:
            assert sim.makespan == 6 * m + pp - 1
            assert sim.bubble == pytest.approx((pp - 1) / (6 * m + pp - 1))
            assert sim.bubble <= simulate(build("zb-h1", pp, 1, m)).bubble
        if m < pp:  # fewer micro-batches than ranks: the V filled greedily idles less than zb-h1 (was as much)
            assert sim.bubble < simulate(build("zb-h1", pp, 1, m)).bubble, (pp, m)
        if m == pp:  # filled greedily too: the least possible (as built for 2p - 1, pp = 4 took 30 units)
            assert sim.makespan == 6 * m + pp - 1
    assert simulate(build("zb-v", 4, 2, 1)).makespan == 17  # one micro-batch's path, 4p + 1, the least possible
    assert simulate(build("zb-v", 4, 2, 3)).makespan == 23  # zb-h1's 13 units are 26 of these
    assert bubbles("zb-v", 4, 2, 8) == pytest.approx([3 / 51] * 4)


def test_peak_in_flight():
    for pp, m in itertools.product(range(1, 7), range(1, 13)):
        assert [r.peak_in_flight for r in simulate(build("gpipe", pp, 1, m)).ranks] == [m] * pp
        peaks = [r.peak_in_flight for r in simulate(build("1f1b", pp, 1, m)).ranks]
        assert peaks[0] == min(pp, m) and peaks == sorted(peaks, reverse=True)
        assert peaks == [min(pp - r, m) for r in range(pp)]
        zb = build("zb-h1", pp, 1, m)
        assert [r.peak_in_flight for r in simulate(zb, release="B").ranks] == peaks
        assert [r.peak_in_flight for r in simulate(zb).ranks] == [min(pp, m)] * pp
        # two half-size stages per rank: at most 2pp pairs, the first 1F1B rank's activations
        assert all(r.peak_in_flight <= 2 * pp for r in simulate(build("zb-v", pp, 2, m)).ranks)


@pytest.mark.parametrize("name", SCHEDULES)
def test_crowds_count_each_stage_pairs_and_the_largest_is_the_peak(name):
    for s in valid(name)[::3]:
        for r, stats in enumerate(simulate(s).ranks):
            mine = {st for st, at in enumerate(s.placement) if at == r}
            assert all({st for st, *_ in crowd} <= mine and all(n > 0 and 0 <= w <= n for _, n, w in crowd)
                       for crowd in stats.crowds)
            assert max(sum(n for _, n, _ in crowd) for crowd in stats.crowds) == stats.peak_in_flight
            assert any(w for crowd in stats.crowds for *_, w in crowd) == any(a.kind == W for a in s.ranks[r])
    if name == "zb-v":  # rank 0 holds the first stage and the head's: its four pairs, three of them the first's
        assert ((0, 3, 0), (3, 1, 1)) in simulate(build("zb-v", 2, 2, 4)).ranks[0].crowds  # the head's past its B
    if name == "zb-h1":  # the last rank's B's leave both pairs waiting for their W's
        assert ((1, 2, 2),) in simulate(build("zb-h1", 2, 1, 4)).ranks[1].crowds


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_send_is_let_go_only_once_its_data_was_used(name):
    for s in valid(name)[::3]:
        ranks = simulate(s).ranks
        starts = [{a: start for start, _, a in r.events} for r in ranks]
        for r in range(s.pp):
            run, computes = {}, 0  # each action's run: the computes before it in the rank's list
            for a in s.ranks[r]:
                run[a], computes = computes, computes + (a.kind in COMPUTE)
            for recv, sends in delivered(s, r).items():
                waits = Action(F if recv.kind == RECV_F else B, recv.stage, recv.micro)
                for send in sends:
                    used = Action(F, send.stage + 1, send.micro) if send.kind == SEND_F else \
                        Action(B, send.stage - 1, send.micro)
                    assert starts[s.peer(send)][used] <= starts[r][waits], (s, r, recv, send)
                    # NCCL runs a group's messages in posting order: the send is posted before the reply's receive
                    assert run[send] <= run[recv], (s, r, recv, send)


def test_1f1b_sends_hold_no_more_than_its_micro_batches_in_flight():
    for pp, m in itertools.product(range(2, 7), range(1, 13)):
        s = build("1f1b", pp, 1, m)
        held = [held_sends(s, r) for r in range(pp)]
        assert held[0] == min(pp, m) and max(held) == held[0], (pp, m, held)  # was every send: m or 2m


def test_placement():
    assert placement(4, 1) == [0, 1, 2, 3]
    assert placement(4, 2, "interleaved") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert placement(3, 3, "breadth-first") == [0, 1, 2] * 3
    assert placement(4, 2, "zb-v") == [0, 1, 2, 3, 3, 2, 1, 0]
    s = build("zb-v", 4, 2, 8)
    # the turn of the V stays on rank 3: no message between stages 3 and 4
    assert not any(a.stage == 3 and a.kind == SEND_F or a.stage == 4 and a.kind == RECV_F
                   for acts in s.ranks for a in acts)


def test_schedule_prints_readably():
    s = build("1f1b", 2, 1, 2)
    assert str(s).splitlines() == [
        "1f1b pp=2 v=1 m=2, stage ranks [0, 1]",
        "rank 0: F(s0,m0) SEND_F(s0,m0) F(s0,m1) SEND_F(s0,m1) RECV_B(s0,m0) B(s0,m0) RECV_B(s0,m1) B(s0,m1)",
        "rank 1: RECV_F(s1,m0) F(s1,m0) RECV_F(s1,m1) B(s1,m0) SEND_B(s1,m0) F(s1,m1) B(s1,m1) SEND_B(s1,m1)",
    ]
    assert "Action" not in repr(s.ranks)


def test_bad_settings_name_what_to_change():
    with pytest.raises(ConfigError, match="parallel.pp_schedule='zb-x' is not one of gpipe, 1f1b"):
        build("zb-x", 2, 1, 4)
    with pytest.raises(ConfigError, match="parallel.pp=0 must be at least 1"):
        build("1f1b", 0, 1, 4)
    with pytest.raises(ConfigError, match="train.micro_batches=0 must be at least 1"):
        build("gpipe", 2, 1, 0)
    with pytest.raises(ConfigError, match="'1f1b' runs one stage per rank: set parallel.pp_virtual_stages=1"):
        build("1f1b", 2, 2, 4)
    with pytest.raises(ConfigError, match=r"'interleaved' needs parallel.pp_virtual_stages >= 2 \(got 1\)"):
        build("interleaved", 2, 1, 4)
    with pytest.raises(ConfigError, match="train.micro_batches=6 to be a multiple of parallel.pp=4: "
                                          "set train.micro_batches to 8"):
        build("interleaved", 4, 2, 6)
    with pytest.raises(ValueError, match="'zb-v' places 2 stages per rank.*pp_virtual_stages=2 \\(got 3\\)"):
        build("zb-v", 4, 3, 8)
    with pytest.raises(ValueError, match="release"):
        simulate(build("1f1b", 2, 1, 2), release="F")


def test_costs_and_latency():
    # F 1, message 0.5, F 1, B 2 (with W), message 0.5, B 2
    s = build("1f1b", 2, 1, 1)
    sim = simulate(s, Costs(comm=0.5), early=False)
    assert sim.makespan == 7.0 and [r.busy for r in sim.ranks] == [3.0, 3.0]
    assert sim.ranks[1].events[0] == (0.0, 1.5, Action(RECV_F, 1, 0))
    assert [r.bubble for r in sim.ranks] == pytest.approx([4 / 7, 4 / 7])
    assert simulate(s, Costs(comm=0.5), batched=True, early=False).makespan == 7.0
    # rank 1 sends its input gradient 1 into its B (2.5-4.5): rank 0's B runs 4-6
    for batched in (False, True):
        sim = simulate(s, Costs(comm=0.5), batched=batched)
        assert sim.makespan == 6.0 and sim.ranks[1].finish == 4.5
    assert (3.5, 3.5, Action(SEND_B, 1, 0)) in simulate(s, Costs(comm=0.5)).ranks[1].events
    costs = Costs(f=1.0, b=1.7, w=0.6, comm=0.3)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("breadth-first", 3), ("zb-h1", 1),
                    ("zb-v", 2)):
        sim = simulate(build(name, 4, v, 8), costs)
        assert all(r.busy == pytest.approx(v * 8 * 3.3) for r in sim.ranks)
        assert sim.makespan >= simulate(build(name, 4, v, 8), Costs(1.0, 1.7, 0.6)).makespan


def test_costs_per_stage():
    # GPipe, stage 1 twice as costly: F 0-1 and 1-2 on rank 0, 1-3 and 3-5 on rank 1, its B's 5-7 and 7-9, then
    # rank 0's B's 7-8 and 9-10
    sim = simulate(build("gpipe", 2, 1, 2), Costs(f=(1.0, 2.0), b=(1.0, 2.0), w=0.0))
    assert sim.makespan == 10.0 and [r.busy for r in sim.ranks] == [4.0, 8.0]
    assert [e[:2] for e in sim.ranks[0].events if e[2].kind == B] == [(7.0, 8.0), (9.0, 10.0)]
    # 1F1B: the first F, m times the heavier stage's F + B (with W), the last B, which starts as rank 1 sends
    # its last input gradient, before that B's W (1.2)
    sim = simulate(build("1f1b", 2, 1, 8), Costs(f=(1.0, 1.2), b=(1.0, 1.2), w=(1.0, 1.2)))
    assert sim.makespan == pytest.approx(1.0 + 8 * 3.6 - 1.2 + 2.0)
    assert sim.ranks[0].bubble > sim.ranks[1].bubble
    # a replay: each action its own cost (rank 1's second F takes 3), the rest from costs
    replay = simulate(build("gpipe", 2, 1, 2), Costs(f=(1.0, 2.0), b=(1.0, 2.0), w=0.0),
                      durations={Action(F, 1, 1): 3.0})
    assert replay.makespan == 11.0 and replay.ranks[1].busy == 9.0
    # an early sender's weight gradient traced apart: B(s1) its input gradient, W(s1) the rest
    replay = simulate(build("gpipe", 2, 1, 1), Costs(), durations={Action(B, 1, 0): 1.0, Action(W, 1, 0): 3.0})
    assert replay.ranks[1].busy == 5.0 and replay.makespan == 6.0  # rank 0's B: 3-5
    with pytest.raises(ValueError, match="costs.f has 3 values, one per stage needs 4"):
        simulate(build("zb-v", 2, 2, 4), Costs(f=(1.0, 1.0, 1.0)))


def _replace(s: Schedule, rank: int, acts: list[Action]) -> Schedule:
    ranks = list(s.ranks)
    ranks[rank] = tuple(acts)
    return dataclasses.replace(s, ranks=tuple(ranks))


def _receive_just_in_time(s: Schedule) -> Schedule:
    """Each RECV moved to right before the compute that uses it."""
    ranks = []
    for acts in s.ranks:
        recv = {Action(F if a.kind == RECV_F else B, a.stage, a.micro): a
                for a in acts if a.kind in (RECV_F, RECV_B)}
        out: list[Action] = []
        for a in acts:
            if a in recv:
                out.append(recv[a])
            if a.kind not in (RECV_F, RECV_B):
                out.append(a)
        ranks.append(tuple(out))
    return dataclasses.replace(s, ranks=tuple(ranks))


def test_a_receive_waits_only_at_the_compute_that_uses_it():
    # where a RECV is posted does not change the timing: only the compute that uses its data waits for it. So
    # ZB-H1's receives, placed for unit costs, cost nothing when B and W differ from F. (One stage per rank: with
    # more, receives moved just in time would no longer be in the order of their sends.)
    costs = Costs(f=1.0, b=1.2, w=0.7, comm=0.05)
    for name, pp in itertools.product(("gpipe", "1f1b", "zb-h1"), (2, 3, 4)):
        s = build(name, pp, 1, 8)
        assert simulate(s, costs).makespan == pytest.approx(simulate(_receive_just_in_time(s), costs).makespan)
    assert simulate(build("zb-h1", 2, 1, 8), Costs(93.4, 113.6, 62.7)).bubble == pytest.approx(0.0627, abs=1e-4)


def test_checker_finds_deadlocks():
    s = build("1f1b", 2, 1, 1)
    # a receive posted early only waits at the compute that uses it; batched, it waits where it stands
    early = _replace(s, 0, [Action(RECV_B, 0, 0), Action(F, 0, 0), Action(SEND_F, 0, 0), Action(B, 0, 0)])
    assert simulate(early).makespan == simulate(s).makespan
    with pytest.raises(ScheduleError, match=r"deadlocks:\n  rank 0 at action 0: RECV_B\(s0,m0\) waits for "
                                            r"SEND_B\(s1,m0\) from rank 1\n  rank 1 at action 0: RECV_F"):
        simulate(early, batched=True)
    bad = _replace(s, 0, [Action(RECV_B, 0, 0), Action(F, 0, 0), Action(B, 0, 0), Action(SEND_F, 0, 0)])
    with pytest.raises(ScheduleError, match=r"deadlocks:\n  rank 0 at action 2: B\(s0,m0\) waits for "
                                            r"SEND_B\(s1,m0\) from rank 1\n  rank 1 at action 1: F\(s1,m0\) "
                                            r"waits for SEND_F\(s0,m0\) from rank 0"):
        simulate(bad)
    # a ring of just-in-time receives is fine with buffered sends, but deadlocks once batched
    late = _receive_just_in_time(build("breadth-first", 2, 2, 4))
    simulate(late)
    with pytest.raises(ScheduleError, match=r"deadlocks:\n  rank 0 at action 5: SEND_F\(s0,m2\) waits for "
                                            r"rank 1 to post its receive\n  rank 1 at action 2: SEND_F"):
        simulate(late, batched=True)


def test_checker_finds_broken_schedules():
    s = build("1f1b", 2, 1, 2)
    r1 = list(s.ranks[1])
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 RECV_F\(s1,m1\): message 0 from rank 0 is "
                                            r"SEND_F\(s0,m0\): sends and receives .* same order"):
        simulate(_replace(s, 1, [r1[2], r1[0], r1[1]] + r1[3:]))
    with pytest.raises(ScheduleError, match=r"F\(s1,m0\): runs before RECV_F\(s1,m0\)"):
        simulate(_replace(s, 1, r1[1:]))
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 F\(s1,m0\): stage 1 is on rank 1"):
        simulate(_replace(s, 0, [Action(F, 1, 0)]))
    with pytest.raises(ScheduleError, match=r"SEND_F\(s0,m0\) from rank 0 is never received"):
        simulate(_replace(_replace(s, 1, []), 0, [Action(F, 0, 0), Action(SEND_F, 0, 0)]))
    with pytest.raises(ScheduleError, match=r"B\(s0,m1\) never runs"):
        simulate(_replace(build("gpipe", 1, 1, 2), 0, [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0)]))
    with pytest.raises(ScheduleError, match=r"F\(s0,m0\): runs twice"):
        simulate(_replace(build("gpipe", 1, 1, 1), 0, [Action(F, 0, 0)] * 2))
    zb = build("zb-h1", 1, 1, 1)
    with pytest.raises(ScheduleError, match=r"W\(s0,m0\): runs before B\(s0,m0\)"):
        simulate(_replace(zb, 0, [Action(F, 0, 0), Action(W, 0, 0), Action(B, 0, 0)]))


def test_the_plan_is_drawn_with_every_action(tmp_path):
    plan = simulate(build("zb-v", 2, 2, 4))
    events = schedule_events(plan)
    assert sum(e["cat"] == "compute" for e in events) == 2 * 2 * 4 * 3  # F, B and W of each stage and micro-batch
    draw_timeline(events, tmp_path / "plan.png", "zb-v", "time (units)")
    assert (tmp_path / "plan.png").stat().st_size > 10_000
