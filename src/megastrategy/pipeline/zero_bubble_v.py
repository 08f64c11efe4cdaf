"""ZB-V: two model chunks per rank in a V, each backward split into B and W (Qi et al., 2023).

Under the ``v`` placement (:mod:`.placement`) rank ``r`` runs stage ``r`` (chunk 0, going down)
and stage ``2p - 1 - r`` (chunk 1, coming back up), so the last stage, and the loss, is on rank 0.
A microbatch's forward goes down chunk 0 and up chunk 1 and its input gradient retraces the path;
rank 0 can start the backward of the first microbatch after ``2p`` forward chunks, and every rank
sees work of both directions in flight at once. With F = B = W the bubble is about
``(p - 1)`` F's per rank, as ZB-H1's, but each F is half a stage, so the idle time is half of it.

The order of rank ``r`` (``f0``/``f1``: forwards of chunk 0/1, and so on):

1. warm-up: ``2(p - r) - 1`` ``F0``; ``r`` pairs ``F1 F0``; ``p - r`` triples ``F1 B1 W1``
   (the first gradients come back up chunk 1);
2. steady: ``F0`` (while microbatches remain) ``B0 W0 F1 B1 W1``, until every ``F1`` has run;
3. cool-down: ``r`` pairs ``B0 B1``; ``p - r`` pairs ``B0 W0``, the W's deferred here fill the
   wait for the next gradient; then the remaining ``W1`` and ``W0``.

Rank 0 runs ``2p - 1`` chunk-0 forwards before it can start the way back, so the schedule needs
``num_microbatches >= 2p - 1``.
"""
from __future__ import annotations

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.layer_assignment import check_positive_int
from megastrategy.pipeline.schedules import ScheduleStep, StepPart, _check_rank

__all__ = ["check_zb_v", "zb_v_steps"]


def check_zb_v(num_microbatches: int, pp_size: int) -> None:
    """Refuse a layout ZB-V cannot run, naming the rule and the fix."""
    check_positive_int("num_microbatches", num_microbatches)
    check_positive_int("pp_size", pp_size)
    if pp_size < 2:
        raise MegatronConfigError(
            f"pipeline_schedule='zb_v' with pp={pp_size}: ZB-V folds the model into a V over the pipeline ranks, "
            "so it needs pp >= 2. Use pp >= 2, or pipeline_schedule='1f1b'."
        )
    if num_microbatches < 2 * pp_size - 1:
        raise MegatronConfigError(
            f"pipeline_schedule='zb_v' with num_microbatches={num_microbatches}, pp={pp_size}: the first rank runs "
            f"2*pp - 1 = {2 * pp_size - 1} chunk-0 forwards before the first gradient can come back, so ZB-V needs "
            f"num_microbatches >= 2*pp - 1. Use num_microbatches >= {2 * pp_size - 1}, a smaller pp, or "
            "pipeline_schedule='zb_h1'."
        )


class _Counters:
    """The next microbatch of each (kind, chunk) on one rank, handed out as steps."""

    def __init__(self) -> None:
        self.next = {(k, c): 0 for k in "FBW" for c in (0, 1)}

    def take(self, kind: str, chunk: int) -> ScheduleStep:
        mb = self.next[(kind, chunk)]
        self.next[(kind, chunk)] += 1
        part = {"F": StepPart.WHOLE, "B": StepPart.INPUT, "W": StepPart.WEIGHT}[kind]
        return ScheduleStep(kind == "F", chunk, mb, part)

    def count(self, kind: str, chunk: int) -> int:
        return self.next[(kind, chunk)]


def zb_v_steps(num_microbatches: int, pp_size: int, pp_rank: int) -> list[ScheduleStep]:
    """The ZB-V order of one rank (chunk 0 = stage ``pp_rank``, chunk 1 = stage ``2p - 1 - pp_rank``)."""
    check_zb_v(num_microbatches, pp_size)
    _check_rank(pp_size, pp_rank)
    m, p, r = num_microbatches, pp_size, pp_rank
    n = _Counters()
    steps: list[ScheduleStep] = []

    def run(*pattern: str) -> None:  # e.g. run("F1", "B1") appends the next F of chunk 1, then its B
        steps.extend(n.take(code[0], int(code[1])) for code in pattern)

    for _ in range(2 * (p - r) - 1):
        run("F0")
    for _ in range(r):
        run("F1", "F0")
    for _ in range(p - r):
        run("F1", "B1", "W1")
    while n.count("F", 1) < m:
        if n.count("F", 0) < m:
            run("F0")
        run("B0", "W0", "F1", "B1", "W1")
    for _ in range(r):
        run("B0", "B1")
    for _ in range(p - r):
        run("B0", "W0")
    while n.count("W", 1) < m:
        run("W1")
    while n.count("W", 0) < m:
        run("W0")
    return steps
