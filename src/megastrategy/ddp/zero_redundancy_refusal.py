"""Refuse torch's ``ZeroRedundancyOptimizer`` where its partitions would mix different parameters.

torch's DDP tutorials build ``ZeroRedundancyOptimizer(self.parameters(), optimizer_class=AdamW)``
over the default process group. It numbers the parameters it was given, gives each process a
partition, steps that partition and broadcasts each updated parameter from its owner to the group.
That assumes every process holds the same parameters, which is true of data-parallel replicas only.
Under tensor parallelism the processes hold different shards of the same shapes: the broadcast
overwrote one rank's shards with another's and training went on with wrong weights (tp2 measured:
step 2's loss 20.11 against DDP's 19.03, no error). Under pipeline parallelism the stages hold
different parameter lists: the broadcasts mismatched and gloo aborted the process. Over the
data-parallel group itself (dp only, or the user passing that group) it is exact and allowed.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_zero_redundancy"]


def refuse_zero_redundancy(optimizers: list, config: Any, dp_ranks: list) -> None:
    """Raise for a ``ZeroRedundancyOptimizer`` whose group is not this rank's data-parallel group
    (ranks ``dp_ranks``) while the model is split (tp, pp or ep > 1), or with ``use_distributed_optimizer``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            continue
        if config.use_distributed_optimizer:
            raise MegatronConfigError(
                "configure_optimizers returned torch's ZeroRedundancyOptimizer with MegatronStrategy(use_distributed_optimizer"
                "=True): the optimizer state would be sharded twice. Return the plain optimizer (e.g. torch.optim.AdamW("
                "self.parameters(), ...)); the strategy's distributed optimizer already shards its state over the replicas.")
        split = config.tp * config.pp * getattr(config, "ep", 1) > 1
        ranks = sorted(dist.get_process_group_ranks(optimizer.process_group)) if dist.is_initialized() else []
        if split and ranks != sorted(dp_ranks):
            raise MegatronConfigError(
                f"configure_optimizers returned torch's ZeroRedundancyOptimizer over processes {ranks} with tp={config.tp}, "
                f"pp={config.pp}: it partitions the parameters over its processes and broadcasts each update from its "
                "owner, which requires every process to hold the same parameters, but tensor/pipeline ranks hold "
                "different shards and stages (the broadcast would overwrite shards, or mismatch across stages). "
                "Return the plain optimizer (e.g. torch.optim.AdamW(self.parameters(), ...)) and pass "
                "MegatronStrategy(use_distributed_optimizer=True), which shards the optimizer state over the "
                f"data-parallel replicas (processes {sorted(dp_ranks)} here).")
