"""Timing model of pipeline schedules: bubble, makespan, memory, and a timeline picture.

The model is the one the bubble formulas assume: each rank runs its order one step at a
time; a forward of virtual stage ``s`` waits for the forward of stage ``s - 1`` on the same
microbatch, a backward waits for its own forward and for the backward of stage ``s + 1``;
a hop between ranks costs ``p2p_time``; sends never block. A split backward (zero-bubble
schedules) is an input-gradient step B, which is what the previous stage waits for, and a
weight-gradient step W, which waits only for its own B. Unless given, B and W each cost half
of ``backward_time``, so "F = B = W = 1" is the default ``forward_time=1, backward_time=2``
and compares a split schedule with 1F1B on the same model. It lets the schedule be checked
for deadlocks and for its bubble before any process group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.layer_assignment import check_positive_int
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.schedule_choice import schedule_placement, schedule_vp_size, training_steps
from megastrategy.pipeline.schedules import ScheduleStep, StepPart, forward_only_steps, validate_schedule

__all__ = [
    "PipelineDeadlockError",
    "ScheduleStats",
    "StepTiming",
    "draw_timeline",
    "simulate_schedule",
    "simulate_steps",
]


class PipelineDeadlockError(RuntimeError):
    """The per-rank orders wait on each other (or on a step no rank runs)."""


@dataclass(frozen=True)
class StepTiming:
    rank: int
    index: int  # position in the rank's order
    is_forward: bool
    chunk: int
    microbatch: int
    start: float
    end: float
    part: StepPart = StepPart.WHOLE

    @property
    def kind(self) -> str:
        return ScheduleStep(self.is_forward, self.chunk, self.microbatch, self.part).kind


@dataclass
class ScheduleStats:
    """Result of a simulation; times are in the units of ``forward_time``/``backward_time``.

    ``idle`` per rank is the bubble time; ``bubble_fraction`` is its share of the makespan.
    """

    num_microbatches: int
    pp_size: int
    vp_size: int
    group_size: int | None
    makespan: float
    busy: list[float]  # per rank
    idle: list[float]  # per rank: makespan - busy
    bubble_fraction: float  # sum(idle) / (pp_size * makespan)
    peak_in_flight: list[int]  # per rank: most (chunk, microbatch) forwards awaiting their backward
    timeline: list[list[StepTiming]] = field(repr=False)  # per rank, in execution order

    @property
    def total_idle(self) -> float:
        return sum(self.idle)


def simulate_steps(
    steps_per_rank: Sequence[Sequence[ScheduleStep | tuple]],
    vp_size: int = 1,
    *,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    p2p_time: float = 0.0,
    num_microbatches: int | None = None,
    group_size: int | None = None,
    input_grad_time: float | None = None,
    weight_grad_time: float | None = None,
    step_time: Callable[[int, ScheduleStep], float] | None = None,
    placement: StagePlacement | None = None,
) -> ScheduleStats:
    """Simulate arbitrary per-rank orders (one list of ``(is_forward, chunk, microbatch[, part])`` per rank).

    ``input_grad_time``/``weight_grad_time``: the cost of a split backward's B and W (default:
    half of ``backward_time`` each; W defaults to what B leaves of ``backward_time``).
    ``step_time(rank, step)``: the cost of each step instead (e.g. measured per rank and kind:
    the first stage's B has no input gradient to compute, the last stage's F includes the loss).
    ``placement``: which stage each (rank, chunk) runs (default: the ring of 1F1B).

    A step's start time depends only on when its dependencies and its rank's previous step
    finished, so ranks are advanced in any order until all are done or none can move
    (a deadlock, reported with what each stuck rank is waiting for).
    """
    pp_size = len(steps_per_rank)
    check_positive_int("pp_size", pp_size)
    check_positive_int("vp_size", vp_size)
    if input_grad_time is None:
        input_grad_time = backward_time / 2
    if weight_grad_time is None:
        weight_grad_time = max(backward_time - input_grad_time, 0.0)
    durations = {"F": forward_time, StepPart.WHOLE: backward_time, StepPart.INPUT: input_grad_time,
                 StepPart.WEIGHT: weight_grad_time}
    for name, value in (("forward_time", forward_time), ("backward_time", backward_time), ("p2p_time", p2p_time),
                        ("input_grad_time", input_grad_time), ("weight_grad_time", weight_grad_time)):
        if value < 0:
            raise MegatronConfigError(f"{name}={value} must be >= 0.")
    orders = _parse_orders(steps_per_rank, vp_size)
    placement = placement or StagePlacement.build("ring", pp_size, vp_size)
    if (placement.pp_size, placement.vp_size) != (pp_size, vp_size):
        raise MegatronConfigError(
            f"placement {placement.name!r} is for pp_size={placement.pp_size}, vp_size={placement.vp_size}; the "
            f"orders are for pp_size={pp_size}, vp_size={vp_size}. Build the placement for the same layout."
        )
    sim = _Simulation(orders, placement, step_time or (lambda rank, step: durations["F" if step.is_forward else step.part]),
                      p2p_time)
    sim.run()

    makespan = max(sim.free_at) if pp_size else 0.0
    busy = [sum(t.end - t.start for t in row) for row in sim.timeline]
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (pp_size * makespan) if makespan > 0 else 0.0
    peaks = [_peak_in_flight(order) for order in orders]
    if num_microbatches is None:
        num_microbatches = len({s.microbatch for o in orders for s in o})
    return ScheduleStats(
        num_microbatches, pp_size, vp_size, group_size, makespan, busy, idle, bubble, peaks, sim.timeline
    )


def _parse_orders(steps_per_rank: Sequence[Sequence[ScheduleStep | tuple]], vp_size: int) -> list[list[ScheduleStep]]:
    """Steps as :class:`ScheduleStep`; a chunk out of range or a step run twice is an error."""
    orders = [[ScheduleStep(*s) for s in steps] for steps in steps_per_rank]
    for rank, order in enumerate(orders):
        seen = set()
        for step in order:
            if not 0 <= step.chunk < vp_size:
                raise MegatronConfigError(f"rank {rank} has step {step} with chunk outside [0, {vp_size}).")
            if step in seen:
                raise MegatronConfigError(f"rank {rank} runs step {step} twice.")
            seen.add(step)
    return orders


def _peak_in_flight(order: Sequence[ScheduleStep]) -> int:
    """Most microbatches whose forward ran and whose backward (its W, when split) did not yet."""
    live = peak = 0
    for step in order:
        live += 1 if step.is_forward else (0 if step.part is StepPart.INPUT else -1)
        peak = max(peak, live)
    return peak


#: a finished step: (kind "F"/"B"/"W", stage, microbatch); a whole backward finishes "B"
_Key = tuple[str, int, int]


class _Simulation:
    """Event-free simulation state: when each finished step ended and where each rank is."""

    def __init__(self, orders: list[list[ScheduleStep]], placement: StagePlacement, step_time: Callable,
                 p2p_time: float) -> None:
        self.orders, self.placement = orders, placement
        self.pp_size = len(orders)
        self.num_stages = placement.num_stages
        self.step_time, self.p2p_time = step_time, p2p_time
        self.done: dict[_Key, float] = {}  # -> end time
        self.position = [0] * self.pp_size
        self.free_at = [0.0] * self.pp_size
        self.timeline: list[list[StepTiming]] = [[] for _ in range(self.pp_size)]

    def dependencies(self, rank: int, step: ScheduleStep) -> list[tuple[_Key, bool]]:
        """(key, crosses_ranks) pairs the step waits for."""
        where = self.placement.rank_of
        s, mb = self.placement.stage(rank, step.chunk), step.microbatch
        if step.is_forward:
            if s == 0:
                return []
            return [(("F", s - 1, mb), where(s - 1) != rank)]
        if step.part is StepPart.WEIGHT:
            return [(("B", s, mb), False)]
        deps = [(("F", s, mb), False)]
        if s < self.num_stages - 1:
            deps.append((("B", s + 1, mb), where(s + 1) != rank))
        return deps

    def run(self) -> None:
        remaining = sum(len(o) for o in self.orders)
        while remaining:
            progressed = sum(self._advance(rank) for rank in range(self.pp_size))
            if not progressed:
                raise self._deadlock()
            remaining -= progressed

    def _advance(self, rank: int) -> int:
        """Run ``rank``'s next steps while their dependencies are done; how many ran."""
        order, ran = self.orders[rank], 0
        while self.position[rank] < len(order):
            step = order[self.position[rank]]
            deps = self.dependencies(rank, step)
            if any(key not in self.done for key, _ in deps):
                break
            arrivals = [self.done[key] + (self.p2p_time if cross else 0.0) for key, cross in deps]
            start = max([self.free_at[rank]] + arrivals)
            end = start + self.step_time(rank, step)
            self.done[(step.kind, self.placement.stage(rank, step.chunk), step.microbatch)] = end
            self.timeline[rank].append(
                StepTiming(rank, self.position[rank], step.is_forward, step.chunk, step.microbatch, start, end, step.part)
            )
            self.free_at[rank] = end
            self.position[rank] += 1
            ran += 1
        return ran

    def _deadlock(self) -> PipelineDeadlockError:
        stuck = []
        for rank, order in enumerate(self.orders):
            if self.position[rank] < len(order):
                step = order[self.position[rank]]
                waits = [k for k, _ in self.dependencies(rank, step) if k not in self.done]
                names = {"F": "forward", "B": "backward", "W": "weight gradient"}
                desc = ", ".join(
                    "{} of stage {} (rank {}, chunk {}) mb {}".format(names[k], s, *self.placement.location(s), m)
                    for k, s, m in waits
                )
                stuck.append(f"rank {rank} step {self.position[rank]} {step} waits for {desc}")
        return PipelineDeadlockError("pipeline schedule deadlocks: " + "; ".join(stuck))


def simulate_schedule(
    num_microbatches: int,
    pp_size: int,
    vp_size: int = 1,
    group_size: int | None = None,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    p2p_time: float = 0.0,
    *,
    forward_only: bool = False,
    schedule: str = "1f1b",
    input_grad_time: float | None = None,
    weight_grad_time: float | None = None,
) -> ScheduleStats:
    """Simulate the training schedule ``schedule`` (see :mod:`.schedule_choice`) on every rank,
    or the forward-only one (on the schedule's placement: ZB-V's V evaluates through the V too).

    ``forward_time``/``backward_time`` are per step, i.e. per model chunk: to compare with a
    non-interleaved run of the same model, divide the stage times by ``vp_size``.
    """
    check_positive_int("pp_size", pp_size)
    vp_size = schedule_vp_size(schedule, vp_size)
    placement = schedule_placement(schedule, pp_size, vp_size)
    if forward_only:
        steps = forward_only_steps(num_microbatches, vp_size, group_size)
        orders = [steps] * pp_size
        group = group_size
    else:
        group = None if schedule == "zb_v" else validate_schedule(num_microbatches, pp_size, vp_size, group_size)
        orders = [training_steps(schedule, num_microbatches, pp_size, r, vp_size, group_size) for r in range(pp_size)]
    return simulate_steps(
        orders,
        vp_size,
        forward_time=forward_time,
        backward_time=backward_time,
        p2p_time=p2p_time,
        num_microbatches=num_microbatches,
        group_size=group,
        input_grad_time=input_grad_time,
        weight_grad_time=weight_grad_time,
        placement=placement,
    )


_FORWARD_COLORS = ["#4C72B0", "#8FB4E3", "#2A4D7A", "#B9D3F0"]
_BACKWARD_COLORS = ["#DD8452", "#F2B48C", "#A0522D", "#F8D3B8"]
_WEIGHT_COLORS = ["#55A868", "#9BD3A6", "#2E6B3D", "#C8E9CF"]


def draw_timeline(stats: ScheduleStats, path: str | os.PathLike, title: str | None = None) -> None:
    """Write a PNG: one row per rank, a box per step labelled with its microbatch, idle left blank.

    Uses a bare Agg figure so that drawing never touches the caller's pyplot state or backend.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    width = max(6.0, min(24.0, 0.35 * stats.makespan + 2.0))
    fig = Figure(figsize=(width, 0.6 * stats.pp_size + 1.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for rank, row in enumerate(stats.timeline):
        y = stats.pp_size - 1 - rank  # rank 0 on top
        for t in row:
            palette = {"F": _FORWARD_COLORS, "B": _BACKWARD_COLORS, "W": _WEIGHT_COLORS}[t.kind]
            color = palette[t.chunk % len(palette)]
            ax.broken_barh(
                [(t.start, t.end - t.start)], (y - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.6
            )
            text_color = "white" if t.chunk % 2 == 0 else "black"
            mid = (t.start + t.end) / 2
            ax.text(mid, y, str(t.microbatch), ha="center", va="center", fontsize=8, color=text_color)
    ax.set_yticks(range(stats.pp_size))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(stats.pp_size))])
    ax.set_xlim(0, stats.makespan)
    ax.set_ylim(-0.6, stats.pp_size - 0.4)
    ax.set_xlabel("time")
    handles = []
    for c in range(stats.vp_size):
        suffix = f" chunk {c}" if stats.vp_size > 1 else ""
        handles.append(Patch(facecolor=_FORWARD_COLORS[c % 4], edgecolor="black", label=f"forward{suffix}"))
    for c in range(stats.vp_size):
        suffix = f" chunk {c}" if stats.vp_size > 1 else ""
        handles.append(Patch(facecolor=_BACKWARD_COLORS[c % 4], edgecolor="black", label=f"backward{suffix}"))
    if any(t.kind == "W" for row in stats.timeline for t in row):
        handles.append(Patch(facecolor=_WEIGHT_COLORS[0], edgecolor="black", label="weight gradient (W)"))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=len(handles), fontsize=8, frameon=False
    )
    if title is None:
        title = f"pp={stats.pp_size}, vp={stats.vp_size}, m={stats.num_microbatches}"
    ax.set_title(f"{title}  (bubble {stats.bubble_fraction:.1%}, boxes = microbatch id)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=130)
