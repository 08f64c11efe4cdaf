"""``grad_sum`` plan entries: a module kept whole on every TP rank whose parameters act on
this rank's heads only (per-head q/k norms after column-sharded projections, Hugging Face's
``replicated_with_grad_allreduce``). Each rank's gradient of such a parameter is a partial
sum over its heads; the full gradient is the sum over TP, so backward all-reduces it and the
replicas stay identical. Left alone, the ranks' copies would drift apart silently.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megastrategy.layers.mappings import ProcessGroupRef, copy_to_tensor_parallel_region

__all__ = ["sum_grads_over_tp"]


class _GradSumHooks:
    """During the module's forward its parameters are read through an identity whose
    backward all-reduces the gradient over TP; the Parameters themselves are restored after."""

    def __init__(self, group) -> None:
        self.group_ref = ProcessGroupRef(group)
        self._swapped: list[dict[str, nn.Parameter]] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        swapped: dict[str, nn.Parameter] = {}
        if torch.is_grad_enabled():
            for name, p in list(module._parameters.items()):
                if p is not None and p.requires_grad:
                    swapped[name] = p
                    module._parameters[name] = copy_to_tensor_parallel_region(p, self.group_ref.group)
        self._swapped.append(swapped)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        for name, p in (self._swapped.pop() if self._swapped else {}).items():
            module._parameters[name] = p


def sum_grads_over_tp(module: nn.Module, group) -> None:
    """Make ``module``'s own parameters' gradients the sum over the TP ``group``."""
    hooks = _GradSumHooks(group)
    module.register_forward_pre_hook(hooks.enter)
    module.register_forward_hook(hooks.leave, always_call=True)
