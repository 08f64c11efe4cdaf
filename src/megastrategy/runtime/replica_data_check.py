"""Warn when the ranks of one model replica read different data from an ``IterableDataset``.

The batch broadcast (:mod:`megastrategy.batch_broadcast`) trains every rank of a replica (its tp,
cp and pp ranks) on the batch of the replica's first rank. With a map-style dataset Lightning's
sampler shards by the data-parallel rank, so those ranks read the same samples anyway. An
``IterableDataset`` shards itself, and one written the DDP way (by ``trainer.global_rank`` /
``trainer.world_size`` or ``torch.distributed.get_rank()``) gives each tp rank another shard: the
replica silently trains on its first rank's shard only (half the data at tp=2). The fix is the user's
(shard by the data-parallel rank, ``strategy.distributed_sampler_kwargs``), so this says so, once
per fit, from a fingerprint of the first training batch each rank read. Randomness (augmentation)
makes batches differ too, which the message allows for; a refusal would break that legitimate use.
"""
from __future__ import annotations

import warnings
import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from megastrategy.batch_tree import flatten_batch

__all__ = ["ReplicaDataCheck", "batch_fingerprint"]


def batch_fingerprint(batch: Any) -> tuple:
    """A cheap, exact summary of a batch: its structure, each tensor's shape and a CRC of its bytes."""
    leaves, spec = flatten_batch(batch)
    summary: list = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            summary.append((tuple(leaf.shape), str(leaf.dtype), zlib.crc32(data)))
        else:
            summary.append(repr(leaf))
    return tuple(summary)


class ReplicaDataCheck:
    """``arm(loader)`` when a training loader is set up; the next ``check(batch)`` (a collective
    over the replica group) compares fingerprints and warns once if they differ."""

    def __init__(self, group: Optional[dist.ProcessGroup], ranks: list[int]) -> None:
        self.group, self.ranks = group, ranks
        self._armed = False

    def arm(self, loader: Any) -> None:
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            self._armed = True

    def check(self, batch: Any) -> None:
        if not self._armed or self.group is None or len(self.ranks) < 2:
            return
        self._armed = False
        prints: list = [None] * len(self.ranks)
        dist.all_gather_object(prints, batch_fingerprint(batch), group=self.group)
        others = [r for r, p in zip(self.ranks, prints) if p != prints[0]]
        if others and dist.get_rank() == self.ranks[0]:
            warnings.warn(self._message(others), UserWarning, stacklevel=2)

    def _message(self, others: list[int]) -> str:
        return (
            f"MegatronStrategy: the ranks of one model replica (global ranks {self.ranks}: its tensor, context and "
            f"pipeline ranks) read different first batches from the IterableDataset training loader (ranks {others} "
            f"differ from rank {self.ranks[0]}). Every rank of a replica trains on rank {self.ranks[0]}'s batch, so "
            "what the other ranks read is never trained on. An IterableDataset sharded the DDP way (by "
            "trainer.global_rank / trainer.world_size or torch.distributed.get_rank()) must shard by the "
            "data-parallel rank instead: kw = self.trainer.strategy.distributed_sampler_kwargs; rank, num = "
            "kw['rank'], kw['num_replicas'] (the same keys exist under DDPStrategy). If the batches differ only by "
            "randomness (augmentation, masking), this is expected and can be ignored."
        )
