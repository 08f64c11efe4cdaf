"""``detect_anomalies=True``: agree over all ranks whether any gradient is NaN/inf before the step."""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.rank_zero import log_on_rank_zero

log = logging.getLogger(__name__)


class NonFiniteGuard(Component):
    """Runs first among the gradient finalizers: every rank skips (or raises) together, naming the
    ranks and the step; ``skipped_steps`` counts the skips."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.detect_anomalies
        self.on_nonfinite = config.on_nonfinite
        self.skipped_steps = 0
        self._ctx: Optional[SetupContext] = None

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        self._ctx = ctx

    def finalize_grads(self) -> bool:
        ctx = self._ctx
        if ctx is None or not ctx.grad_buffers:
            return True
        for b in ctx.grad_buffers:
            b.wait_for_reductions()  # overlapped reductions must not be read while in flight
        flats = [flat for b in ctx.grad_buffers for flat in b.buffers.values()]
        finite = all(bool(torch.isfinite(f).all()) for f in flats)
        local = torch.tensor([0.0 if finite else 1.0], device=ctx.device)
        flags = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, local)
        bad = [r for r, f in enumerate(flags) if float(f) > 0]
        if not bad:
            return True
        trainer = getattr(ctx.module, "_trainer", None)
        message = f"non-finite gradients on rank(s) {bad} at step {trainer.global_step if trainer else '?'}"
        if self.on_nonfinite == "raise":
            raise FloatingPointError(f"{message}; stopping every rank (on_nonfinite='raise').")
        self.skipped_steps += 1
        log_on_rank_zero(log, logging.WARNING, f"megastrategy: {message}; skipping this optimizer step on every rank.")
        return False
