"""The batch broadcast (:mod:`megastrategy.batch_broadcast`) within a model replica, as a component."""
from __future__ import annotations

from typing import Any, Optional

import torch

from megastrategy.batch_broadcast import BatchBroadcaster
from megastrategy.component import Component, Environment
from megastrategy.config import MegatronConfig
from megastrategy.runtime.replica_data_check import ReplicaDataCheck


class BatchBroadcast(Component):
    """``broadcast_batch`` (default: when tp·cp·pp > 1): every rank of a model replica (its TP, CP
    and pipeline ranks) gets the batch of the replica's first rank, so a random data pipeline
    (MLM masking, worker seeds) cannot give the first stage other inputs than the last stage's
    labels, or one TP rank other tokens than another. The first training batch of an
    ``IterableDataset`` is checked first (:mod:`.replica_data_check`): ranks that read other data
    than the replica's first rank are warned about, not silently dropped."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.should_broadcast_batch
        self._src, self._group = 0, None
        self._broadcasters: dict[torch.device, BatchBroadcaster] = {}
        self._data_check = ReplicaDataCheck(None, [])

    def on_environment(self, env: Environment) -> None:
        self._src, self._group = env.parallel_state.replica_ranks[0], env.parallel_state.replica_group
        self._broadcasters = {}
        self._data_check = ReplicaDataCheck(self._group, list(env.parallel_state.replica_ranks))

    def on_train_loader(self, loader: Any, trainer: Any) -> Any:
        self._data_check.arm(loader)
        return loader

    def on_batch(self, batch: Any, device: torch.device) -> Any:
        if self._group is None:
            return batch
        broadcaster: Optional[BatchBroadcaster] = self._broadcasters.get(device)
        if broadcaster is None:
            broadcaster = self._broadcasters[device] = BatchBroadcaster(src=self._src, group=self._group, device=device)
        self._data_check.check(batch)
        return broadcaster(batch)
