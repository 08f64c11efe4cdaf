"""ZB-H1 orders: well-formed, no deadlock, 1F1B's peak memory, and a third of 1F1B's bubble."""
import itertools

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline import StepPart, simulate_schedule, simulate_steps, zb_h1_steps

GRID = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 16]))  # (pp, m)


@pytest.mark.parametrize("p,m", GRID)
def test_every_microbatch_gets_f_then_b_then_w_once(p, m):
    for rank in range(p):
        steps = zb_h1_steps(m, p, rank)
        assert len(steps) == 3 * m
        position = {(s.kind, s.microbatch): i for i, s in enumerate(steps)}
        assert len(position) == 3 * m
        for mb in range(m):
            assert position[("F", mb)] < position[("B", mb)] < position[("W", mb)]
        assert all(s.chunk == 0 for s in steps)
        assert {s.part for s in steps if not s.is_forward} == {StepPart.INPUT, StepPart.WEIGHT}


@pytest.mark.parametrize("p,m", GRID)
def test_peak_memory_is_1f1b_peak(p, m):
    """No rank holds more microbatches awaiting their W than 1F1B's first stage holds."""
    zb = simulate_schedule(m, p, schedule="zb_h1")
    assert max(zb.peak_in_flight) == max(simulate_schedule(m, p).peak_in_flight) == min(p, m)


def test_worked_example_pp4_m8():
    text = lambda r: " ".join(f"{s.kind}{s.microbatch}" for s in zb_h1_steps(8, 4, r))  # noqa: E731
    assert text(0) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert text(3) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"


def test_bubble_is_a_third_of_1f1b_at_pp4_m8():
    """Timing model: F = B = W = 1, and 1F1B's whole backward = B + W = 2 (the simulator's defaults)."""
    one_f_one_b = simulate_schedule(8, 4, forward_time=1.0, backward_time=2.0)
    zb = simulate_schedule(8, 4, forward_time=1.0, backward_time=2.0, schedule="zb_h1")
    assert one_f_one_b.idle == pytest.approx([9.0] * 4)  # (p-1)(F+B+W)
    assert zb.idle == pytest.approx([3.0] * 4)  # (p-1)(F+B-W)
    assert zb.total_idle <= one_f_one_b.total_idle / 3 + 1e-9
    assert zb.makespan == pytest.approx(27.0) and one_f_one_b.makespan == pytest.approx(33.0)
    assert zb.bubble_fraction == pytest.approx(3 / 27)  # the share of the makespan: 0.41 x 1F1B's 3/11


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= p])
def test_idle_is_p_minus_1_forwards_with_equal_times(p, m):
    zb = simulate_schedule(m, p, schedule="zb_h1")
    assert zb.idle == pytest.approx([float(p - 1)] * p)


@pytest.mark.parametrize("tf,tb,tw", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (0.7, 1.0, 1.3), (1.0, 0.0, 2.0)])
def test_timeline_honours_dependencies(tf, tb, tw):
    p, m, hop = 4, 8, 0.25
    stats = simulate_schedule(m, p, forward_time=tf, backward_time=tb + tw, input_grad_time=tb,
                              weight_grad_time=tw, p2p_time=hop, schedule="zb_h1")
    end = {(t.kind, t.rank, t.microbatch): t.end for row in stats.timeline for t in row}
    for rank, row in enumerate(stats.timeline):
        previous = 0.0
        for t in row:
            assert t.start >= previous - 1e-9
            previous = t.end
            assert t.end - t.start == pytest.approx({"F": tf, "B": tb, "W": tw}[t.kind])
            if t.kind == "F" and rank > 0:
                assert t.start >= end[("F", rank - 1, t.microbatch)] + hop - 1e-9
            if t.kind == "B":
                assert t.start >= end[("F", rank, t.microbatch)] - 1e-9
                if rank < p - 1:
                    assert t.start >= end[("B", rank + 1, t.microbatch)] + hop - 1e-9
            if t.kind == "W":
                assert t.start >= end[("B", rank, t.microbatch)] - 1e-9


def test_w_before_its_b_deadlocks():
    from megastrategy.pipeline import PipelineDeadlockError, ScheduleStep

    order = [ScheduleStep(True, 0, 0), ScheduleStep(False, 0, 0, StepPart.WEIGHT), ScheduleStep(False, 0, 0, StepPart.INPUT)]
    with pytest.raises(PipelineDeadlockError, match="backward of stage 0"):
        simulate_steps([order])


def test_bad_rank():
    with pytest.raises(MegatronConfigError, match="pp_rank=4"):
        zb_h1_steps(8, 4, 4)


def test_per_rank_step_times():
    """The first stage has no input gradient to compute: B costs nothing there, W all of the backward."""
    from megastrategy.pipeline import ScheduleStep

    def cost(rank: int, step: ScheduleStep) -> float:
        if step.kind == "F":
            return 1.0
        if rank == 0:
            return 0.0 if step.kind == "B" else 2.0
        return 1.0

    orders = [zb_h1_steps(8, 4, r) for r in range(4)]
    stats = simulate_steps(orders, step_time=cost)
    assert stats.busy == pytest.approx([24.0] * 4)
    assert stats.makespan <= 27.0
