"""Pipeline parallelism as a component: cut this rank's stage and keep tied copies equal.

The schedule itself is run by :class:`~megastrategy.pipeline.step_runner.StepRunner`, the one
step path for every layout; this component only decides what the stage holds.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from megastrategy.anatomy import ModelAnatomy
from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.schedules import validate_schedule
from megastrategy.pipeline.stage import cut_stage


class Pipeline(Component):
    """Splits the layer stack over ``pp`` ranks (``vp`` chunks each) for ``pp > 1``."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.pp > 1
        self.pp, self.vp = config.pp, config.vp_size
        self.num_microbatches, self.pipeline_layers = config.num_microbatches, config.pipeline_layers
        self._tied: list[nn.Parameter] = []
        self._embedding_group = None

    def validate(self, module: nn.Module, layout) -> None:
        """Pipeline errors (stack, layer counts, schedule) before any collective."""
        if getattr(module, "automatic_optimization", True) is False:
            raise MegatronConfigError(
                f"automatic_optimization=False with pp={self.pp}: the pipeline schedule runs every microbatch's "
                "backward itself, interleaved with the other stages, so manual_backward cannot be honoured. "
                "Use automatic optimization with pp > 1, or pp=1 for manual optimization."
            )
        anatomy = ModelAnatomy.of(module, self.pipeline_layers)
        assign_layers(len(anatomy.stack), self.pp, self.vp)
        if self.vp > 1:
            validate_schedule(self.num_microbatches, self.pp, self.vp)

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        self.validate(module, None)
        ps = ctx.parallel_state
        anatomy = ModelAnatomy.of(module, ctx.stack_path)  # after TP/SP/recompute rewrote the blocks
        ctx.stage = cut_stage(
            module,
            stack_path=anatomy.stack_path,
            stack=anatomy.stack,
            assignment=assign_layers(len(anatomy.stack), self.pp, self.vp),
            pp_rank=ps.pp_rank,
            pp_size=self.pp,
            vp_size=self.vp,
            anatomy=anatomy,
        )
        self._tied, self._embedding_group = ctx.stage.tied_parameters, ps.embedding_group

    def finalize_grads(self) -> bool:
        """Keep the first and last stages' copies of a tied embedding identical: sum their gradients."""
        if self._tied and self._embedding_group is not None:
            for p in self._tied:
                dist.all_reduce(p.main_grad, group=self._embedding_group)
        return True
