"""``self.all_gather(z, sync_grads=True)`` over the data-parallel group, on every backend.

Contrastive losses (SimCLR, CLIP) gather every replica's embeddings with gradients. Lightning
passes this to ``torch.distributed.nn.functional.all_gather``, whose backward on gloo emulates a
reduce-scatter with scatters whose ``src`` is the index within the group but is read as a global
rank: over a group that does not hold global rank 0 it raised "Global rank 0 is not part of group".
Here the gather runs over the data-parallel group (:mod:`megastrategy.replica_collectives`), which at
tp2 or pp2 is such a group on every rank but the first, so the step failed on the first batch.

This Function has the same meaning (the gradient of a rank's slice is the sum of every rank's
gradient for it, as torch's reduce-scatter gives, which the data-parallel average then divides as
DDP's does): a reduce-scatter where the backend has one, else a sum all-reduce of the stacked
gradient, of which each rank keeps its slice.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_with_grads"]


def all_gather_with_grads(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``[group size, *tensor.shape]``: every rank's ``tensor``, differentiable for each of them."""
    if dist.get_world_size(group) == 1:
        return tensor.unsqueeze(0)
    return _GatherWithGrads.apply(tensor, group)


class _GatherWithGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) != dist.Backend.GLOO:
            mine = torch.empty_like(grad[ctx.rank])
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
            return mine, None
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank], None
