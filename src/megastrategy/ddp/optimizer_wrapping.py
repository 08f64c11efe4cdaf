"""Which optimizer steps the parameters: the user's own, or a wrapper over fp32 main weights."""
from __future__ import annotations

from typing import Optional

import torch

from megastrategy.ddp.distributed_optimizer import DistributedOptimizer, MainParamsOptimizer
from megastrategy.ddp.grad_buffer import GradientBuffer
from megastrategy.errors import MegatronConfigError

__all__ = ["wrap_optimizers"]

_HALF = (torch.bfloat16, torch.float16)


def wrap_optimizers(
    optimizers: list, buffer: Optional[GradientBuffer], *, distributed: bool, with_experts: bool = False
) -> list:
    """After ``setup_optimizers``: rebuild each optimizer over fp32 main weights when needed.

    ``distributed=True`` gives a :class:`DistributedOptimizer` (ZeRO-1); otherwise half-precision
    parameters (``precision="bf16-true"``) give a :class:`MainParamsOptimizer`, so the update is
    computed and accumulated in fp32. LR schedulers stay attached to the user's optimizers, whose
    ``param_groups`` the wrappers share, so nothing else changes.
    """
    half = buffer is not None and any(p.dtype in _HALF for p in buffer.params)
    if not distributed and not half:
        return optimizers
    if buffer is None:
        raise RuntimeError("wrap_optimizers: the gradient buffer must be built before the optimizers are wrapped.")
    if half and not distributed and with_experts:
        raise MegatronConfigError(
            "half-precision parameters (precision='bf16-true' or '16-true') with MoE layers: fp32 main weights "
            "for expert parameters are not supported yet. Use precision='bf16-mixed' with MoE."
        )
    wrapper = DistributedOptimizer if distributed else MainParamsOptimizer
    return [opt if isinstance(opt, DistributedOptimizer) else wrapper(opt, buffer) for opt in optimizers]
