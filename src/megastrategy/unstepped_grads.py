"""Gradients of a closure that no optimizer step used are cleared where one device's ``zero_grad`` clears them.

Lightning's docs show an ``optimizer_step`` override that steps every second batch and otherwise
calls ``optimizer_closure()`` by itself ("to run training_step + backward without an optimizer
step"). On one device each closure calls ``optimizer.zero_grad()`` before its backward (at the first
batch of an accumulation window), so the skipped batch's gradients are cleared and the step uses
the next batch's alone. Here the step runner runs the backward inside ``training_step``, before
Lightning's ``zero_grad``, into a gradient buffer that only an optimizer step clears: the skipped
batch's gradients stayed and were added to the next one's (every layout, dp included; measured at
tp2: step 3's loss 22.380 against DDP's 22.404).

So before a training step's backward, when Lightning is going to call ``zero_grad`` in that step's
closure (automatic optimization, ``batch_idx % accumulate_grad_batches == 0``, Lightning's own rule)
and the buffers still hold gradients no step consumed, they are cleared first: the zero_grad one
device runs before backward, at the moment it runs there. Within an accumulation window nothing
changes (Lightning calls no zero_grad there), nor under manual optimization (the user decides).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["clear_unstepped_grads"]


def clear_unstepped_grads(trainer: Any, buffers: Iterable[Any], zero_all: Callable[[], None]) -> bool:
    """Call ``zero_all()`` if Lightning zeroes gradients in this training step and some buffer holds
    gradients of an earlier closure; ``True`` when it did."""
    if not trainer.lightning_module.automatic_optimization:
        return False
    if trainer.fit_loop.epoch_loop.batch_idx % max(1, trainer.accumulate_grad_batches):
        return False  # inside an accumulation window Lightning calls no zero_grad
    if not any(b.has_grads for b in buffers):
        return False
    zero_all()
    return True
