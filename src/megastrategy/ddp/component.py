"""Data parallelism as a component: the contiguous fp32 gradient buffer, its reduction over the
data-parallel replicas (and the cp ranks: ``SetupContext.grad_reduce_group``), ZeRO-1, and clipping by the true global norm.

Order within one optimizer step (driven by the strategy)::

    with last_microbatch_context(n):   # full buckets may start reducing during the last backward
        closure()                       # forward + backward of the step's last microbatch(es)
    finalize_grads()                    # reduce (or wait), expose .grad unless distributed
    # Lightning: on_before_optimizer_step, clipping (below), optimizer.step()
    zero_grads()
    # overlap_param_gather: the optimizer's all-gathers finish in the next forward's pre-hooks

Whether the last backward overlaps the reduction is decided per fit (``SetupContext.overlap_grad_reduce``,
see :mod:`megastrategy.ddp.overlap_policy`); parameters whose gradient another component changes
after backward (``SetupContext.grads_changed_after_backward``) keep their buckets for ``reduce()``.

Lightning's ``on_after_backward`` hooks see the buffer as ``p.grad`` (:meth:`grads_visible`);
:meth:`grad_norm` is the true global norm that clipping uses, for users to log.

Checkpoints need nothing special: :meth:`DistributedOptimizer.state_dict` returns the plain torch
format over the model's parameters, so :mod:`megastrategy.checkpoint` reshards it like any other.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from megastrategy.component import Component, SetupContext, StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.ddp.distributed_optimizer import DistributedOptimizer
from megastrategy.ddp.grad_buffer import GradientBuffer
from megastrategy.ddp.grad_clip import clip_grad_norm_, global_grad_norm
from megastrategy.ddp.grad_views import visible_grads
from megastrategy.ddp.optimizer_wrapping import wrap_optimizers
from megastrategy.ddp.trainable_set import refuse_change, trainable_change
from megastrategy.ddp.user_clip import refuse_without_visible_grads
from megastrategy.ddp.whole_grad_norm import TrainedModels
from megastrategy.ddp.zero_grad_guard import guard_zero_grad
from megastrategy.ddp.shard_statistics_refusal import refuse_shard_statistics
from megastrategy.ddp.zero_redundancy_refusal import refuse_zero_redundancy
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.shard_spec import get_shard_spec
from megastrategy.rank_zero import log_on_rank_zero
from megastrategy.moe.integration import (
    clip_grad_norm_with_experts, dense_parameters, distributed_grad_norm_with_experts, grad_norm_with_experts,
    is_expert_parameter,
)

__all__ = ["GradientBuffers", "grad_counts_here"]

log = logging.getLogger(__name__)


class GradientBuffers(Component):
    """Owns the dense gradient buffer (experts have their own, see the MoE component)."""

    def __init__(self, config: MegatronConfig) -> None:
        self.config = config
        self.buffer: Optional[GradientBuffer] = None
        self._ctx: Optional[SetupContext] = None
        self._optimizers: list = []
        self._dense_named: list[tuple[str, nn.Parameter]] = []

    def configure(self, ctx: SetupContext) -> None:
        scaler = getattr(ctx.precision_plugin, "scaler", None)
        if self.config.use_distributed_optimizer and scaler is not None:
            raise MegatronConfigError(
                "use_distributed_optimizer=True does not support fp16 loss scaling (precision='16-mixed'): "
                "the GradScaler unscales parameters' .grad, which the distributed optimizer does not use. "
                "Use precision='bf16-mixed' or '32'."
            )

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        self.teardown()
        self._ctx = ctx
        self.buffer = self._build(module)
        ctx.grad_buffers.insert(0, self.buffer)
        # the parameter objects stay the same for the fit; only their requires_grad may change
        self._dense_named = [(n, p) for n, p in module.named_parameters() if not is_expert_parameter(p)]

    def _build(self, module: nn.Module) -> GradientBuffer:
        c, ctx = self.config, self._require_ctx()
        return GradientBuffer(
            dense_parameters(module),
            group=ctx.grad_reduce_group,
            grad_reduce_in_fp32=c.grad_reduce_in_fp32,
            bucket_numel=c.bucket_numel,
            overlap_grad_reduce=ctx.overlap_grad_reduce,
            distributed_optimizer=c.use_distributed_optimizer,
            deferred_params=list(ctx.grads_changed_after_backward),
        )

    def begin_step(self, module: nn.Module, step: StepInfo) -> None:
        """Follow ``requires_grad`` changed since the buffer was built (fine-tuning code freezing or
        unfreezing layers): rebuild the buffer between optimizer steps (see :mod:`.trainable_set`)."""
        if not step.training or self.buffer is None:
            return
        unfrozen, frozen = trainable_change(self._dense_named, self.buffer.param_ids)
        if not unfrozen and not frozen:
            return
        if self.buffer.has_grads:
            refuse_change(unfrozen, frozen, "this happened between the batches of one accumulated optimizer step")
        if any(isinstance(o, DistributedOptimizer) for o in self._optimizers):  # ZeRO-1, bf16-true main weights
            refuse_change(unfrozen, frozen, "the optimizer holds fp32 pieces of the gradient buffer")
        old, ctx = self.buffer, self._require_ctx()
        old.remove()
        self.buffer = self._build(module)
        ctx.grad_buffers[ctx.grad_buffers.index(old)] = self.buffer
        log_on_rank_zero(log, logging.INFO, f"megastrategy: requires_grad changed during fit ({len(unfrozen)} "
                         f"parameter(s) unfrozen, {len(frozen)} frozen): gradient buffer rebuilt")

    def wrap_optimizers(self, optimizers: list) -> list:
        if self._ctx is not None:
            refuse_zero_redundancy(optimizers, self.config, self._ctx.parallel_state.dp_ranks)
            refuse_shard_statistics(optimizers, self.config, self._ctx.parallel_state.dp_size)
        # every buffer (dense first, then the experts'): one wrapper steps dense and expert parameters
        buffers = list(self._ctx.grad_buffers) if self._ctx is not None else [self.buffer]
        wrapped = wrap_optimizers(optimizers, buffers, distributed=self.config.use_distributed_optimizer)
        if self.config.overlap_param_gather and self._ctx is not None:
            for optimizer in wrapped:
                if isinstance(optimizer, DistributedOptimizer):
                    optimizer.enable_overlap_param_gather(self._ctx.module)
        ctx = self._ctx
        for optimizer in wrapped:  # the step's gradients are in the buffer before Lightning's zero_grad
            guard_zero_grad(optimizer, lambda: list(ctx.grad_buffers) if ctx is not None else [])
        self._optimizers = wrapped
        return wrapped

    def wait_for_params(self) -> None:
        """Finish the background parameter gathers (``overlap_param_gather``) before parameters are read."""
        for optimizer in self._optimizers:
            if isinstance(optimizer, DistributedOptimizer):
                optimizer.wait_for_param_gather()

    # ------------------------------------------------------------------ optimizer step
    @contextmanager
    def last_microbatch_context(self, backward_passes: int) -> Iterator[None]:
        """Around the closure of an optimizer step: overlapped reduction during its last backward
        pass(es), and ``.grad`` kept as a view of the buffer across a pipeline's microbatches."""
        with ExitStack() as stack:
            if self.buffer is not None:
                if self.buffer.overlap_grad_reduce:
                    stack.enter_context(self.buffer.last_microbatch(backward_passes))
                if backward_passes > 1:
                    stack.enter_context(self.buffer.gradient_views())
            yield

    def finalize_grads(self) -> bool:
        """Reduce the accumulated gradients (or wait for the overlapped reductions); without the
        distributed optimizer, point ``param.grad`` at the result."""
        if self.buffer is not None and self.buffer.has_grads:
            self.buffer.reduce()
            if not self.buffer.distributed_optimizer:
                self.buffer.expose_grads()
        return True

    def zero_grads(self) -> None:
        if self.buffer is not None:
            self.buffer.zero()

    def on_train_start(self) -> None:
        if self._ctx is not None:  # megastrategy.grad_norm(module, p) finds the fit through its model
            TrainedModels.add(self._ctx.module, self._ctx)

    def teardown(self) -> None:
        if self._ctx is not None:
            TrainedModels.remove(self._ctx.module)
        self.wait_for_params()
        for optimizer in self._optimizers:
            if isinstance(optimizer, DistributedOptimizer):
                optimizer.detach_param_gathers()
        self._optimizers = []
        if self.buffer is not None:
            self.buffer.remove()
        self.buffer = None
        self._dense_named = []

    def grads_visible(self) -> ContextManager:
        """Around Lightning's ``on_after_backward`` hooks: every buffer (dense and expert) as ``p.grad``."""
        return visible_grads(list(self._ctx.grad_buffers) if self._ctx is not None else [])

    # ------------------------------------------------------------------ clipping
    def grad_norm(self, optimizers: Iterable[Any], norm_type: float = 2.0) -> torch.Tensor:
        """The true global gradient norm, as :meth:`clip_grad_norm` computes it, without clipping.

        Collective (every rank calls it); meaningful once the gradients are reduced, i.e. in
        ``on_before_optimizer_step``; the same value on every rank.
        """
        ctx = self._require_ctx()
        ps, counts_here = ctx.parallel_state, grad_counts_here(ctx)
        optimizers = [_unwrap(o) for o in optimizers]
        if ctx.num_moe_layers and any(isinstance(o, DistributedOptimizer) for o in optimizers):
            return _combined_norm([distributed_grad_norm_with_experts(o, parallel_state=ps, dense_counts_here=counts_here,
                                                                      norm_type=norm_type) for o in optimizers], norm_type)
        if ctx.num_moe_layers:
            params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
            return grad_norm_with_experts(params, parallel_state=ps, dense_counts_here=counts_here, norm_type=norm_type)
        norms = []
        for optimizer in optimizers:
            if isinstance(optimizer, DistributedOptimizer):
                norms.append(optimizer.grad_norm(counts_here=counts_here, model_parallel_group=ps.mp_group,
                                                 norm_type=norm_type))
            else:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                norms.append(global_grad_norm(params, counts_here=counts_here, group=ps.mp_group, norm_type=norm_type))
        return _combined_norm(norms, norm_type) if norms else torch.zeros((), device=ctx.device)

    def clip_grad_norm(self, optimizer: Any, clip_val: Union[int, float]) -> torch.Tensor:
        """Clip by the true global norm: TP shards and PP stages each once, TP-replicated
        parameters and the last stage's tied-embedding copy not twice."""
        ctx = self._require_ctx()
        ps, counts_here = ctx.parallel_state, grad_counts_here(ctx)
        optimizer = _unwrap(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if ctx.num_moe_layers and isinstance(optimizer, DistributedOptimizer):  # ZeRO-1 or bf16-true main weights
            total = distributed_grad_norm_with_experts(optimizer, parallel_state=ps, dense_counts_here=counts_here)
            optimizer.scale_grads_((float(clip_val) / (total + 1e-6)).clamp(max=1.0))
            return total
        if ctx.num_moe_layers:
            return clip_grad_norm_with_experts(params, float(clip_val), parallel_state=ps, dense_counts_here=counts_here)
        if isinstance(optimizer, DistributedOptimizer):
            return optimizer.clip_grad_norm_(float(clip_val), counts_here=counts_here, model_parallel_group=ps.mp_group)
        return clip_grad_norm_(params, float(clip_val), counts_here=counts_here, group=ps.mp_group)

    def clip_params_grad_norm(self, params: list, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip these parameters' gradients by their true global norm: the user's own
        ``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` (:mod:`megastrategy.ddp.user_clip`)."""
        ctx = self._require_ctx()
        refuse_without_visible_grads(any(isinstance(_unwrap(o), DistributedOptimizer) for o in self._optimizers))
        ps, counts_here = ctx.parallel_state, grad_counts_here(ctx)
        if ctx.num_moe_layers:
            return clip_grad_norm_with_experts(params, max_norm, parallel_state=ps, dense_counts_here=counts_here,
                                               norm_type=norm_type)
        return clip_grad_norm_(params, max_norm, counts_here=counts_here, group=ps.mp_group, norm_type=norm_type)

    def clip_grad_value(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        """For ``gradient_clip_algorithm="value"`` (elementwise, so only where the gradients live)."""
        optimizer = _unwrap(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.clip_grad_value_(float(clip_val))
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_value_(params, float(clip_val))

    def _require_ctx(self) -> SetupContext:
        if self._ctx is None:
            raise RuntimeError("gradient clipping before the strategy's setup built the gradient buffer.")
        return self._ctx


def grad_counts_here(ctx: SetupContext) -> Callable[[nn.Parameter], bool]:
    """Whether this rank adds a parameter's gradient to the global norm: sharded parameters on
    every TP rank, replicated ones on TP rank 0, never the last stage's copy of a tied embedding."""
    ps, stage = ctx.parallel_state, ctx.stage
    duplicate = {id(p) for p in stage.tied_parameters} if (stage is not None and not ps.is_first_stage) else set()
    tp_rank = ps.tp_rank

    def counts_here(p: nn.Parameter) -> bool:
        if id(p) in duplicate:
            return False
        return get_shard_spec(p) is not None or tp_rank == 0

    return counts_here


def _combined_norm(norms: list, norm_type: float) -> torch.Tensor:
    """The norm of several optimizers' gradients from each one's norm."""
    stacked = torch.stack([n.float() for n in norms])
    return stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
