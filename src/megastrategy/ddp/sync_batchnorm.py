"""``Trainer(sync_batchnorm=True)``: BatchNorm statistics over the data-parallel replicas' batches.

Lightning hands the flag to the strategy as a layer-sync plugin, and ``DDPStrategy.setup`` applies it
(every ``_BatchNorm`` becomes ``torch.nn.SyncBatchNorm``) for fitting; its teardown reverts it.
MegatronStrategy's ``setup`` is its own, so the flag was silently ignored: each replica normalized by
its own batch, unlike DDP. This component converts the layers at the start of each fit, over the
gradient-reduction group (dp, times cp) rather than the whole world: tensor-parallel ranks see the
same batch (counting it twice changes nothing but the traffic), and pipeline stages hold different
layers, so a world-wide group would pair one stage's BatchNorm with another's and hang. Lightning's
own teardown still reverts the layers after the fit. torch's SyncBatchNorm runs on accelerators
only; on CPU the fit is refused before the first step, as DDP refuses it ("SyncBatchNorm layers only
work with GPU modules"), instead of failing in the first forward.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError

__all__ = ["SyncBatchNormLayers"]


class SyncBatchNormLayers(Component):
    """Converts BatchNorm layers when ``requested()`` says the Trainer asked for ``sync_batchnorm``
    (known only once Lightning's connector has set the strategy's layer-sync plugin)."""

    def __init__(self, config: MegatronConfig, requested: Callable[[], bool]) -> None:
        self.config = config
        self.requested = requested

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        if not self.requested():
            return
        found = next((n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
        if found is None:
            return
        if ctx.device.type not in ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name()):
            raise MegatronConfigError(
                f"Trainer(sync_batchnorm=True) on device {ctx.device.type!r}: torch's SyncBatchNorm (for {found!r}) "
                "runs on GPU/XPU/HPU only, and DDPStrategy refuses it on CPU too. Train on an accelerator, or "
                "pass sync_batchnorm=False (each data-parallel replica then normalizes by its own batch).")
        group = ctx.parallel_state.dp_cp_group
        # The same Parameter and buffer objects move to the new layers, so the gradient buffers and
        # the optimizer built after this hook see them; the module itself is no BatchNorm, so it stays.
        nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=group)
