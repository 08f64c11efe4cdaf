"""Gradient clipping by the true global norm of a model split over tensor/pipeline ranks.

``torch.nn.utils.clip_grad_norm_`` on one rank sees only that rank's shards. The true norm sums
every shard once: tensor-parallel shards on all TP ranks, pipeline stages on all PP ranks, but a
parameter replicated over TP (LayerNorm, a row layer's bias) and the last stage's copy of a tied
embedding only once.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn


def global_grad_norm(
    params: Iterable[nn.Parameter],
    *,
    counts_here: Callable[[nn.Parameter], bool],
    group: Optional[dist.ProcessGroup],
    norm_type: float = 2.0,
) -> torch.Tensor:
    """The norm of all gradients across ``group``; ``counts_here(p)`` says whether this rank adds p."""
    grads = [p.grad for p in params if p.grad is not None and counts_here(p)]
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == float("inf"):
        local = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        if group is not None and dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local += g.detach().float().norm(norm_type) ** norm_type
    if group is not None and dist.is_initialized():
        dist.all_reduce(local, group=group)
    return local ** (1.0 / norm_type)


def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    *,
    counts_here: Callable[[nn.Parameter], bool],
    group: Optional[dist.ProcessGroup],
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale every gradient so that the global norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, counts_here=counts_here, group=group, norm_type=norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
