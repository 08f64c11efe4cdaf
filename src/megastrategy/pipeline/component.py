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
from megastrategy.pipeline.ancestor_parameters import ancestor_parameters
from megastrategy.pipeline.batch_statistics import refuse_batch_statistics
from megastrategy.pipeline.embedding_options import refuse_embedding_options
from megastrategy.pipeline.direct_forward import direct_forward_calls_routed, route_direct_forward_calls
from megastrategy.pipeline.forward_order import ForwardOrder, loop_state_refusal, record_forward_order
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.parallel_lists import refuse_parallel_lists
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.router_logits import carry_for, refuse_router_logits
from megastrategy.pipeline.schedule_choice import schedule_placement
from megastrategy.pipeline.schedules import validate_schedule
from megastrategy.pipeline.stand_in_probe import refuse_stand_in_values
from megastrategy.pipeline.zero_bubble_v import check_zb_v
from megastrategy.pipeline.generation_guard import refuse_generation
from megastrategy.pipeline.stage import cut_stage
from megastrategy.pipeline.seq2seq_checks import Seq2SeqTied, refuse_seq2seq_layout, refuse_seq2seq_loop_state
from megastrategy.pipeline.seq2seq_layout import Seq2SeqLayout, is_encoder_decoder, seq2seq_layout
from megastrategy.pipeline.seq2seq_stage import cut_seq2seq_stage
from megastrategy.pipeline.stateful_reparametrization import refuse_stateful_reparametrization


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
        self._seq2seq_orders: Optional[tuple] = None  # an encoder-decoder's two dry runs (they hold no module)
        self._seq2seq_of: Optional[int] = None
        self._seq2seq_tied: Optional[Seq2SeqTied] = None  # held on ranks beyond the first and last

    def validate(self, module: nn.Module, layout) -> None:
        """Pipeline errors (stack, layer counts, schedule) before any collective."""
        if getattr(module, "automatic_optimization", True) is False:
            raise MegatronConfigError(
                f"automatic_optimization=False with pp={self.pp}: the pipeline schedule runs every microbatch's "
                "backward itself, interleaved with the other stages, so manual_backward cannot be honoured. "
                "Use automatic optimization with pp > 1, or pp=1 for manual optimization."
            )
        hf = find_hf_model(module)[1]
        _refuse_what_stages_cannot_split(hf, self.pp)
        refuse_router_logits(hf, self.pp, self.num_microbatches, is_encoder_decoder(module))
        refuse_batch_statistics(module, self.pp, self.num_microbatches)
        refuse_embedding_options(module, self.pp, self.num_microbatches)
        refuse_stateful_reparametrization(module, self.pp)
        if is_encoder_decoder(module):
            self._validate_seq2seq(module)
            return
        anatomy = ModelAnatomy.of(module, self.pipeline_layers)
        if self.pipeline_layers is None:  # a list the user named is taken as it is
            refuse_parallel_lists(module, anatomy.stack_path, self.pp)
        with direct_forward_calls_routed(anatomy.stack):  # the dry runs find the cut through hooks
            self._dry_runs(module, anatomy)
        self._validate_schedule()

    def _dry_runs(self, module: nn.Module, anatomy: ModelAnatomy) -> None:
        """The forward's order and the stand-in probe, on the module as built (each once)."""
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

    def _validate_schedule(self) -> None:
        if self.schedule == "zb_v":
            check_zb_v(self.num_microbatches, self.pp)
        elif self.vp > 1:
            validate_schedule(self.num_microbatches, self.pp, self.vp)

    def _validate_seq2seq(self, module: nn.Module) -> tuple[Seq2SeqLayout, list[list[list[int]]]]:
        """An encoder-decoder: its two stacks joined (:mod:`.seq2seq_layout`), split like one. The
        layout is found again each time (after tensor parallelism rewrote modules, apply needs them as
        they are; it holds every module, so it is not kept), the dry runs once, on the module as built."""
        if self._seq2seq_of != id(module):
            self._seq2seq_orders, self._seq2seq_of = None, id(module)
        layout = seq2seq_layout(module, self._seq2seq_orders)
        self._seq2seq_orders = layout.orders
        refuse_seq2seq_layout(layout, self.pipeline_layers)
        assignment = assign_layers(layout.num_blocks, self.pp, self.vp, self.placement, self.stage_layers)
        refuse_seq2seq_loop_state(layout, assignment, self.pp)
        self._validate_schedule()
        return layout, assignment

    def _apply_seq2seq(self, module: nn.Module, ctx: SetupContext) -> None:
        ps = ctx.parallel_state
        layout, assignment = self._validate_seq2seq(module)
        self._seq2seq_tied = Seq2SeqTied.build(layout, assignment, self.placement or
                                               StagePlacement.build("ring", self.pp, self.vp), ps.pp_rank)
        ctx.stage = cut_seq2seq_stage(module, layout, assignment, ps.pp_rank, self.pp, self.vp, self.placement)
        self._tied, self._shared = list(ctx.stage.tied_parameters), []
        self._embedding_group, self._pp_group = ps.embedding_group, ps.pp_group
        refuse_generation(module, self.pp)

    def _forward_order(self, module: nn.Module, stack_path: str) -> Optional[ForwardOrder]:
        """The dry run's result, found once, on the module as the user built it (before any sharding)."""
        if self._order_of != id(module):
            self._order, self._order_of = record_forward_order(module, stack_path), id(module)
        return self._order

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        if is_encoder_decoder(module):
            return self._apply_seq2seq(module, ctx)
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
            router_logits=carry_for(find_hf_model(module)[1], self.pp, self.num_microbatches),
        )
        route_direct_forward_calls(anatomy.stack)  # last, over recompute's forward (see the function)
        self._shared = _with_ancestor_parameters(ctx.stage.shared_layer_parameters, module, anatomy.stack_path)
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
        if self._seq2seq_tied is not None and self._seq2seq_tied.beyond_ends:
            self._seq2seq_tied.all_reduce(self._pp_group)
        elif self._tied and self._embedding_group is not None:
            for p in filter(_trains, self._tied):
                dist.all_reduce(p.main_grad, group=self._embedding_group)
        for p in filter(_trains, self._shared):
            dist.all_reduce(p.main_grad, group=self._pp_group)
        return True


def _with_ancestor_parameters(shared: list, module: nn.Module, stack_path: str) -> list:
    """``shared`` and the parameters of the stack's ancestors (:mod:`.ancestor_parameters`), each once."""
    seen = {id(p) for p in shared}
    return list(shared) + [p for p in ancestor_parameters(module, stack_path) if id(p) not in seen]


def _trains(p: nn.Parameter) -> bool:
    return p.requires_grad


def _refuse_what_stages_cannot_split(hf: Optional[nn.Module], pp: int) -> None:
    """Hugging Face models whose forward needs more than one stage's blocks in one place."""
    config = getattr(hf, "config", None)
    drops = {k: v for k, v in (config.to_dict() if config is not None else {}).items()
             if k.endswith("layerdrop") and isinstance(v, (int, float)) and v > 0}
    if drops:
        name, value = next(iter(drops.items()))
        raise MegatronConfigError(
            f"pp={pp} with {type(hf).__name__} and config.{name}={value}: layer drop skips blocks at random in "
            "training, and a pipeline stage whose first or last block is skipped would take no input from the "
            f"previous stage or send none to the next. Set config.{name}=0.0 "
            f"({', '.join(sorted(drops))} are set), or use pp=1."
        )
