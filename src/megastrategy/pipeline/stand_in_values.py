"""Catch a forward that uses, past the stage cut, a value only an earlier stage computes.

On a stage that does not own a module the forward calls before the layer stack, a
:class:`~.stage.MetaStandIn` returns zeros of the right shape. That is exact as long as those
zeros only lead to the first local block's input, which the stage replaces with the previous
stage's activation. A forward that hands such a value to anything else would compute with zeros
and train silently wrong: ``nn.Transformer`` giving its decoder the target embedding (computed
before the encoder's layers), a block taking an embedding as a side input, a head adding the
embedding back. So the first forward of each chunk runs with the stand-ins' zeros *marked*: a
torch op whose inputs carry the mark marks its outputs, except the ops that read only shapes,
dtypes or devices (masks and rotary tables are built that way from the embedding, and are
right). A mark reaching a block's or a later module's inputs, or the stage's output, is refused
with the names of the module and of the stand-in.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from megastrategy.errors import MegatronConfigError

__all__ = ["StandInValue", "mark", "refuse_if_marked", "sources_of"]

# Ops whose result depends on their tensor arguments' shape, dtype or device only.
_VALUE_FREE = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
    torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
}


class StandInValue(torch.Tensor):
    """A tensor computed from a stand-in's zeros; ``sources`` names the stand-ins it came from."""

    sources: frozenset = frozenset()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _VALUE_FREE:
            return out
        sources = sources_of((args, kwargs))
        return tree_map(lambda t: mark(t, sources) if isinstance(t, torch.Tensor) else t, out) if sources else out


def mark(tensor: torch.Tensor, sources: Iterable[str]) -> StandInValue:
    """``tensor`` (same data, same autograd history) marked as coming from ``sources``."""
    marked = tensor.as_subclass(StandInValue)
    marked.sources = frozenset(sources) | getattr(tensor, "sources", frozenset())
    return marked


def sources_of(value: Any) -> frozenset:
    """The stand-ins every marked tensor in ``value`` (any nesting of containers) came from."""
    leaves, _ = tree_flatten(value)
    found: frozenset = frozenset()
    for leaf in leaves:
        if isinstance(leaf, StandInValue):
            found |= leaf.sources
    return found


def stage_place(stage: int, rank: int, vp_size: int) -> str:
    """Where a check ran, in the user's terms: the stage, and with ``vp > 1`` also the rank holding it."""
    return f"pipeline stage {stage}" if vp_size == 1 else f"virtual pipeline stage {stage} (a chunk of pipeline rank {rank})"


def refuse_if_marked(value: Any, where: str, place: str) -> None:
    """Stop with a clear error when ``value`` carries a stand-in's zeros into ``where`` (on ``place``,
    see :func:`stage_place`)."""
    sources = sources_of(value)
    if not sources:
        return
    names = ", ".join(sorted(sources))
    raise MegatronConfigError(
        f"{where} uses a value computed by {names} on {place}, which does not hold "
        f"{names} (it runs before the layer stack, so only on the first stage); the stage would compute with zeros "
        "in its place. Pipeline stages exchange only the hidden state of the layer stack, so a tensor computed "
        "before the stack may reach what runs after it only through the blocks. Use pp=1 (tensor, context and "
        "data parallelism work), or point pipeline_layers='...' at a stack that everything after it depends on "
        "only through its hidden state."
    )
