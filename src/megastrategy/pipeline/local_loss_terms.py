"""Refuse a training loss that adds terms computed from a stage's own tensors outside the model call.

Under pp the user's step runs on every stage: the non-last stages pause it at the model call and
resume it with the outputs the last stage relays, which carry no gradient. So the loss such a
stage's step returns requires grad only if the step computed part of it from this stage's own
parameters outside the model call: a penalty such as ``loss + λ·Σ‖p‖²`` over ``self.parameters()``
(weight decay by hand). The schedule backpropagates only the last stage's loss through the model, so
that term's gradient on this stage's parameters would be dropped (an L2 penalty at pp2 trained
other weights than one device's, silently) and the last stage's loss counts its own parameters only.
A term whose gradient is zero on every parameter of the stage (``loss + 0 * sum(p.sum() for p in
self.parameters())``, DDP's old trick for unused parameters) changes nothing and is let through.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_local_loss_terms"]


def refuse_local_loss_terms(loss: Optional[torch.Tensor], module: nn.Module, step_name: str, pp_rank: int,
                            pp: int) -> None:
    """Raise if a non-last stage's resumed step returned a loss with a nonzero gradient of its own
    on the stage's parameters (``module``'s, as the stage holds them)."""
    if loss is None or not loss.requires_grad or _no_gradient_on(loss, module):
        return
    raise MegatronConfigError(
        f"{step_name} on pipeline stage {pp_rank} of {pp} returned a loss that depends on this stage's own "
        f"parameters outside the model call (its grad_fn: {type(loss.grad_fn).__name__}), e.g. a penalty "
        "summed over self.parameters() added to the loss, or a learnable scale or temperature applied to the "
        "model's outputs in the step (CLIP's logit_scale): under pipeline parallelism a stage holds only its "
        "layers and the schedule backpropagates only the model's output, so that term's gradient would be "
        "dropped on this stage and its value would count only the last stage's parameters. What works: "
        "the optimizer's weight_decay (AdamW(weight_decay=...)) for an L2 penalty, or pp=1 (tensor and data "
        "parallelism compute it as one device does)."
    )


def _no_gradient_on(loss: torch.Tensor, module: nn.Module) -> bool:
    """Whether ``loss`` has no gradient, or only zeros, on ``module``'s trainable parameters."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return True
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return all(g is None or not bool(g.any()) for g in grads)
