"""Slot assignment from pipeline schedules, checked against a brute-force simulation.

The simulation walks the step list and keeps, per chunk, the microbatches whose forward ran
and whose backward has not: a slot must never be handed to a forward while another
microbatch of the same chunk holds it, and a chunk needs exactly as many slots as its peak of
microbatches in flight.
"""
from __future__ import annotations

import pytest

from megastrategy.cuda_graphs.slots import SlotPlan, SlotTracker, assign_slots, plan_for_schedule
from megastrategy.pipeline import schedule_steps, simulate_schedule
from megastrategy.pipeline.schedules import forward_only_steps


def brute_force(steps, plan: SlotPlan) -> tuple[dict[int, int], list[str]]:
    """(peak in flight per chunk, violations of the plan)."""
    in_flight: dict[int, dict[int, int]] = {}  # chunk -> microbatch -> slot
    backwards = {(c, m) for f, c, m, *_ in steps if not f}
    peak: dict[int, int] = {}
    errors = []
    for i, (is_forward, chunk, mb, *_) in enumerate(steps):
        held = in_flight.setdefault(chunk, {})
        if is_forward:
            slot = plan.slot_of[(chunk, mb)]
            if not 0 <= slot < plan.num_slots[chunk]:
                errors.append(f"step {i}: slot {slot} outside [0, {plan.num_slots[chunk]})")
            for other, s in held.items():
                if s == slot:
                    errors.append(f"step {i}: chunk {chunk} mb {mb} gets slot {slot} still held by mb {other}")
            held[mb] = slot
            peak[chunk] = max(peak.get(chunk, 0), len(held))
            if (chunk, mb) not in backwards:
                del held[mb]
        else:
            del held[mb]
    return peak, errors


CASES_1F1B = [(pp, M) for pp in (2, 4) for M in (4, 8, 16)]


@pytest.mark.parametrize("pp,M", CASES_1F1B)
def test_1f1b_slots_equal_in_flight_and_do_not_grow_with_microbatches(pp, M):
    for rank in range(pp):
        steps = schedule_steps(M, pp, rank)
        plan = assign_slots(steps)
        peak, errors = brute_force(steps, plan)
        assert errors == []
        assert plan.num_slots == (peak[0],)
        assert plan.num_slots == (pp - rank,)  # M >= pp in every case here
        # the executor's own count of held microbatches agrees
        assert simulate_schedule(M, pp).peak_in_flight[rank] == pp - rank
        assert len(plan.slot_of) == M  # every forward has a slot
        assert len(set(plan.slot_of.values())) == pp - rank  # and they are reused


def test_1f1b_fewer_microbatches_than_stages():
    plan = plan_for_schedule(2, 4, 0)
    assert plan.num_slots == (2,)


@pytest.mark.parametrize("pp,M", [(2, 4), (2, 8), (2, 16), (4, 8), (4, 16), (4, 32)])
def test_interleaved_vp2(pp, M):
    per_rank = []
    for rank in range(pp):
        steps = schedule_steps(M, pp, rank, 2)
        plan = assign_slots(steps)
        peak, errors = brute_force(steps, plan)
        assert errors == []
        assert plan.num_slots == (peak[0], peak[1])
        per_rank.append(plan.num_slots)
    # bounded by the schedule's depth, independent of M once M >= 2 * pp
    expected = {2: [(4, 2), (3, 1)], 4: [(8, 4), (8, 4), (7, 3), (5, 1)]}[pp]
    assert per_rank == expected


def test_forward_only_needs_one_slot_per_chunk():
    for vp in (1, 2):
        steps = forward_only_steps(8, vp)
        plan = assign_slots(steps)
        _, errors = brute_force(steps, plan)
        assert errors == []
        assert plan.num_slots == (1,) * vp
        assert plan_for_schedule(8, 4, 1, vp, forward_only=True).num_slots == (1,) * vp


def test_capture_order_follows_first_use():
    steps = schedule_steps(8, 2, 0, 2)
    plan = assign_slots(steps)
    first_use = []
    for f, c, m, *_ in steps:
        if f and (c, plan.slot_of[(c, m)]) not in first_use:
            first_use.append((c, plan.slot_of[(c, m)]))
    assert list(plan.capture_order) == first_use
    assert plan.capture_order[:2] == ((0, 0), (0, 1))


def test_brute_force_catches_a_bad_plan():
    """The checker is not vacuous: a plan that reuses a slot in flight is reported."""
    steps = schedule_steps(8, 4, 0)
    good = assign_slots(steps)
    bad = SlotPlan({k: 0 for k in good.slot_of}, (1,), ((0, 0),))
    _, errors = brute_force(steps, bad)
    assert errors and "still held" in errors[0]


def run_tracker(tracker: SlotTracker, steps) -> list:
    granted = []
    for f, c, m, *_ in steps:
        if f:
            tracker.on_forward(c, m)
            granted.append(tracker.current)
        else:
            tracker.on_backward(c, m)
            assert tracker.current is None
    return granted


def test_tracker_follows_plan_and_refuses_slots_in_flight():
    steps = schedule_steps(8, 4, 0)
    tracker = SlotTracker()
    tracker.begin(assign_slots(steps))
    granted = run_tracker(tracker, steps)
    assert all(s.slot is not None for s in granted)
    assert tracker.refusals == []
    assert tracker.end() == []
    # a wrong plan (one slot for everything) is refused at run time, not trusted
    tracker.begin(SlotPlan({(0, m): 0 for m in range(8)}, (1,), ((0, 0),)))
    granted = run_tracker(tracker, steps)
    assert [s.slot for s in granted[:4]] == [0, None, None, None]
    assert tracker.refusals[0] == (0, 1, 0, 0)
    # generations change with every acquisition of a slot
    tracker.begin(assign_slots(steps))
    gens = [(s.slot, s.generation) for s in run_tracker(tracker, steps)]
    assert len(set(gens)) == len(gens)


def test_tracker_end_reports_unreleased():
    tracker = SlotTracker()
    tracker.begin(plan_for_schedule(2))
    tracker.on_forward(0, 0)
    assert tracker.end() == [(0, 0, 0)]
    assert tracker.current is None


def test_bad_step_lists():
    with pytest.raises(ValueError, match="without a forward"):
        assign_slots([(False, 0, 0)])
    with pytest.raises(ValueError, match="twice"):
        assign_slots([(True, 0, 0), (True, 0, 0)])
