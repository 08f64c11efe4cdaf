"""Make every rank of one model replica (TP, CP and pipeline ranks) see the same batch.

These ranks share a data-parallel rank, so Lightning's sampler hands them the same indices; but a
data pipeline with randomness of its own (MLM masking in a collate function, augmentation,
worker seeding) can still produce different tensors on each rank, and TP math silently breaks.
Broadcasting the batch from the group's first rank removes the question.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megastrategy.tree_broadcast import TreeBroadcast

__all__ = ["BatchBroadcaster"]


class BatchBroadcaster:
    """``broadcaster(batch)`` returns global rank ``src``'s batch on every rank of ``group``, on
    ``device``: a :class:`TreeBroadcast` (one header and one packed payload per batch; the
    structure, with any strings or ints in it, pickled only when it changes)."""

    def __init__(self, *, src: int, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self._broadcast = TreeBroadcast(group=group, src=src, device=device, what="the batch broadcast")

    def __call__(self, batch: Any) -> Any:
        if dist.get_world_size(self.group) == 1:
            return batch
        return self._broadcast(batch)
