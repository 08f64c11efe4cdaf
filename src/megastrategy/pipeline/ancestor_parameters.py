"""Parameters held directly by the module that holds the layer stack, or by one of its ancestors.

A pipeline stage keeps the stack's ancestors themselves (the LightningModule, ``self.model``...), so a
parameter registered on one of them directly (no submodule: a learnable temperature ``self.scale``
multiplying the logits, Wav2Vec2's ``masked_spec_embed``) has a copy on every stage, and each copy's
gradient holds only the uses on its stage. Used after the stack only, the first stage's copy never
trained (rank 0 read 0.70 where one device had -30.6); used before and after it, the copies each took
part of the gradient and drifted apart (pp2: 187.07 against 296.61 at the second step), silently. So
their gradients are summed over the pipeline, as for a block applied on several stages: every copy
then takes one device's step.
"""
from __future__ import annotations

from torch import nn

from megastrategy.anatomy import get_submodule_path

__all__ = ["ancestor_parameters"]


def ancestor_parameters(root: nn.Module, stack_path: str) -> list[nn.Parameter]:
    """The parameters registered directly on ``root`` and on each module on the way to the stack."""
    parts = stack_path.split(".")[:-1]
    holders = [root] + [get_submodule_path(root, ".".join(parts[: i + 1])) for i in range(len(parts))]
    found, seen = [], set()
    for holder in holders:
        for p in holder.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                found.append(p)
    return found
