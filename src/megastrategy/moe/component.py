"""Expert parallelism as a component: shard ``MoELayer``s, keep expert gradients in their own
buffer reduced over expert-data-parallel ranks, and scale and log the auxiliary losses."""
from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, Optional

import torch
from torch import nn

from megastrategy.component import Component, SetupContext, StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.ddp.grad_buffer import GradientBuffer
from megastrategy.moe import integration as moe


class ExpertParallel(Component):
    """Always in the list: whether any rank has MoE layers is agreed collectively in ``apply``."""

    def __init__(self, config: MegatronConfig) -> None:
        self.config = config
        self.num_moe_layers = 0
        self.buffer: Optional[GradientBuffer] = None
        self._ctx: Optional[SetupContext] = None

    def validate(self, module: nn.Module, layout) -> None:
        if layout is not None:
            moe.validate_moe(module, layout)

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        self.num_moe_layers = moe.shard_moe_layers(module, ctx.parallel_state)  # collective: every rank agrees
        ctx.num_moe_layers, self._ctx = self.num_moe_layers, ctx

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        self.teardown()
        self._ctx = ctx
        if not self.num_moe_layers:
            return
        c = self.config
        # ZeRO-1: reduce-scattered over expert-DP; the dense buffer's optimizer wrapper steps it too
        self.buffer = moe.make_expert_grad_buffer(
            module, ctx.parallel_state, grad_reduce_in_fp32=c.grad_reduce_in_fp32, bucket_numel=c.bucket_numel,
            overlap_grad_reduce=ctx.overlap_grad_reduce, distributed_optimizer=c.use_distributed_optimizer,
        )
        ctx.grad_buffers.append(self.buffer)

    # ------------------------------------------------------------------ steps
    def begin_step(self, module: nn.Module, step: StepInfo) -> None:
        if step.training and self.num_moe_layers:  # the injected aux-loss gradient is scaled like the main loss
            scale = moe.aux_loss_scale(step.accumulate_grad_batches, step.num_microbatches, step.grad_scale)
            moe.set_aux_loss_scale(module, scale)

    def end_step(self, module: nn.Module, step: StepInfo) -> None:
        if not (step.training and self.num_moe_layers and self._ctx is not None):
            return
        # every pipeline rank joins, so no rank waits alone
        value = moe.collect_aux_losses(module, group=self._ctx.parallel_state.pp_group, device=self._ctx.device)
        if value is not None:
            module.log("moe_aux_loss", value)

    # ------------------------------------------------------------------ optimizer step
    def last_microbatch_context(self, backward_passes: int) -> ContextManager:
        if self.buffer is None or not self.buffer.overlap_grad_reduce:
            return nullcontext()
        return self.buffer.last_microbatch(backward_passes)

    def finalize_grads(self) -> bool:
        if self.buffer is not None and self.buffer.has_grads:
            self.buffer.reduce()  # over expert-DP, scaled so experts match the one-device model
            if not self.buffer.distributed_optimizer:  # else only this rank's shard is reduced
                self.buffer.expose_grads()
        return True

    def zero_grads(self) -> None:
        if self.buffer is not None:
            self.buffer.zero()

    def teardown(self) -> None:
        if self.buffer is not None:
            self.buffer.remove()
        self.buffer = None
