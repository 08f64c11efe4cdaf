"""Data-parallel replicas as Lightning sees them: start alike, reduce and measure over replicas.

TP and PP ranks of one replica hold parts of one model, and CP ranks parts of the same examples,
so Lightning's world-wide collectives would count each example once per model-parallel rank;
these helpers use the DP group instead.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["agree_everywhere", "broadcast_module_states", "reduce_over", "set_metric_process_group"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_over(tensor: torch.Tensor, group: Any, reduce_op: Optional[Union[str, Any]] = "mean") -> torch.Tensor:
    """``tensor`` reduced over ``group`` (a copy): mean, sum, max or min."""
    op = _reduce_op_name(reduce_op)
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=_OPS.get(op, dist.ReduceOp.SUM), group=group)
    return tensor / dist.get_world_size(group) if op == "mean" else tensor


def _reduce_op_name(reduce_op) -> str:
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = {"avg": "mean"}.get(reduce_op.lower(), reduce_op.lower())
    else:
        ops = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
        name = next((n for op, n in ops.items() if reduce_op == op), str(reduce_op))
    if name not in ("mean", "sum", "max", "min"):
        raise ValueError(f"reduce_op={reduce_op!r}: use 'mean', 'sum', 'max' or 'min'.")
    return name


def broadcast_module_states(module: nn.Module, src: int) -> None:
    """Every rank starts from rank ``src``'s weights and buffers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


def set_metric_process_group(module: nn.Module, group) -> None:
    """torchmetrics sync over the world would count each example once per TP rank; use DP only."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return
    for m in module.modules():
        if isinstance(m, Metric):
            m.process_group = group


def agree_everywhere(decision: bool, *, all: bool, device: torch.device) -> bool:
    """``decision`` taken by every rank (``all=True``) or by any rank (``all=False``).

    Every process must take the same decision (saving a checkpoint is collective), so the vote is
    over the world, not over replicas: Lightning's DDP version compares a sum over ``reduce``'s
    group with the world size, which is never equal once ``reduce`` means "over replicas".
    """
    if not dist.is_initialized():
        return bool(decision)
    votes = torch.tensor([int(bool(decision))], device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.SUM)
    return bool(votes.item() == dist.get_world_size()) if all else bool(votes.item() > 0)
