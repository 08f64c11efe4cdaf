"""Lightning's collectives as they are under DDP: over data-parallel replicas, each example once.

Under DDP every rank is a replica. Here the TP, CP and pipeline ranks of one replica hold parts of
one model (or of the same examples), so ``reduce`` and ``all_gather`` run over the data-parallel
group, and a boolean decision (``ModelCheckpoint``, ``EarlyStopping``) is voted by every rank.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megastrategy.gather_with_grads import all_gather_with_grads
from megastrategy.replicas import agree_everywhere, reduce_over

__all__ = ["ReplicaCollectives"]


class ReplicaCollectives:
    """A mixin for a Lightning strategy that owns a ``parallel_state`` (placed before ``DDPStrategy``)."""

    parallel_state: Any
    root_device: torch.device

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"):
        """Reduce over data-parallel replicas (TP and CP ranks of a replica hold the same value)."""
        if not isinstance(tensor, torch.Tensor) or self.parallel_state is None or not dist.is_initialized():
            return tensor
        return reduce_over(tensor, self.parallel_state.dp_group if group is None else group, reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return agree_everywhere(decision, all=all, device=self.root_device)

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Gather over replicas, so every example appears once. ``LightningModule.all_gather`` passes
        the world group by default: that means replicas here."""
        if group in (None, dist.group.WORLD) and self.parallel_state is not None:
            group = self.parallel_state.dp_group
        if sync_grads and dist.is_initialized():  # torch's backward fails on gloo over a group without rank 0
            return all_gather_with_grads(tensor, group)
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc]
