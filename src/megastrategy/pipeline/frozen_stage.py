"""Let a pipeline stage whose parameters are all frozen build the user's optimizer.

A fine-tuning module freezes its embeddings and first encoder layers (or Lightning's
``BackboneFinetuning`` freezes the whole backbone until a chosen epoch) and builds its optimizer
from ``filter(lambda p: p.requires_grad, self.parameters())``. On one device that list holds the
upper layers and the head; under ``pp > 1`` ``configure_optimizers`` runs on every stage and sees
only that stage's parameters, so a stage whose parameters are all frozen hands torch an empty list,
and torch refuses it (``optimizer got an empty parameter list``).

On such a stage the user's optimizer is built with one empty parameter group instead: it steps
nothing, as one device's optimizer steps none of those frozen parameters, keeps the group's
hyperparameters (a scheduler and ``BackboneFinetuning`` read ``param_groups[0]["lr"]``), and takes
the stage's parameters when a callback unfreezes them and calls ``add_param_group``, as one
device's optimizer does.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

__all__ = ["empty_optimizers_allowed"]


@contextmanager
def empty_optimizers_allowed(module: nn.Module, stage: Optional[object]) -> Iterator[None]:
    """While the user's ``configure_optimizers`` runs on a stage holding nothing trainable, torch
    optimizers given an empty parameter list get one empty group; elsewhere nothing changes."""
    if stage is None or any(p.requires_grad for p in module.parameters()):
        yield
        return
    original = torch.optim.Optimizer.__init__

    def init(optimizer: torch.optim.Optimizer, params, defaults: dict) -> None:
        if not isinstance(params, torch.Tensor):
            params = list(params) or [{"params": []}]
        original(optimizer, params, defaults)

    torch.optim.Optimizer.__init__ = init
    try:
        yield
    finally:
        torch.optim.Optimizer.__init__ = original
