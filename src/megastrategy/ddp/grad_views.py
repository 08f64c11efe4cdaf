"""Show the gradient buffer as ``param.grad`` while Lightning's ``on_after_backward`` hooks run.

The buffer's autograd hook moves each gradient into ``param.main_grad`` and sets ``.grad`` to
``None`` (the next backward must create a fresh ``.grad``, or autograd would add in place into
the buffer and the hook would add the same gradient a second time). User hooks, though, read
``p.grad`` as under DDP, so for the duration of the hooks ``p.grad`` is the buffer itself: a view
when the dtypes agree (in-place edits, e.g. ``p.grad.mul_``, land in the buffer), a cast copy
otherwise. A tensor the hook assigns to ``p.grad`` is copied into the buffer afterwards.
With ``overlap_grad_reduce``, buckets whose reduction the last backward already started are
waited for first (never read while a collective writes them), so they show the replica average.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from megastrategy.ddp.grad_buffer import GradientBuffer

__all__ = ["visible_grads"]


@contextmanager
def visible_grads(buffers: Iterable["GradientBuffer"]) -> Iterator[None]:
    """``p.grad`` is ``p.main_grad`` (or its cast) for every buffered parameter inside the block."""
    shown = []
    for buffer in buffers:
        buffer.wait_for_reductions()
        for p in buffer.params:
            if not hasattr(p, "main_grad"):
                continue  # not buffered any more
            if p.grad is not None and not (buffer.keeps_views and p.grad is p.main_grad):
                continue  # already exposed (after the reduction)
            grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
            p.grad = grad
            shown.append((p, grad))
    try:
        yield
    finally:
        for p, grad in shown:
            if p.grad is not grad:  # the hook replaced the gradient: keep its choice
                if p.grad is None:
                    p.main_grad.zero_()
                else:
                    p.main_grad.copy_(p.grad)
            p.grad = None
