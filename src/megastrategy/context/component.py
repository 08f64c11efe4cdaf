"""Context parallelism as a component of the strategy (``MegatronStrategy(cp=N)``).

Training microbatches are split along the sequence over the cp ranks and run inside
:meth:`ContextParallel.forward_context`; the gradient buffers then average over dp×cp
(``SetupContext.grad_reduce_group``), which gives the one-device gradient. Evaluation
(validation, test, predict) runs unsplit: every cp rank computes the whole sequence, so
outputs, logs and metrics are exactly those of one device. A checkpointed block (any activation
recompute) replays in backward inside the split it was recorded in (recompute.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Optional

from torch import nn

from megastrategy.component import Component, SetupContext, StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.context.context_parallel import ContextParallel

__all__ = ["ContextParallelComponent"]


class ContextParallelComponent(Component):
    """Checks the model before any group, installs the cp hooks for fitting, splits each training
    microbatch and wraps its forward and loss."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.cp > 1
        self.config = config
        self.context: Optional[ContextParallel] = None
        self._split: Optional[Any] = None  # the microbatch prepare_microbatch split last

    def validate(self, module: nn.Module, layout: Any) -> None:
        c = self.config
        ContextParallel.validate(module, c.cp, c.cp_layout, c.cp_output)

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        self.teardown()
        c = self.config
        self.context = ContextParallel(ctx.parallel_state.cp_group, layout=c.cp_layout, output=c.cp_output)
        self.context.apply(module)

    def prepare_microbatch(self, microbatch: Any, step: StepInfo) -> Any:
        if self.context is None or not step.training:
            self._split = None
            return microbatch  # evaluation: the whole sequence on every cp rank
        self._split = self.context.transform_microbatch(microbatch, training=True)
        return self._split

    def forward_context(self, microbatch: Any) -> ContextManager:
        if self.context is None or self._split is None or microbatch is not self._split:
            return nullcontext()
        return self.context.forward_context(microbatch)

    def teardown(self) -> None:
        if self.context is not None:
            self.context.teardown()
        self.context, self._split = None, None
