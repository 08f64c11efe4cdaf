import itertools

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline import (
    PipelineDeadlockError,
    ScheduleStats,
    draw_timeline,
    num_warmup_steps,
    schedule_steps,
    simulate_schedule,
    simulate_steps,
)


def check_timeline(stats: ScheduleStats, forward_time, backward_time, p2p_time=0.0):
    """Independent check of the simulated times: no overlap per rank, every dependency honoured."""
    pp, vp = stats.pp_size, stats.vp_size
    end = {}
    for row in stats.timeline:
        for t in row:
            end[(t.is_forward, t.chunk * pp + t.rank, t.microbatch)] = t.end
    for rank, row in enumerate(stats.timeline):
        prev_end = 0.0
        for t in row:
            assert t.rank == rank
            assert t.start >= prev_end - 1e-9
            assert t.end - t.start == pytest.approx(forward_time if t.is_forward else backward_time)
            prev_end = t.end
            stage = t.chunk * pp + rank
            if t.is_forward and stage > 0:
                hop = p2p_time if (stage - 1) % pp != rank else 0.0
                assert t.start >= end[(True, stage - 1, t.microbatch)] + hop - 1e-9
            if not t.is_forward:
                assert t.start >= end[(True, stage, t.microbatch)] - 1e-9
                if stage < pp * vp - 1:
                    hop = p2p_time if (stage + 1) % pp != rank else 0.0
                    assert t.start >= end[(False, stage + 1, t.microbatch)] + hop - 1e-9


# --------------------------------------------------------------------------------------
# Bubble against theory
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", list(itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 8, 12])))
@pytest.mark.parametrize("tf,tb", [(1.0, 1.0), (1.0, 2.0), (0.5, 1.25)])
def test_1f1b_bubble_matches_closed_form(p, m, tf, tb):
    stats = simulate_schedule(m, p, forward_time=tf, backward_time=tb)
    # bubble time per rank is (p-1)(tf+tb): the ramp-up forwards plus the drain backwards
    assert stats.makespan == pytest.approx((m + p - 1) * (tf + tb))
    assert stats.idle == pytest.approx([(p - 1) * (tf + tb)] * p)
    assert stats.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    check_timeline(stats, tf, tb)


INTERLEAVED_CASES = [(p, v, m) for p in (1, 2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p, 4 * p)]


@pytest.mark.parametrize("p,v,m", INTERLEAVED_CASES)
@pytest.mark.parametrize("tf,tb", [(1.0, 1.0), (1.0, 2.0)])
def test_interleaved_bubble_matches_closed_form(p, v, m, tf, tb):
    stats = simulate_schedule(m, p, v, forward_time=tf, backward_time=tb)
    # times are per chunk: the idle time per rank stays (p-1)(tf+tb) chunk-steps, i.e. the
    # non-interleaved bubble divided by v when a chunk costs 1/v of a full stage
    assert stats.idle == pytest.approx([(p - 1) * (tf + tb)] * p)
    assert stats.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    check_timeline(stats, tf, tb)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 6)])
def test_interleaving_shrinks_bubble_for_the_same_model(p, m):
    tf, tb = 1.0, 2.0
    plain = simulate_schedule(m, p, 1, forward_time=tf, backward_time=tb)
    for v in (2, 3):
        inter = simulate_schedule(m, p, v, forward_time=tf / v, backward_time=tb / v)
        assert inter.bubble_fraction < plain.bubble_fraction
        assert inter.idle[0] == pytest.approx(plain.idle[0] / v)  # the (p-1)/v bubble-time ratio
        assert inter.makespan < plain.makespan


def test_group_size_larger_than_pp_keeps_bubble():
    a = simulate_schedule(16, 4, 2, group_size=4)
    b = simulate_schedule(16, 4, 2, group_size=8)
    assert b.bubble_fraction == pytest.approx(a.bubble_fraction)
    assert b.peak_in_flight[0] > a.peak_in_flight[0]  # bigger groups hold more activations


def test_reported_numbers_pp4_m8():
    plain = simulate_schedule(8, 4, 1)
    inter = simulate_schedule(8, 4, 2)
    assert plain.bubble_fraction == pytest.approx(3 / 11)
    assert inter.bubble_fraction == pytest.approx(3 / 19)
    assert plain.makespan == pytest.approx(33.0)
    assert inter.makespan == pytest.approx(57.0)


def test_p2p_time_single_microbatch():
    p, tf, tb, c = 4, 1.0, 2.0, 0.25
    stats = simulate_schedule(1, p, forward_time=tf, backward_time=tb, p2p_time=c)
    assert stats.makespan == pytest.approx(p * (tf + tb) + 2 * (p - 1) * c)
    check_timeline(stats, tf, tb, c)


@pytest.mark.parametrize("v", [1, 2])
def test_p2p_time_only_slows_down(v):
    base = simulate_schedule(8, 4, v)
    slow = simulate_schedule(8, 4, v, p2p_time=0.5)
    assert slow.makespan > base.makespan
    assert slow.busy == base.busy
    check_timeline(slow, 1.0, 2.0, 0.5)


def test_single_rank_has_no_bubble():
    for v in (1, 3):
        stats = simulate_schedule(6, 1, v, p2p_time=1.0)
        assert stats.bubble_fraction == 0.0
        assert stats.makespan == pytest.approx(6 * v * 3.0)


# --------------------------------------------------------------------------------------
# Memory: peak in-flight microbatches
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", list(itertools.product([1, 2, 3, 4, 6], [1, 2, 4, 8])))
def test_1f1b_peak_in_flight(p, m):
    stats = simulate_schedule(m, p)
    assert stats.peak_in_flight == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,v,m,g", [(4, 2, 8, None), (4, 2, 4, None), (2, 3, 8, 4), (3, 2, 12, 6), (4, 3, 16, None)])
def test_interleaved_peak_in_flight_is_warmup_plus_one(p, v, m, g):
    stats = simulate_schedule(m, p, v, g)
    expected = [min(num_warmup_steps(m, p, r, v, g) + 1, m * v) for r in range(p)]
    assert stats.peak_in_flight == expected
    assert simulate_schedule(8, 4, 2).peak_in_flight == [11, 9, 7, 5]


# --------------------------------------------------------------------------------------
# Deadlocks and bad input
# --------------------------------------------------------------------------------------
def test_crossed_orders_deadlock():
    # rank 1 wants microbatch 1 first; rank 0 only sends it after microbatch 0's backward,
    # which needs rank 1 to have run microbatch 0 -> nobody can move
    rank0 = [(True, 0, 0), (False, 0, 0), (True, 0, 1), (False, 0, 1)]
    rank1 = [(True, 0, 1), (False, 0, 1), (True, 0, 0), (False, 0, 0)]
    with pytest.raises(PipelineDeadlockError, match=r"rank 1 step 0 .* forward of stage 0 \(rank 0, chunk 0\) mb 1"):
        simulate_steps([rank0, rank1])


def test_backward_before_forward_deadlocks():
    with pytest.raises(PipelineDeadlockError, match="rank 0 step 0"):
        simulate_steps([[(False, 0, 0), (True, 0, 0)]])


def test_missing_step_deadlocks():
    rank0 = [(True, 0, 0), (False, 0, 0)]
    rank1 = [(False, 0, 0)]  # never runs the forward its backward needs
    with pytest.raises(PipelineDeadlockError):
        simulate_steps([rank0, rank1])


def test_interleaved_group_smaller_than_pp_would_deadlock():
    """The reason validate_schedule refuses group_size < pp_size."""
    from megastrategy.pipeline.schedules import _virtual_step

    m, p, v, g = 8, 4, 2, 2
    orders = []
    for r in range(p):
        total, w = m * v, min(2 * (p - r - 1) + (v - 1) * g, m * v)
        order = [_virtual_step(i, m, v, g, True) for i in range(w)]
        for i in range(total - w):
            order += [_virtual_step(w + i, m, v, g, True), _virtual_step(i, m, v, g, False)]
        order += [_virtual_step(i, m, v, g, False) for i in range(total - w, total)]
        orders.append(order)
    with pytest.raises(PipelineDeadlockError):
        simulate_steps(orders, v)


def test_bad_simulator_inputs():
    with pytest.raises(MegatronConfigError, match="chunk"):
        simulate_steps([[(True, 1, 0)]], vp_size=1)
    with pytest.raises(MegatronConfigError, match="twice"):
        simulate_steps([[(True, 0, 0), (True, 0, 0)]])
    with pytest.raises(MegatronConfigError, match="forward_time"):
        simulate_schedule(4, 2, forward_time=-1.0)
    with pytest.raises(MegatronConfigError, match="num_microbatches=7"):
        simulate_schedule(7, 4, 2)


def test_custom_orders_match_library_orders():
    orders = [schedule_steps(8, 4, r, 2) for r in range(4)]
    assert simulate_steps(orders, 2).makespan == simulate_schedule(8, 4, 2).makespan


@pytest.mark.parametrize("m,p,v,g", [(5, 4, 1, None), (5, 4, 2, None), (7, 3, 3, 2), (8, 4, 2, 4)])
def test_forward_only(m, p, v, g):
    stats = simulate_schedule(m, p, v, g, forward_only=True)
    assert all(len(row) == m * v for row in stats.timeline)
    assert all(t.is_forward for row in stats.timeline for t in row)
    check_timeline(stats, 1.0, 2.0)


# --------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------
def test_draw_timeline_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    draw_timeline(simulate_schedule(8, 4, 2), path, "interleaved")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
