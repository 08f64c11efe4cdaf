"""One object for the strategy: find, install, record, capture, and follow the schedule.

Lifecycle (all ranks alike)::

    graphs = CudaGraphManager(stage_stack, scope, stack_path=stage.stack_path, chunks=stage.chunks,
                              pp_size=pp, pp_rank=pp_rank, vp_size=vp, group_size=group_size)
    # every training step:
    graphs.begin_step(num_microbatches)
    executor.run(steps, ..., on_forward=graphs.on_forward, on_backward=graphs.on_backward)
    graphs.end_step()          # after the last backward; captures once warmup_steps steps are recorded

Without a pipeline executor (pp=1, Lightning's own loop) the strategy announces the single
microbatch itself: ``begin_step(1)``, ``on_forward(0, 0)`` before ``training_step``,
``on_backward(0, 0)`` after the backward, ``end_step()``. Evaluation needs no calls: the
runners run eagerly outside training mode.

The first ``warmup_steps`` training steps run eagerly and record what each target is called
with (Megatron's ``cuda_graph_warmup_steps`` plays the same role: lazy initialisation, NCCL
communicators and allocator state settle before capture); the capture follows at the end of
the last of them.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Literal, Optional, Sequence

from torch import nn

from megastrategy.cuda_graphs.capture import CaptureReport, GraphFn, capture_graphs
from megastrategy.cuda_graphs.grad_guard import StaticGradGuard
from megastrategy.cuda_graphs.runner import SMALL_OUTPUT_NUMEL, GraphRunner, install_runners, uninstall_runners
from megastrategy.cuda_graphs.scope import GraphTargets, find_graph_targets, validate_cuda_graph_scope
from megastrategy.cuda_graphs.slots import SlotPlan, SlotTracker, plan_for_schedule
from megastrategy.errors import MegatronConfigError

__all__ = ["CudaGraphManager"]


class CudaGraphManager:
    """Partial CUDA graphs for the blocks of one stage; see the module doc."""

    def __init__(
        self,
        stack: nn.Module,
        scope: Any,
        *,
        stack_path: str = "",
        chunks: Optional[Sequence[Sequence[int]]] = None,
        pp_size: int = 1,
        pp_rank: int = 0,
        vp_size: int = 1,
        group_size: Optional[int] = None,
        attention_modules: Optional[Sequence[str]] = None,
        graph_fn: Optional[GraphFn] = None,
        warmup_steps: int = 1,
        num_warmup_iters: int = 3,
        on_error: Literal["raise", "eager"] = "raise",
        small_output_numel: int = SMALL_OUTPUT_NUMEL,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise MegatronConfigError(
                f"cuda_graph_warmup_steps={warmup_steps!r} must be an int >= 1: the targets are recorded during "
                f"eager training steps before they are captured. Use 1 (default) or more."
            )
        self.scope = validate_cuda_graph_scope(scope)
        self.pp_size, self.pp_rank, self.vp_size, self.group_size = pp_size, pp_rank, vp_size, group_size
        self.graph_fn, self.num_warmup_iters, self.on_error = graph_fn, num_warmup_iters, on_error
        self.warmup_steps = warmup_steps
        self.found: GraphTargets = find_graph_targets(
            stack, self.scope, stack_path=stack_path, chunks=chunks, attention_modules=attention_modules
        )
        self.tracker = SlotTracker()
        self.runners: list[GraphRunner] = install_runners(
            self.found.targets, self.tracker, small_output_numel=small_output_numel
        )
        self.training_steps = 0
        self.plan: Optional[SlotPlan] = None
        self.report: Optional[CaptureReport] = None
        self.grad_guard = StaticGradGuard()
        self._training_step = False

    # -- per step ------------------------------------------------------------------------
    def begin_step(self, num_microbatches: int, *, training: bool = True) -> SlotPlan:
        """Start a step of ``num_microbatches``; returns its slot plan."""
        plan = plan_for_schedule(
            num_microbatches, self.pp_size, self.pp_rank, self.vp_size, self.group_size, forward_only=not training
        )
        if training:
            self.plan = plan
        self._training_step = training
        self.tracker.begin(plan)
        return plan

    def on_forward(self, chunk: int, microbatch: int) -> None:
        self.tracker.on_forward(chunk, microbatch)

    def on_backward(self, chunk: int, microbatch: int) -> None:
        self.tracker.on_backward(chunk, microbatch)

    def end_step(self) -> Optional[CaptureReport]:
        """Close the step; after the ``warmup_steps``-th training step, capture (returns the report)."""
        left = self.tracker.end()
        if not self._training_step:
            return None
        if left:
            raise RuntimeError(
                f"cuda graphs: slots still held after a training step: {left} (chunk, slot, microbatch); "
                f"every forward announced with on_forward needs its on_backward."
            )
        self.training_steps += 1
        if self.report is None and self.training_steps >= self.warmup_steps:
            return self.capture()
        return None

    def capture(self) -> CaptureReport:
        if self.plan is None:
            raise RuntimeError("cuda graphs: capture needs a training step first (begin_step/end_step).")
        self.report = capture_graphs(
            self.runners, self.plan, graph_fn=self.graph_fn, num_warmup_iters=self.num_warmup_iters,
            on_error=self.on_error,
        )
        self.grad_guard.cover(r.target.module for r in self.runners if r.graphs and r.target.module is not None)
        return self.report

    # -- inspection / teardown -------------------------------------------------------------
    def counts(self) -> Counter:
        """How often the targets replayed (``"replay"``) or ran eagerly, by reason."""
        total: Counter = Counter()
        for r in self.runners:
            total.update(r.counts)
        return total

    def uninstall(self) -> None:
        """Restore every original callable (the graphs are dropped)."""
        uninstall_runners(self.runners)
        self.grad_guard.remove()
        self.runners = []
