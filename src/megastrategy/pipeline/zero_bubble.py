"""ZB-H1: 1F1B with each backward split into B (input gradient) and a deferred W (weight gradients).

Only B is on the path the gradient travels back through the pipeline, so the first stage gets
its gradients back after ``(p - 1)`` B's instead of ``(p - 1)`` whole backwards; the W's a
rank holds back fill the time it would otherwise wait. Rank ``r`` runs 1F1B's warm-up
(``p - r - 1`` forwards) and steady phase with B in place of the backward, and delays each W by
``r`` microbatches: the rank then holds at most ``p`` microbatches whose W has not run, the
number 1F1B's first stage holds, so the peak memory over the ranks is 1F1B's (later ranks hold
more than they did under 1F1B, up to that peak). The cool-down runs one W after each B and the
remaining W's last.

With a forward, B and W of equal cost ``t`` (a whole backward ``2t``), every rank idles
``(p - 1) t`` per step against 1F1B's ``3 (p - 1) t``: the bubble time is a third (the ZB-H1
schedule of Qi et al., "Zero Bubble Pipeline Parallelism", 2023).
"""
from __future__ import annotations

from megastrategy.pipeline.layer_assignment import check_positive_int
from megastrategy.pipeline.schedules import ScheduleStep, StepPart, _check_rank

__all__ = ["zb_h1_steps"]


def zb_h1_steps(num_microbatches: int, pp_size: int, pp_rank: int) -> list[ScheduleStep]:
    """The ZB-H1 order of one rank (one model chunk per rank): F, B and W steps."""
    check_positive_int("num_microbatches", num_microbatches)
    check_positive_int("pp_size", pp_size)
    _check_rank(pp_size, pp_rank)
    m = num_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    delay = pp_rank  # W's held back: warm-up + 1 + delay = pp_size microbatches in flight at most

    def f(mb: int) -> ScheduleStep:
        return ScheduleStep(True, 0, mb)

    def b(mb: int) -> ScheduleStep:
        return ScheduleStep(False, 0, mb, StepPart.INPUT)

    def w(mb: int) -> ScheduleStep:
        return ScheduleStep(False, 0, mb, StepPart.WEIGHT)

    steps = [f(i) for i in range(warmup)]
    weights_done = 0
    for i in range(m - warmup):
        steps += [f(warmup + i), b(i)]
        if i >= delay:
            steps.append(w(weights_done))
            weights_done += 1
    for i in range(m - warmup, m):
        steps += [b(i), w(weights_done)]
        weights_done += 1
    steps += [w(i) for i in range(weights_done, m)]
    return steps
