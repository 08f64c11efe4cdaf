"""Per-head parameter vectors of an attention under tensor parallelism (DeBERTa v1's ``q_bias`` and
``v_bias``).

DeBERTa v1 adds ``q_bias``/``v_bias`` (``[all_head_size]``, laid out head by head) to its packed
projection's query and value after viewing them into heads. With the heads split over TP, its
unchanged forward views the bias with the local head count, so each rank must see the slice of its
own heads. ``head_vector`` (on the attention module, naming those parameters): the parameters stay
whole on every rank (checkpoints unchanged, the optimizer sees the same tensor); during the module's
forward each is read as its rank's contiguous slice, through an identity whose backward sums the
gradient over TP. Each rank's gradient is nonzero only in its slice, so the sum is the full gradient
and the replicas stay identical, as :mod:`megastrategy.layers.grad_sum` does for whole parameters.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from megastrategy.layers.mappings import ProcessGroupRef, copy_to_tensor_parallel_region

__all__ = ["narrow_head_vectors"]


class _NarrowHooks:
    """Swaps the named Parameters for their local slices around the module's forward (also in eval
    mode and under no_grad: the forward needs the local width either way) and restores them after."""

    def __init__(self, group, names: tuple[str, ...]) -> None:
        self.group_ref = ProcessGroupRef(group)
        self.names = names
        self._swapped: list[dict[str, nn.Parameter]] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        group = self.group_ref.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        swapped: dict[str, nn.Parameter] = {}
        for name in self.names:
            p = module._parameters.get(name)
            if p is None:
                continue
            local = p.shape[0] // world
            swapped[name] = p
            module._parameters[name] = copy_to_tensor_parallel_region(p, group).narrow(0, rank * local, local)
        self._swapped.append(swapped)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        for name, p in (self._swapped.pop() if self._swapped else {}).items():
            module._parameters[name] = p


def narrow_head_vectors(module: nn.Module, group, names: tuple[str, ...]) -> nn.Module:
    """Make ``module``'s parameters ``names`` (head-major along dimension 0, which ``tp`` divides)
    read as this rank's heads during its forward; their gradients are summed over the TP ``group``."""
    for name in names:
        p = module._parameters.get(name)
        world = dist.get_world_size(group)
        if p is None or p.dim() < 1 or p.shape[0] % world:
            raise ValueError(
                f"head_vector: {type(module).__name__}.{name} must be a parameter whose first dimension "
                f"(heads x head size) tp={world} divides; got {None if p is None else tuple(p.shape)}"
            )
    hooks = _NarrowHooks(group, tuple(names))
    module.register_forward_pre_hook(hooks.enter)
    module.register_forward_hook(hooks.leave, always_call=True)
    return module
