"""Lightning's precision plugins under model parallelism, by subclassing rather than patching.

Lightning's plugins work unchanged for ``bf16-mixed`` (autocast) because gradients accumulate in
the fp32 buffer anyway. Two things must change, and :func:`adopt_precision_plugin` gives the
user's plugin a subclass (mixing in :class:`ModelParallelPrecision`) that changes them:

* clipping must see the whole model, not this rank's shards: it is delegated to the strategy's
  gradient owner, which computes the true global norm;
* Lightning's ``on_after_backward`` hooks (called from ``post_backward``) must see ``p.grad``,
  which the gradient buffer keeps in ``main_grad``: the buffer is shown as ``.grad`` for the
  duration of the hooks (:mod:`megastrategy.ddp.grad_views`);
* with dynamic loss scaling (``16-mixed``) the decision to skip a step after an overflow must be
  the same on every rank, or the shards of one model drift apart. Each rank only sees its own
  shards' gradients, so the overflow flags are OR-ed over all ranks before the scaler decides.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from megastrategy.ddp.overlap_policy import overrides_on_after_backward

__all__ = ["ModelParallelPrecision", "adopt_precision_plugin", "agree_on_overflow", "loss_scaler"]

Clip = Callable[[Any, float], Any]


def loss_scaler(precision_plugin) -> Optional["torch.amp.GradScaler"]:
    return getattr(precision_plugin, "scaler", None)


def agree_on_overflow(scaler: "torch.amp.GradScaler", optimizer: Any, group: Optional[dist.ProcessGroup] = None) -> None:
    """After unscaling: mark an overflow on every rank when any rank found one (collective)."""
    state = scaler._per_optimizer_states[id(optimizer)]
    found = list(state["found_inf_per_device"].values())
    device = found[0].device if found else torch.device("cpu")
    flag = torch.stack([f.float() for f in found]).sum().reshape(1) if found else torch.zeros(1, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    for f in found:
        f.fill_(float(flag.item() > 0))


class ModelParallelPrecision:
    """Mixed into the user's precision plugin class (see :func:`adopt_precision_plugin`)."""

    _megatron_clip_norm: Optional[Clip] = None
    _megatron_clip_value: Optional[Clip] = None
    _megatron_overflow_group: Optional[dist.ProcessGroup] = None
    _megatron_grads_visible: Callable[[], ContextManager] = nullcontext
    _megatron_finalize: Callable[[], None] = staticmethod(lambda: None)

    def post_backward(self, tensor: Any, module: Any) -> Any:
        # Lightning calls on_after_backward from here: let it read the gradients as p.grad
        # (a walk over every parameter, skipped when no module or callback defines the hook).
        callbacks = getattr(getattr(module, "_trainer", None), "callbacks", ())
        visible = self._megatron_grads_visible if overrides_on_after_backward(module, callbacks) else nullcontext
        with visible():
            return super().post_backward(tensor, module)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._megatron_finalize()  # manual optimization clips before opt.step(): reduce first
        self._megatron_clip_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        self._megatron_finalize()
        self._megatron_clip_value(optimizer, clip_val)

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # Lightning unscales, then calls this (hooks, clipping), then lets the scaler step.
        scaler = loss_scaler(self)
        if scaler is not None:
            agree_on_overflow(scaler, optimizer, self._megatron_overflow_group)
        super()._after_closure(model, optimizer)


@functools.lru_cache(maxsize=None)
def _model_parallel_class(base: type) -> type:
    if issubclass(base, ModelParallelPrecision):
        return base
    return type(f"ModelParallel{base.__name__}", (ModelParallelPrecision, base), {"__module__": __name__})


def adopt_precision_plugin(plugin: Any, *, clip_norm: Optional[Clip], clip_value: Optional[Clip],
                           overflow_group: Optional[dist.ProcessGroup] = None,
                           grads_visible: Optional[Callable[[], ContextManager]] = None,
                           finalize: Optional[Callable[[], None]] = None) -> Any:
    """Give ``plugin`` the model-parallel subclass of its own class; returns it (same object).
    ``grads_visible()`` is entered around the ``on_after_backward`` hooks; ``finalize()`` reduces
    the step's gradients (once) before clipping."""
    plugin.__class__ = _model_parallel_class(type(plugin))
    plugin._megatron_clip_norm, plugin._megatron_clip_value = clip_norm, clip_value
    plugin._megatron_grads_visible = grads_visible or nullcontext
    plugin._megatron_overflow_group = overflow_group
    if finalize is not None:
        plugin._megatron_finalize = finalize
    return plugin
