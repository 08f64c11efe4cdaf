"""Pipeline parallelism as a component: cut this rank's stage and keep tied copies equal.

The schedule itself is run by :class:`~megastrategy.pipeline.step_runner.StepRunner`, the one
step path for every layout; this component only decides what the stage holds.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from megastrategy.anatomy import ModelAnatomy, find_hf_model
from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.batch_statistics import refuse_batch_statistics
from megastrategy.pipeline.forward_order import ForwardOrder, loop_state_refusal, record_forward_order
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.parallel_lists import refuse_parallel_lists
from megastrategy.pipeline.schedule_choice import schedule_placement
from megastrategy.pipeline.schedules import validate_schedule
from megastrategy.pipeline.stand_in_probe import refuse_stand_in_values
from megastrategy.pipeline.zero_bubble_v import check_zb_v
from megastrategy.pipeline.generation_guard import refuse_generation
from megastrategy.pipeline.stage import cut_stage


class Pipeline(Component):
    """Splits the layer stack over ``pp`` ranks (``vp`` chunks each) for ``pp > 1``."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.pp > 1
        self.pp, self.vp = config.pp, config.vp_size
        self.num_microbatches, self.pipeline_layers = config.num_microbatches, config.pipeline_layers
        self.stage_layers = config.pipeline_stage_layers
        self.schedule = config.pipeline_schedule
        self.placement = schedule_placement(self.schedule, self.pp, self.vp) if self.enabled else None
        self._tied: list[nn.Parameter] = []
        self._shared: list[nn.Parameter] = []
        self._embedding_group = self._pp_group = None
        self._order: Optional[ForwardOrder] = None
        self._order_of: Optional[int] = None  # id of the module the dry run ran on
        self._probed_of: Optional[int] = None  # id of the module the stand-in probe passed

    def validate(self, module: nn.Module, layout) -> None:
        """Pipeline errors (stack, layer counts, schedule) before any collective."""
        if getattr(module, "automatic_optimization", True) is False:
            raise MegatronConfigError(
                f"automatic_optimization=False with pp={self.pp}: the pipeline schedule runs every microbatch's "
                "backward itself, interleaved with the other stages, so manual_backward cannot be honoured. "
                "Use automatic optimization with pp > 1, or pp=1 for manual optimization."
            )
        _refuse_what_stages_cannot_split(find_hf_model(module)[1], self.pp)
        refuse_batch_statistics(module, self.pp, self.num_microbatches)
        anatomy = ModelAnatomy.of(module, self.pipeline_layers)
        if self.pipeline_layers is None:  # a list the user named is taken as it is
            refuse_parallel_lists(module, anatomy.stack_path, self.pp)
        order = self._forward_order(module, anatomy.stack_path)
        assignment = assign_layers(len(order.stack_calls) if order is not None else len(anatomy.stack), self.pp,
                                   self.vp, self.placement, self.stage_layers)
        refusal = loop_state_refusal(order, anatomy.stack_path, assignment)
        if refusal is not None:
            raise MegatronConfigError(f"pp={self.pp}: {refusal}")
        if self._probed_of != id(module):  # apply() validates again: the probe's meta run is done once
            placed = ModelAnatomy.of(module, anatomy.stack_path, order.called if order is not None else None)
            refuse_stand_in_values(module, placed, order, assignment, self.placement)
            self._probed_of = id(module)
        if self.schedule == "zb_v":
            check_zb_v(self.num_microbatches, self.pp)
        elif self.vp > 1:
            validate_schedule(self.num_microbatches, self.pp, self.vp)

    def _forward_order(self, module: nn.Module, stack_path: str) -> Optional[ForwardOrder]:
        """The dry run's result, found once, on the module as the user built it (before any sharding)."""
        if self._order_of != id(module):
            self._order, self._order_of = record_forward_order(module, stack_path), id(module)
        return self._order

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        self.validate(module, None)
        ps, order = ctx.parallel_state, self._order
        called = order.called if order is not None else None
        anatomy = ModelAnatomy.of(module, ctx.stack_path, called)  # after TP/SP/recompute rewrote the blocks
        stack_calls = order.stack_calls if order is not None and order.reuses_blocks else None
        ctx.stage = cut_stage(
            module,
            stack_path=anatomy.stack_path,
            stack=anatomy.stack,
            assignment=assign_layers(len(stack_calls or anatomy.stack), self.pp, self.vp, self.placement,
                                     self.stage_layers),
            pp_rank=ps.pp_rank,
            pp_size=self.pp,
            vp_size=self.vp,
            placement=self.placement,
            anatomy=anatomy,
            stack_calls=stack_calls,
            carried=order.carried if order is not None else (),
            block_arity=order.block_arity if order is not None else None,
        )
        self._shared = ctx.stage.shared_layer_parameters
        shared = {id(p) for p in self._shared}
        self._tied = [p for p in ctx.stage.tied_parameters if id(p) not in shared]
        self._embedding_group, self._pp_group = ps.embedding_group, ps.pp_group
        refuse_generation(module, self.pp)

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        # summed over stages after backward (finalize_grads): their buckets must not reduce early
        if ctx.stage is not None:
            ctx.grads_changed_after_backward.extend(list(ctx.stage.tied_parameters) + list(self._shared))

    def finalize_grads(self) -> bool:
        """Keep every stage's copy of a tied weight identical: sum the gradients of a tied embedding
        over the first and last stage, and of a block applied on several stages over the pipeline.
        A frozen one (a fine-tuning habit: ``wte.requires_grad_(False)``) has no gradient on any stage."""
        if self._tied and self._embedding_group is not None:
            for p in filter(_trains, self._tied):
                dist.all_reduce(p.main_grad, group=self._embedding_group)
        for p in filter(_trains, self._shared):
            dist.all_reduce(p.main_grad, group=self._pp_group)
        return True


def _trains(p: nn.Parameter) -> bool:
    return p.requires_grad


def _refuse_what_stages_cannot_split(hf: Optional[nn.Module], pp: int) -> None:
    """Hugging Face models whose forward needs more than one stage's blocks in one place."""
    config = getattr(hf, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise MegatronConfigError(
            f"pp={pp} with the encoder-decoder {type(hf).__name__}: pipeline stages cut "
            "one stack of blocks, and an encoder-decoder has two (the decoder's blocks also read the encoder's "
            "output). Use pp=1 with tp, cp and data parallelism for it."
        )
    if getattr(config, "output_router_logits", False):
        raise MegatronConfigError(
            f"pp={pp} with {type(hf).__name__} and output_router_logits=True: its load-balancing loss is computed "
            "after the stack from every layer's router logits, and under pp the last stage holds only its own "
            "layers. Set config.output_router_logits=False (training without that loss), or use pp=1."
        )
