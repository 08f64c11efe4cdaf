"""``optimizer.zero_grad(set_to_none=False)`` from Lightning's closure must not clear the step's gradients.

Lightning's automatic optimization calls ``optimizer_zero_grad`` inside the optimizer-step closure,
after ``training_step`` and before ``backward``. Under this strategy the step runner has already run
every backward inside ``training_step`` (a pipeline's microbatches), so by the time zero_grad runs the
step's gradients sit in the gradient buffer; across a pipeline's microbatches ``p.grad`` is a view of
that buffer. A user's ``optimizer_zero_grad`` override calling ``optimizer.zero_grad(set_to_none=False)``
(older Lightning docs, and code written for speed) then zeroed the buffer in place: at pp2 the
optimizer stepped on zero gradients, silently (the default ``set_to_none=True`` only drops the view).

The buffer is the gradient's owner, and the strategy clears it after every optimizer step. So while
it holds gradients not yet reduced (the backward one device would run after this zero_grad), a
``zero_grad(set_to_none=False)`` drops the views instead of zeroing through them; everything else
(``p.grad`` of parameters outside the buffer, and reduced gradients, e.g. a zero_grad in
``on_before_optimizer_step``) is zeroed as torch would.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

__all__ = ["guard_zero_grad"]

_MARK = "_megastrategy_zero_grad_guard"


def guard_zero_grad(optimizer: Any, buffers: Callable[[], Iterable[Any]]) -> Any:
    """Give ``optimizer`` (an instance) a ``zero_grad`` that leaves unreduced buffered gradients alone.

    ``buffers()`` are the strategy's gradient buffers, asked at each call. Idempotent."""
    original = optimizer.zero_grad
    if getattr(original, _MARK, False):
        return optimizer

    @functools.wraps(original)
    def zero_grad(set_to_none: bool = True) -> None:
        if not set_to_none:
            _drop_unreduced_views(buffers())
        return original(set_to_none=set_to_none)

    setattr(zero_grad, _MARK, True)
    optimizer.zero_grad = zero_grad
    return optimizer


def _drop_unreduced_views(buffers: Iterable[Any]) -> None:
    """``p.grad = None`` where ``p.grad`` is a view of a buffer holding gradients not yet reduced."""
    for buffer in buffers:
        if not buffer.has_grads or buffer.is_reduced:
            continue
        for p in buffer.params:
            main = getattr(p, "main_grad", None)
            if main is not None and p.grad is main:
                p.grad = None
