"""Keep ``param.grad`` out of a graph's static gradient buffers.

A replayed graph's backward returns its parameter gradients as detached views of the graph's
static buffers (``torch.cuda.make_graphed_callables`` and TE's do). When ``param.grad`` is
``None``, autograd's ``AccumulateGrad`` may *adopt* the incoming tensor as ``.grad`` instead of
copying it. ``.grad`` then aliases the static buffer, and the next backward replay of the same
graph (the next microbatch that uses the slot) overwrites the sum accumulated so far: with
gradient accumulation or a pipeline, the step's gradients come out wrong, silently.

The guard registers a hook on every parameter of a captured target that hands
``AccumulateGrad`` a private copy when it would adopt the tensor (``.grad`` is ``None``). Once
``.grad`` exists, accumulation adds into it in place and the hook copies nothing. Parameters
with a ``main_grad`` (the strategy's gradient buffer, whose hook folds ``.grad`` into the buffer
and frees it at once) need no copy either.
"""
from __future__ import annotations

from typing import Iterable

from torch import Tensor, nn

__all__ = ["StaticGradGuard"]


def _private_when_adopted(param: nn.Parameter):
    def hook(grad: Tensor) -> Tensor:
        if param.grad is None and not hasattr(param, "main_grad"):
            return grad.clone()
        return grad

    return hook


class StaticGradGuard:
    """One hook per parameter of ``modules`` (each parameter once); :meth:`remove` takes them off."""

    def __init__(self) -> None:
        self._handles: dict[int, object] = {}

    def cover(self, modules: Iterable[nn.Module]) -> None:
        for module in modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in self._handles:
                    self._handles[id(p)] = p.register_hook(_private_when_adopted(p))

    @property
    def num_params(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
