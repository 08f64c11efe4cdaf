"""The order in which one pipeline rank runs its forward and backward steps.

Every rank runs three phases: warm-up forwards (fill the pipeline so the last stage has
work), a steady phase alternating one forward with one backward (so at most a bounded
number of microbatches hold activations), and cool-down backwards (drain it).

Interleaving (``vp_size > 1``) gives each rank several model chunks. Forwards visit the
chunks in groups of ``group_size`` microbatches (Megatron's
``microbatch_group_size_per_vp_stage``): chunk 0 for the group's microbatches, then chunk
1 for the same microbatches, and so on; backwards visit the chunks in reverse. A group as
large as the pipeline lets a rank keep busy on its next chunk while the group's first
microbatch is still travelling through the other ranks.

Steps are encoded as in Megatron's schedule tables: ``+k`` is the forward of local chunk
``k - 1``, ``-k`` its backward; :func:`schedule_steps` adds the microbatch ids. Zero-bubble
schedules (:mod:`.zero_bubble`) split a backward in two parts, told apart by
:class:`StepPart`: the input gradient (B, still coded ``-k``: it is what the previous stage
waits for) and the deferred weight gradient (W, which has no Megatron code).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.layer_assignment import check_positive_int

__all__ = [
    "ScheduleStep",
    "StepPart",
    "forward_only_order",
    "forward_only_steps",
    "num_warmup_steps",
    "schedule_order",
    "schedule_steps",
    "validate_schedule",
]


class StepPart(str, Enum):
    """Which gradients a backward step computes (a forward is always ``WHOLE``).

    Splitting lets a schedule send the input gradient upstream at once and compute the weight
    gradients later, in time the rank would otherwise spend waiting (the zero-bubble idea).
    """

    WHOLE = "whole"  # input and weight gradients in one pass (1F1B, interleaved 1F1B)
    INPUT = "input"  # B: only the stage input's gradient; what W needs is kept
    WEIGHT = "weight"  # W: the parameter gradients of an earlier INPUT step


class ScheduleStep(NamedTuple):
    """One step of a rank's schedule: a forward or a backward (part) of one chunk on one microbatch."""

    is_forward: bool
    chunk: int
    microbatch: int
    part: StepPart = StepPart.WHOLE

    @property
    def kind(self) -> str:
        """``"F"``, ``"B"`` (a whole backward or its input-gradient part) or ``"W"`` (weight gradients)."""
        if self.is_forward:
            return "F"
        return "W" if self.part is StepPart.WEIGHT else "B"

    @property
    def code(self) -> int:
        """The signed table entry: ``+(chunk + 1)`` for a forward, ``-(chunk + 1)`` for a backward."""
        if self.part is StepPart.WEIGHT:
            raise ValueError(
                f"{self} is a weight-gradient (W) step, which has no signed Megatron code; use .kind and .chunk."
            )
        return self.chunk + 1 if self.is_forward else -(self.chunk + 1)


def _fmt(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def validate_schedule(
    num_microbatches: int, pp_size: int, vp_size: int = 1, group_size: int | None = None
) -> int | None:
    """Check a schedule configuration; return the effective group size (``None`` when ``vp_size == 1``).

    Interleaving needs ``group_size >= pp_size`` (with a smaller group the warm-up asks
    rank 0 for a chunk-1 forward whose input has not come round the pipeline yet, which
    deadlocks or stalls; it is also Megatron's rule) and
    ``num_microbatches % group_size == 0`` (the warm-up count assumes full groups; a short
    last group is not supported).
    """
    check_positive_int("num_microbatches", num_microbatches)
    check_positive_int("pp_size", pp_size)
    check_positive_int("vp_size", vp_size)
    if group_size is not None:
        check_positive_int("group_size", group_size)
    if vp_size == 1:
        return None  # without chunks there is nothing to group; group_size is ignored
    group = pp_size if group_size is None else group_size
    if group < pp_size:
        raise MegatronConfigError(
            f"group_size={group} (microbatch_group_size_per_vp_stage) is smaller than "
            f"pp_size={pp_size}; the interleaved schedule (vp_size={vp_size}) needs "
            f"group_size >= pp_size: a smaller group makes the first rank wait for inputs that have "
            f"not come round the pipeline yet, which deadlocks. Use group_size >= {pp_size} (default: pp_size) "
            f"or vp_size=1."
        )
    if num_microbatches % group != 0:
        lower = (num_microbatches // group) * group
        counts = [c for c in (lower, lower + group) if c > 0]
        divisors = [d for d in range(pp_size, num_microbatches + 1) if num_microbatches % d == 0]
        default_note = " (the default, pp_size)" if group_size is None else ""
        options = [f"num_microbatches in {_fmt(counts)}"]
        if divisors:
            options.append(f"group_size in {_fmt(divisors)} (divisors of {num_microbatches} that are >= pp_size)")
        options.append("vp_size=1")
        raise MegatronConfigError(
            f"num_microbatches={num_microbatches} is not a multiple of group_size={group}"
            f"{default_note}; the interleaved schedule (pp_size={pp_size}, vp_size={vp_size}) "
            f"runs microbatches in whole groups of group_size. Would work: "
            + "; or ".join(options)
            + "."
        )
    return group


def _check_rank(pp_size: int, pp_rank: int) -> None:
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int):
        raise MegatronConfigError(f"pp_rank={pp_rank!r} must be an int in [0, {pp_size}).")
    if not 0 <= pp_rank < pp_size:
        raise MegatronConfigError(
            f"pp_rank={pp_rank} is out of range for pp_size={pp_size}; use 0 <= pp_rank <= {pp_size - 1}."
        )


def num_warmup_steps(
    num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int = 1, group_size: int | None = None
) -> int:
    """Forwards a rank runs before its first backward.

    Non-interleaved: ``pp - rank - 1``, the forwards still needed downstream before the
    first backward can come back. Interleaved: two steps per downstream rank (the forward
    goes down and the backward comes back on different chunks) plus one full group per
    extra chunk, capped at the total number of forwards.
    """
    group = validate_schedule(num_microbatches, pp_size, vp_size, group_size)
    _check_rank(pp_size, pp_rank)
    if vp_size == 1:
        return min(pp_size - pp_rank - 1, num_microbatches)
    assert group is not None
    warmup = (pp_size - pp_rank - 1) * 2 + (vp_size - 1) * group
    return min(warmup, num_microbatches * vp_size)


def _virtual_step(index: int, num_microbatches: int, vp_size: int, group: int, forward: bool) -> ScheduleStep:
    """Map the ``index``-th forward (or backward) of a rank to its chunk and microbatch."""
    group_id, within = divmod(index, group * vp_size)
    chunk = within // group
    if not forward:
        chunk = vp_size - 1 - chunk
    return ScheduleStep(forward, chunk, group_id * group + within % group)


def schedule_steps(
    num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int = 1, group_size: int | None = None
) -> list[ScheduleStep]:
    """The rank's training steps in order, with chunk and microbatch id for each."""
    group = validate_schedule(num_microbatches, pp_size, vp_size, group_size)
    _check_rank(pp_size, pp_rank)
    total = num_microbatches * vp_size
    warmup = num_warmup_steps(num_microbatches, pp_size, pp_rank, vp_size, group_size)
    eff_group = num_microbatches if group is None else group  # vp_size == 1: one group, chunk 0

    def fwd(i: int) -> ScheduleStep:
        return _virtual_step(i, num_microbatches, vp_size, eff_group, True)

    def bwd(i: int) -> ScheduleStep:
        return _virtual_step(i, num_microbatches, vp_size, eff_group, False)

    steps = [fwd(i) for i in range(warmup)]
    steady = total - warmup
    for i in range(steady):
        steps.append(fwd(warmup + i))
        steps.append(bwd(i))
    steps.extend(bwd(i) for i in range(steady, total))
    return steps


def schedule_order(
    num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int = 1, group_size: int | None = None
) -> list[int]:
    """The rank's training steps as signed chunk numbers (``+k`` forward, ``-k`` backward of chunk ``k-1``)."""
    return [s.code for s in schedule_steps(num_microbatches, pp_size, pp_rank, vp_size, group_size)]


def forward_only_steps(
    num_microbatches: int, vp_size: int = 1, group_size: int | None = None
) -> list[ScheduleStep]:
    """Forward steps for validation/prediction, the same on every rank.

    Nothing is kept for a backward, so there is no memory bound to respect and no
    divisibility rule: chunks are visited in groups of ``group_size`` microbatches
    (default: all of them, i.e. chunk 0 for every microbatch, then chunk 1, ...); a last
    group may be short.
    """
    check_positive_int("num_microbatches", num_microbatches)
    check_positive_int("vp_size", vp_size)
    group = num_microbatches if group_size is None else check_positive_int("group_size", group_size)
    steps = []
    for first in range(0, num_microbatches, group):
        members = range(first, min(first + group, num_microbatches))
        steps.extend(ScheduleStep(True, c, m) for c in range(vp_size) for m in members)
    return steps


def forward_only_order(num_microbatches: int, vp_size: int = 1, group_size: int | None = None) -> list[int]:
    """:func:`forward_only_steps` as signed chunk numbers (all positive)."""
    return [s.code for s in forward_only_steps(num_microbatches, vp_size, group_size)]
