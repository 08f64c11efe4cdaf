"""Refuse optimizers whose update needs statistics over a whole tensor, or over all parameters,
where a rank holds only part of them.

Adam, AdamW, SGD and their kind update every element from that element's own gradient and state,
so a tensor-parallel shard updates exactly as its part of the whole tensor would. Some optimizers
do not:

* per-tensor statistics: Adafactor factors the second moment into row and column means and scales
  the step by the tensor's RMS; LAMB and LARS scale by the ratio of the tensor's and its update's
  norms; Muon, Shampoo and SOAP apply matrix functions to the whole gradient. On a tp shard (or a
  ZeRO-1 piece of the flat buffer) those statistics are the shard's: tp2 measured with
  ``torch.optim.Adafactor``, step 3's loss 21.345 against DDP's 21.339 (pp is exact: a stage holds
  whole tensors).
* all-parameter statistics: ``torch.optim.LBFGS`` takes dot products and a line search over every
  parameter it was given, which under tp or pp are this rank's shards and stage, so the ranks took
  different steps (tp2: step 3's loss 15.86 against DDP's 8.76). Over data-parallel replicas, whose
  parameters are whole and equal, it is exact (dp2 tested).

Recognised by class name, since these optimizers come from many packages (torch, transformers,
timm, apex, third-party Muon); an unknown optimizer is trusted to be element-wise.
"""
from __future__ import annotations

from typing import Any

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_shard_statistics"]

_PER_TENSOR = ("adafactor", "lamb", "lars", "muon", "shampoo", "soap")
_ALL_PARAMETERS = ("lbfgs",)


def refuse_shard_statistics(optimizers: list, config: Any, dp_size: int) -> None:
    """Raise for an optimizer whose statistics a rank's part of the parameters cannot give."""
    zero1 = bool(config.use_distributed_optimizer) and dp_size > 1
    for optimizer in optimizers:
        name = type(getattr(optimizer, "_optimizer", optimizer)).__name__
        lowered = name.lower()
        if any(k in lowered for k in _ALL_PARAMETERS) and (config.tp * config.pp > 1 or zero1):
            raise MegatronConfigError(
                f"configure_optimizers returned {name} with tp={config.tp}, pp={config.pp}"
                f"{', use_distributed_optimizer=True' if zero1 else ''}: its line search and curvature pairs use dot "
                "products over every parameter it was given, which here are this rank's shards and stage, so each "
                "rank would take a different step. Use it with data parallelism only (tp=1, pp=1, "
                "use_distributed_optimizer=False: exact), or a first-order optimizer (SGD, Adam, AdamW).")
        if any(k in lowered for k in _PER_TENSOR) and (config.tp > 1 or zero1):
            where = f"tp={config.tp}" if config.tp > 1 else "use_distributed_optimizer=True"
            raise MegatronConfigError(
                f"configure_optimizers returned {name} with {where}: it updates a tensor from statistics of the whole "
                "tensor (row/column factors, its norm or RMS, or a matrix function of its gradient), and this rank "
                "holds only a shard of it, so the update would not be one device's. Use an element-wise optimizer "
                "(Adam, AdamW, SGD) with tp > 1, or keep this one with tp=1 and use_distributed_optimizer=False "
                "(pipeline stages and data-parallel replicas hold whole tensors: exact).")
