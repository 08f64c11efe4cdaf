"""Which optimizer steps the parameters: the user's own, or a wrapper over fp32 main weights."""
from __future__ import annotations

from typing import Sequence

import torch

from megastrategy.ddp.distributed_optimizer import DistributedOptimizer, MainParamsOptimizer
from megastrategy.ddp.grad_buffer import GradientBuffer

__all__ = ["wrap_optimizers"]

_HALF = (torch.bfloat16, torch.float16)


def wrap_optimizers(optimizers: list, buffers: Sequence[GradientBuffer], *, distributed: bool) -> list:
    """After ``setup_optimizers``: rebuild each optimizer over fp32 main weights when needed.

    ``buffers`` are every gradient buffer of the fit (the dense one first; with MoE layers the
    expert buffer too). ``distributed=True`` gives a :class:`DistributedOptimizer` (ZeRO-1, each
    buffer sharded over its own group); otherwise half-precision parameters
    (``precision="bf16-true"``) give a :class:`MainParamsOptimizer`, so the update is computed and
    accumulated in fp32, for expert parameters as for dense ones. LR schedulers stay attached to
    the user's optimizers, whose ``param_groups`` the wrappers share, so nothing else changes.
    """
    buffers = [b for b in buffers if b is not None]
    half = any(p.dtype in _HALF for b in buffers for p in b.params)
    if not distributed and not half:
        return optimizers
    if not buffers:
        raise RuntimeError("wrap_optimizers: the gradient buffer must be built before the optimizers are wrapped.")
    wrapper = DistributedOptimizer if distributed else MainParamsOptimizer
    return [opt if isinstance(opt, DistributedOptimizer) else wrapper(opt, buffers) for opt in optimizers]
