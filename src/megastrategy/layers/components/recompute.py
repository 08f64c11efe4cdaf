"""Activation recompute as a component (``activation_checkpointing="full" | "selective"``)."""
from __future__ import annotations

from torch import nn

from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.layers.recompute import apply_activation_checkpointing


class Recompute(Component):
    """Wraps the stack's blocks (or their attention cores) so backward recomputes them, replaying
    the dropout streams exactly. Runs after the layers are final (TP, SP, TE) and before the cut."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.activation_checkpointing is not None
        self.mode = config.activation_checkpointing

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        apply_activation_checkpointing(module, self.mode, rng_tracker=ctx.rng_tracker, pipeline_layers=ctx.stack_path)
