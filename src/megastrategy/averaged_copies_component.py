"""The component that keeps weight-averaging copies (SWA, EMA) in step with the split model.

Its hooks place :mod:`megastrategy.averaged_copies` in the setup order: refuse a copy that cannot
be split (``validate``), take the user's unsharded ``AveragedModel`` copies out before any
component rewrites the model (``configure``), copy their sources again once every sharding
component has run (``apply``: this component comes after them in the list), and point
Lightning's ``StochasticWeightAveraging`` at a copy of the split model before the gradient buffer
attaches to the parameters (``on_fit_setup``: it comes before :class:`GradientBuffers`).
"""
from __future__ import annotations

from torch import nn

from megastrategy.averaged_copies import (
    copy_sharded_for_swa,
    hold_averaged_copies,
    refuse_unsharded_averaged_models,
    remake_averaged_copies,
)
from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig

__all__ = ["AveragedCopies"]


class AveragedCopies(Component):
    def __init__(self, config: MegatronConfig) -> None:
        self.config = config
        self._splits = config.tp > 1 or config.pp > 1
        self._held: list = []

    def validate(self, module: nn.Module, layout) -> None:
        refuse_unsharded_averaged_models(module, self.config.tp, self.config.pp)

    def configure(self, ctx: SetupContext) -> None:
        unsplit = not getattr(ctx.module, "_megastrategy_sharded", False)
        self._held = hold_averaged_copies(ctx.module) if self._splits and unsplit else []

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        from megastrategy.checkpoint.layout import module_layout

        ps = ctx.parallel_state
        remake_averaged_copies(module, self._held, lambda m: module_layout(m, ps.tp_rank, ps.tp_size, ctx.plan))
        self._held = []

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            copy_sharded_for_swa(trainer, module)
