import itertools
from collections import deque

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline import (
    ScheduleStep,
    StepPart,
    forward_only_order,
    forward_only_steps,
    num_warmup_steps,
    schedule_order,
    schedule_steps,
    simulate_schedule,
)


# --------------------------------------------------------------------------------------
# Independent reference: build the full forward and backward queues explicitly with
# nested loops (group -> chunk -> microbatch), then drain them by the warm-up count.
# --------------------------------------------------------------------------------------
def reference_steps(m, pp, rank, vp=1, group=None):
    g = pp if group is None else group
    if vp == 1:
        g = m
    forwards, backwards = deque(), deque()
    for first in range(0, m, g):
        for chunk in range(vp):
            for mb in range(first, first + g):
                forwards.append((True, chunk, mb))
        for chunk in reversed(range(vp)):
            for mb in range(first, first + g):
                backwards.append((False, chunk, mb))
    if vp == 1:
        warmup = min(pp - rank - 1, m)
    else:
        warmup = min(2 * (pp - rank - 1) + (vp - 1) * g, m * vp)
    out = [forwards.popleft() for _ in range(warmup)]
    while forwards:
        out.append(forwards.popleft())
        out.append(backwards.popleft())
    out.extend(backwards)
    return out


def grid():
    for m, pp, vp in itertools.product([4, 8, 12, 16], [1, 2, 3, 4], [1, 2, 3]):
        for group in (None, pp, 2 * pp):
            if group is not None and vp > 1 and m % group != 0:
                continue
            if group is None and vp > 1 and m % pp != 0:
                continue
            yield m, pp, vp, group


GRID = list(grid())


def test_grid_is_not_trivial():
    assert len(GRID) > 100
    assert any(vp > 1 and g == 2 * pp for _, pp, vp, g in GRID)


# --------------------------------------------------------------------------------------
# Worked examples
# --------------------------------------------------------------------------------------
def test_interleaved_worked_example_rank0():
    warmup = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1]
    steady = [1, -2, 1, -2, 2, -2, 2, -2, 2, -1, 2, -1]
    cooldown = [-1, -1, -2, -2, -2, -2, -1, -1, -1, -1]
    order = schedule_order(8, 4, 0, vp_size=2)
    assert order == warmup + steady + cooldown
    assert len(order) == 32


def test_interleaved_worked_example_microbatch_ids():
    steps = schedule_steps(8, 4, 0, vp_size=2)
    assert [s.microbatch for s in steps[:10]] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    # first backward is chunk 1 of microbatch 0 (it came back from the last virtual stage)
    assert steps[11] == ScheduleStep(False, 1, 0)
    assert steps[-1] == ScheduleStep(False, 0, 7)


def test_non_interleaved_1f1b():
    assert schedule_order(4, 4, 0) == [1, 1, 1, 1, -1, -1, -1, -1]
    assert schedule_order(4, 4, 3) == [1, -1] * 4
    assert schedule_order(8, 4, 1) == [1, 1] + [1, -1] * 6 + [-1, -1]
    assert [s.microbatch for s in schedule_steps(8, 4, 1)] == [0, 1, 2, 0, 3, 1, 4, 2, 5, 3, 6, 4, 7, 5, 6, 7]


def test_non_interleaved_fewer_microbatches_than_stages():
    assert schedule_order(2, 4, 0) == [1, 1, -1, -1]
    assert schedule_order(2, 4, 2) == [1, 1, -1, -1]
    assert schedule_order(2, 4, 3) == [1, -1, 1, -1]


def test_warmup_counts():
    assert [num_warmup_steps(8, 4, r, 2) for r in range(4)] == [10, 8, 6, 4]
    assert [num_warmup_steps(8, 4, r) for r in range(4)] == [3, 2, 1, 0]
    assert num_warmup_steps(4, 4, 0, 2) == 8  # capped at M * vp: all forwards first


def test_interleaved_all_warmup_when_capped():
    order = schedule_order(4, 4, 0, vp_size=2)
    assert order == [1] * 4 + [2] * 4 + [-2] * 4 + [-1] * 4


def test_group_size_larger_than_pp():
    steps = schedule_steps(8, 2, 1, vp_size=2, group_size=4)
    fwd = [(s.chunk, s.microbatch) for s in steps if s.is_forward]
    assert fwd == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3),
                   (0, 4), (0, 5), (0, 6), (0, 7), (1, 4), (1, 5), (1, 6), (1, 7)]


def test_step_code_matches_order():
    for s, code in zip(schedule_steps(8, 4, 2, 2), schedule_order(8, 4, 2, 2)):
        assert s.code == code


# --------------------------------------------------------------------------------------
# Grid against the reference, plus properties
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,pp,vp,group", GRID)
def test_matches_reference(m, pp, vp, group):
    for rank in range(pp):
        got = [tuple(s[:3]) for s in schedule_steps(m, pp, rank, vp, group)]
        assert {s.part for s in schedule_steps(m, pp, rank, vp, group)} == {StepPart.WHOLE}
        assert got == reference_steps(m, pp, rank, vp, group), (m, pp, vp, group, rank)


@pytest.mark.parametrize("m,pp,vp,group", GRID)
def test_each_step_once_and_backward_after_forward(m, pp, vp, group):
    for rank in range(pp):
        steps = schedule_steps(m, pp, rank, vp, group)
        assert len(steps) == 2 * m * vp
        seen_forward = set()
        seen_backward = set()
        for s in steps:
            key = (s.chunk, s.microbatch)
            assert 0 <= s.chunk < vp and 0 <= s.microbatch < m
            if s.is_forward:
                assert key not in seen_forward
                seen_forward.add(key)
            else:
                assert key in seen_forward, f"backward {key} before its forward on rank {rank}"
                assert key not in seen_backward
                seen_backward.add(key)
        everything = {(c, mb) for c in range(vp) for mb in range(m)}
        assert seen_forward == everything and seen_backward == everything
        assert set(schedule_order(m, pp, rank, vp, group)) <= {k for c in range(1, vp + 1) for k in (c, -c)}


@pytest.mark.parametrize("m,pp,vp,group", GRID)
def test_simulator_runs_without_deadlock(m, pp, vp, group):
    stats = simulate_schedule(m, pp, vp, group)
    assert all(len(row) == 2 * m * vp for row in stats.timeline)


# --------------------------------------------------------------------------------------
# Invalid configurations
# --------------------------------------------------------------------------------------
def test_interleaved_needs_whole_groups():
    with pytest.raises(MegatronConfigError) as info:
        schedule_order(7, 4, 0, vp_size=2)
    msg = str(info.value)
    assert "num_microbatches=7" in msg and "group_size=4" in msg
    assert "{4, 8}" in msg and "vp_size=1" in msg
    assert "group_size in {7}" in msg


def test_interleaved_group_smaller_than_pp():
    with pytest.raises(MegatronConfigError, match=r"group_size=2 .*pp_size=4.*group_size >= 4"):
        schedule_order(8, 4, 0, vp_size=2, group_size=2)


def test_explicit_group_not_dividing_microbatches():
    with pytest.raises(MegatronConfigError, match=r"group_size in \{4, 8\}"):
        schedule_order(8, 4, 0, vp_size=2, group_size=6)


def test_group_size_ignored_without_interleaving():
    assert schedule_order(7, 4, 0, group_size=3) == schedule_order(7, 4, 0)


@pytest.mark.parametrize("rank", [-1, 4, 10])
def test_rank_out_of_range(rank):
    with pytest.raises(MegatronConfigError, match=rf"pp_rank={rank}.*0 <= pp_rank <= 3"):
        schedule_order(8, 4, rank)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(num_microbatches=0, pp_size=4, pp_rank=0), "num_microbatches"),
        (dict(num_microbatches=8, pp_size=0, pp_rank=0), "pp_size"),
        (dict(num_microbatches=8, pp_size=4, pp_rank=0, vp_size=0), "vp_size"),
        (dict(num_microbatches=8, pp_size=4, pp_rank=0, vp_size=2, group_size=0), "group_size"),
        (dict(num_microbatches=8.0, pp_size=4, pp_rank=0), "num_microbatches"),
        (dict(num_microbatches=8, pp_size=4, pp_rank=True), "pp_rank"),
    ],
)
def test_bad_values(kwargs, name):
    with pytest.raises(MegatronConfigError, match=name):
        schedule_order(**kwargs)


# --------------------------------------------------------------------------------------
# Forward-only
# --------------------------------------------------------------------------------------
def test_forward_only_non_interleaved():
    assert forward_only_order(5) == [1] * 5
    assert [s.microbatch for s in forward_only_steps(5)] == [0, 1, 2, 3, 4]


def test_forward_only_interleaved_default_is_chunk_major():
    assert forward_only_order(3, vp_size=2) == [1, 1, 1, 2, 2, 2]


def test_forward_only_grouped_allows_short_last_group():
    steps = forward_only_steps(5, vp_size=2, group_size=2)
    assert [(s.chunk, s.microbatch) for s in steps] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3), (0, 4), (1, 4)]


def test_forward_only_rejects_bad_values():
    with pytest.raises(MegatronConfigError, match="num_microbatches"):
        forward_only_order(0)
    with pytest.raises(MegatronConfigError, match="group_size"):
        forward_only_order(4, 2, group_size=0)
