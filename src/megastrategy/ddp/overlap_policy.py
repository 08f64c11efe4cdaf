"""What ``overlap_grad_reduce=None`` (the default) means for one fit: on, unless it could not be exact.

Overlapping the data-parallel reduction with the last backward gives bit-identical reduced
gradients (same collectives, same arithmetic; see :mod:`megastrategy.ddp.grad_buffer`), so it is
on by default. Two situations turn the automatic choice off, because there the *user* would see
something different from the synchronous reduction:

* ``automatic_optimization=False``: the user calls ``manual_backward`` outside the optimizer's
  closure, whenever they like and possibly several times per step, so there is no "last
  backward" the strategy could announce; the reduction runs at ``opt.step()`` (or at
  ``clip_gradients``), as before.
* an ``on_after_backward`` hook (on the LightningModule or on any callback): it runs after the
  last backward, and it may read or change ``p.grad``. Synchronously every bucket then holds this
  replica's gradient (documented in docs/lightning_contract.md); with overlap, the buckets that
  already started show the replica average instead, and a non-linear edit (``clamp_``) would apply
  after the average on those buckets and before it on the others. Rather than change what a hook
  sees depending on bucket timing, such a fit keeps the synchronous reduction.

``overlap_grad_reduce=True`` forces overlap (the hooks then see the mixed state just described),
``False`` forbids it.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule

__all__ = ["resolve_overlap_grad_reduce", "overrides_on_after_backward"]


def overrides_on_after_backward(module: Any, callbacks: Any = ()) -> bool:
    """Whether the module or any callback defines its own ``on_after_backward``."""
    if type(module).on_after_backward is not LightningModule.on_after_backward:
        return True
    return any(type(cb).on_after_backward is not Callback.on_after_backward for cb in callbacks or ())


def resolve_overlap_grad_reduce(requested: Optional[bool], module: Any, trainer: Any = None) -> tuple[bool, str]:
    """``(overlap?, why)`` for ``MegatronStrategy(overlap_grad_reduce=requested)`` on ``module``."""
    if requested is not None:
        return bool(requested), f"overlap_grad_reduce={requested} was given"
    if getattr(module, "automatic_optimization", True) is False:
        return False, "automatic_optimization=False: the user's manual_backward has no announced last backward"
    callbacks = getattr(trainer, "callbacks", ()) if trainer is not None else ()
    if overrides_on_after_backward(module, callbacks):
        return False, "an on_after_backward hook reads this replica's gradients before the reduction"
    return True, "default: reduce each bucket as soon as the last backward has completed it"
