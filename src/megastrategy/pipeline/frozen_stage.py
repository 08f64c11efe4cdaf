"""Say why ``configure_optimizers`` failed on a pipeline stage that holds nothing to train.

A fine-tuning module freezes its embeddings and first encoder layers and builds its optimizer
from ``filter(lambda p: p.requires_grad, self.parameters())``. On one device that list holds the
upper layers and the head; under ``pp > 1`` ``configure_optimizers`` runs on every stage and sees
only that stage's parameters, so a stage whose parameters are all frozen hands torch an empty list
and torch answers ``optimizer got an empty parameter list``, which names neither the stage nor a
way out. An optimizer built from all parameters works on such a stage (frozen parameters get no
gradient and are never updated, as under DDP), which is what the message proposes.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["explain_empty_optimizer"]


def explain_empty_optimizer(module: nn.Module, stage: Optional[object], error: ValueError) -> None:
    """Raise a :class:`MegatronConfigError` from ``error`` when ``stage`` holds no trainable
    parameter (the cause of torch's empty-list error); otherwise return and let ``error`` stand."""
    if stage is None or any(p.requires_grad for p in module.parameters()):
        return
    layers = ", ".join(str(i) for chunk in stage.chunks for i in chunk)
    raise MegatronConfigError(
        f"configure_optimizers failed on pipeline stage {stage.pp_rank} of {stage.pp_size} ({error}): every "
        f"parameter this stage holds (layers {layers} of {stage.stack_path} and the modules with them) is frozen "
        "(requires_grad=False), so an optimizer built "
        "from the trainable parameters is empty here. Build the optimizer from all parameters "
        "(torch.optim.AdamW(self.parameters(), ...): frozen ones get no gradient and are not updated, as under "
        "DDP), freeze fewer of the first layers, or use a smaller pp."
    ) from error
