"""Reassemble a sequence-split activation on every context-parallel rank.

Used where the model pools the whole sequence (a classifier reading token 0): after the
gather, the rest of the forward is replicated on every cp rank. Backward sums the replicas'
gradients (all-reduce) and keeps the local part, which under the dp×cp gradient average gives
the single-device gradient even if the replicas differ (e.g. dropout in the head).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megastrategy.context.layout import SequenceLayout


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, layout: SequenceLayout, group, rank: int, dim: int):
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(layout.cp_size)]
        dist.all_gather(parts, local, group=group)
        ctx.layout, ctx.group, ctx.rank, ctx.dim = layout, group, rank, dim
        return layout.merge(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return ctx.layout.split(grad, ctx.rank, ctx.dim).contiguous(), None, None, None, None


def gather_sequence(local: torch.Tensor, layout: SequenceLayout, group, rank: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence in global order, differentiable."""
    return GatherSequence.apply(local, layout, group, rank, dim)
