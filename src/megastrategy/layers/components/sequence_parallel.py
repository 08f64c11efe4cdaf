"""Sequence parallelism as a component: split norm/dropout regions along the sequence over TP."""
from __future__ import annotations

from typing import Optional

from torch import nn

from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.layers.sequence_parallel import (
    allreduce_sequence_parallel_grads,
    check_sequence_parallel_support,
    enable_sequence_parallel,
    sequence_parallel_grad_params,
)


class SequenceParallel(Component):
    """Turns on sequence parallelism after the TP plan is applied; sums the gradients of
    replicated parameters inside sequence-split regions over TP before the DP reduction."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.sequence_parallel
        self.pipeline_layers = config.pipeline_layers
        self._params: list[nn.Parameter] = []
        self._tp_group = None

    def validate(self, module: nn.Module, layout) -> None:
        check_sequence_parallel_support(module, self.pipeline_layers)

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        self._tp_group = ctx.parallel_state.tp_group
        enable_sequence_parallel(
            module, ctx.plan, tp_group=self._tp_group, pipeline_layers=ctx.stack_path, rng_tracker=ctx.rng_tracker
        )

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        self._params = sequence_parallel_grad_params(module)
        ctx.grads_changed_after_backward.extend(self._params)  # summed over TP after backward: not reduced early

    def finalize_grads(self) -> bool:
        if self._params:  # replicated params in sequence-split regions: sum over TP
            allreduce_sequence_parallel_grads(self._params, self._tp_group)
        return True
