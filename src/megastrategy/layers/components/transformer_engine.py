"""Transformer Engine as a component: pick the backend for the device, swap the planned GEMMs,
and run every forward under FP8 autocast when ``fp8=True``."""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.fp8 import FP8Autocast, fp8_amax_group, validate_fp8
from megastrategy.layers.te_backend import TEConversionReport, convert_to_te, resolve_backend

log = logging.getLogger(__name__)


class TransformerEngine(Component):
    """``backend="auto" | "torch" | "te"`` and ``fp8``; a no-op on the torch backend."""

    def __init__(self, config: MegatronConfig) -> None:
        self.backend, self.fp8 = config.backend, config.fp8
        self.tp, self.sequence_parallel = config.tp, config.sequence_parallel
        self.backend_in_use: Optional[str] = None  # resolved for the device, before any group
        self.report: Optional[TEConversionReport] = None
        self._autocast: Optional[FP8Autocast] = None

    def check_device(self, device: torch.device) -> None:
        self.backend_in_use = resolve_backend(self.backend, device)
        if self.fp8 and self.backend_in_use != "te":
            try:
                resolve_backend("te", device)  # says what is missing here
            except MegatronConfigError as err:
                raise MegatronConfigError(
                    f"fp8=True needs the Transformer Engine backend, which backend={self.backend!r} cannot use "
                    f"here: {err}"
                ) from None
        validate_fp8(self.fp8, self.backend_in_use)

    def configure(self, ctx: SetupContext) -> None:
        ctx.backend_in_use = self.backend_in_use or "torch"

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        if self.backend_in_use == "te":  # swap the GEMMs of the planned layers, same shards
            module.to(ctx.device)
            self.report = convert_to_te(
                module, tp_group=ctx.parallel_state.tp_group, tp_size=self.tp, sequence_parallel=self.sequence_parallel
            )
            log.info(str(self.report))
        if self.fp8:
            self._autocast = FP8Autocast(True, amax_group=fp8_amax_group(ctx.parallel_state))

    def forward_context(self, microbatch: Any) -> ContextManager:
        return self._autocast() if self._autocast is not None else nullcontext()
