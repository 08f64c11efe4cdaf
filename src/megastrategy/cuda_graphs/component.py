"""Partial CUDA graphs as a component: build the manager on the final stage and let it follow
the training schedule microbatch by microbatch (see :mod:`megastrategy.cuda_graphs`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megastrategy.anatomy import find_layer_stack
from megastrategy.component import Component, SetupContext, StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.cuda_graphs.manager import CudaGraphManager
from megastrategy.cuda_graphs.scope import validate_cuda_graph_scope


class CudaGraphs(Component):
    """``cuda_graph_scope``: GPU only; refused before any group on another device."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = bool(config.cuda_graph_scope)
        self.scope, self.recompute = config.cuda_graph_scope, config.activation_checkpointing
        self.pp, self.vp = config.pp, config.vp_size
        self.manager: Optional[CudaGraphManager] = None

    def check_device(self, device: torch.device) -> None:
        validate_cuda_graph_scope(self.scope, device_type=device.type, activation_checkpointing=self.recompute)

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        self.manager = self.make_manager(module, ctx)

    def make_manager(self, module: nn.Module, ctx: SetupContext) -> CudaGraphManager:
        """The manager for this rank's blocks (tests replace the graphing function here)."""
        path, stack = find_layer_stack(module, ctx.stack_path)
        return CudaGraphManager(
            stack, self.scope, stack_path=path,
            chunks=ctx.stage.chunks if ctx.stage is not None else None,
            pp_size=self.pp, pp_rank=ctx.parallel_state.pp_rank, vp_size=self.vp,
        )

    def begin_step(self, module: nn.Module, step: StepInfo) -> None:
        if step.training and self.manager is not None:
            self.manager.begin_step(step.num_microbatches)

    def on_forward(self, chunk: int, microbatch: int) -> None:
        if self.manager is not None:
            self.manager.on_forward(chunk, microbatch)

    def on_backward(self, chunk: int, microbatch: int) -> None:
        if self.manager is not None:
            self.manager.on_backward(chunk, microbatch)

    def end_step(self, module: nn.Module, step: StepInfo) -> None:
        if step.training and self.manager is not None:
            self.manager.end_step()  # captures after the warm-up steps
