"""Run a stack block's hooks when the model calls ``block.forward(...)`` instead of ``block(...)``.

Pipeline stages find their cut through forward hooks on the layer stack's blocks (the first block
of a chunk receives the hidden state, the last sends it). A model that calls ``layer.forward(x)``
directly (SqueezeBERT's encoder does; so do some hand-written models) skips ``nn.Module.__call__``
and with it every hook: the stage would run blocks it does not hold on zeros, and the refusal that
follows blames a module after the stack. Routing a direct call through ``__call__`` makes it what
``block(x)`` is, which on one device computes the same thing.

How a direct call is told from ``__call__``'s own call of ``forward``: a forward pre-hook (run only
by ``__call__``) marks the block, and the wrapped ``forward`` runs the original when it finds the
mark, or goes through ``__call__`` when it does not.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from torch import nn

__all__ = ["direct_forward_calls_routed", "route_direct_forward_calls"]


class _ForwardThroughCall:
    """A block's ``forward`` that sends a direct call through ``__call__`` (a class, not a closure,
    so that a deep copy of the block rebinds it to the copy)."""

    def __init__(self, block: nn.Module, forward: Any) -> None:
        self.block, self.forward, self.pending = block, forward, 0
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.pending:
            self.pending -= 1
            return self.forward(*args, **kwargs)
        return self.block(*args, **kwargs)


def route_direct_forward_calls(blocks: Iterable[nn.Module]) -> Callable[[], None]:
    """Make ``block.forward(...)`` run ``block``'s hooks, for each of ``blocks`` (once per block);
    returns what undoes it.

    Install it last, over any other instance-level ``forward`` (recompute's checkpointed forward):
    a wrapper installed later would call this one as its inner forward, and a recompute's replay in
    backward, which runs no hooks, would be sent through ``__call__`` and its hooks again."""
    undo = []
    for block in blocks:
        if isinstance(block.__dict__.get("forward"), _ForwardThroughCall):
            continue
        previous = block.__dict__.get("forward")
        block.forward = _ForwardThroughCall(block, block.forward)
        handle = block.register_forward_pre_hook(_mark_call, prepend=True)
        undo.append((block, previous, handle))
    return lambda: _restore(undo)


@contextmanager
def direct_forward_calls_routed(blocks: Iterable[nn.Module]) -> Iterator[None]:
    """:func:`route_direct_forward_calls` for the duration of the block (the dry runs of validation,
    on the module as the user built it, before other components wrap its blocks' forwards)."""
    undo = route_direct_forward_calls(blocks)
    try:
        yield
    finally:
        undo()


def _restore(undo: list) -> None:
    for block, previous, handle in undo:
        handle.remove()
        if previous is None:
            block.__dict__.pop("forward", None)
        else:
            block.forward = previous


def _mark_call(module: nn.Module, args: Any) -> None:
    """The pre-hook: ``__call__`` is about to call ``forward``. It finds the wrapper on the module it
    runs for, so that a deep copy's hook marks the copy's wrapper."""
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, _ForwardThroughCall):
        wrapper.pending += 1
