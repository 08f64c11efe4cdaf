"""Make every tensor-parallel rank of one replica see the same batch.

TP ranks share a data-parallel rank, so Lightning's sampler hands them the same indices; but a
data pipeline with randomness of its own (MLM masking in a collate function, augmentation,
worker seeding) can still produce different tensors on each rank, and TP math silently breaks.
Broadcasting the batch from the group's first rank removes the question.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megastrategy.batch_tree import flatten_batch, unflatten_batch


def broadcast_batch(batch: Any, *, src: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    """Return ``batch`` as held by global rank ``src``, on every rank of ``group``.

    The structure and the tensors' shapes and dtypes travel as one small object; tensor data
    travels with one broadcast per tensor. Non-tensor leaves (strings, ints) travel in the object.
    """
    if dist.get_world_size(group) == 1:
        return batch
    is_src = dist.get_rank() == src
    if is_src:
        leaves, spec = flatten_batch(batch)
        meta = [
            ("tensor", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x, None)
            for x in leaves
        ]
        payload = [(spec, meta)]
    else:
        payload = [None]
    dist.broadcast_object_list(payload, src=src, group=group, device=device if device.type != "cpu" else None)
    spec, meta = payload[0]
    out = []
    for i, (kind, a, b) in enumerate(meta):
        if kind == "value":
            out.append(a)
            continue
        t = leaves[i].to(device).contiguous() if is_src else torch.empty(a, dtype=b, device=device)
        dist.broadcast(t, src=src, group=group)
        out.append(t)
    return unflatten_batch(out, spec)
