"""Refuse layers that normalize with the statistics of the batch they see when pp splits the batch.

Under ``pp > 1`` every step runs as ``num_microbatches`` microbatches, each a slice of the batch. A
BatchNorm in training mode normalizes by the mean and variance of its input, so on a microbatch it
uses other statistics than one device does on the whole batch (and updates its running statistics
from them): every loss differs, silently (the sweep found ResNet, MobileNet and RegNet off by 0.1 to
10 at pp=2). Gradient accumulation under DDP would differ the same way, but the user never asked
for accumulation here, so this is refused in setup, naming the layer and what works instead.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_batch_statistics"]


def _first_batch_norm(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return name, m
    return None


def refuse_batch_statistics(module: nn.Module, pp: int, num_microbatches: int) -> None:
    """Raise if the module holds a BatchNorm layer and the batch is cut into several microbatches."""
    if num_microbatches <= 1:
        return
    found = _first_batch_norm(module)
    if found is None:
        return
    name, layer = found
    raise MegatronConfigError(
        f"pp={pp} with num_microbatches={num_microbatches}: {name!r} ({type(layer).__name__}) normalizes "
        f"with the mean and variance of the batch it sees, and pipeline stages see microbatches of 1/"
        f"{num_microbatches} of the batch, so every step would differ silently from one device's. Pass "
        f"num_microbatches=1 (each microbatch is the whole batch), or use a normalization that does not "
        f"mix examples (GroupNorm, LayerNorm), or tensor/data parallelism instead of pp for this model."
    )
