"""Token-level cross-entropy/NLL over all context-parallel ranks' tokens.

Each rank holds a part of every sequence, so a mean computed locally would weigh tokens by
how many valid targets happen to share a rank. Inside the forward context, ``cross_entropy``
and ``nll_loss`` with ``reduction='mean'`` return the mean over *all* ranks' valid targets
(one all-reduce of two scalars), and ``reduction='sum'`` the global sum, so every cp rank
reports the single-device loss.

Gradient convention: gradients are later AVERAGED over the dp×cp group. The backward therefore
seeds each rank with ``cp_size ×`` its share, so that the average over cp ranks is exactly the
single-device gradient.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megastrategy.errors import MegatronConfigError

_SIGNATURES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


class GlobalTokenReduction(torch.autograd.Function):
    """Forward: the all-reduced sum (or sum/count); backward: ``cp_size ×`` the local share."""

    @staticmethod
    def forward(ctx, local_sum, local_count, group, cp_size: int, mean: bool):
        totals = torch.stack([local_sum.detach().double(), local_count.double()])
        dist.all_reduce(totals, group=group)
        ctx.scale = cp_size / totals[1].item() if mean else float(cp_size)
        value = totals[0] / totals[1] if mean else totals[0]
        return value.to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None, None


def global_token_loss(func, args, kwargs, *, group, cp_size: int, local_tokens: int):
    """``func`` (F.cross_entropy or F.nll_loss) reduced over every cp rank's tokens."""
    bound = _SIGNATURES[func].bind(*args, **kwargs)
    bound.apply_defaults()
    params = bound.arguments
    reduction = params["reduction"]
    if params.get("size_average") is not None or params.get("reduce") is not None:
        reduction = torch.nn._reduction.legacy_get_string(params["size_average"], params["reduce"])
    if params["target"].numel() != local_tokens:
        raise MegatronConfigError(
            f"{func.__name__} over {params['target'].numel()} targets, but this cp rank holds {local_tokens} tokens "
            "(batch × local sequence). Token losses must use one target per local token: a loss that shifts the "
            "sequence by hand cannot be split over cp ranks. Pass labels= to the Hugging Face model (it shifts on "
            "the global sequence) or shift the labels in the dataloader."
        )
    if reduction == "none":
        return func(*args, **kwargs)
    if params.get("weight") is not None:
        raise MegatronConfigError(f"{func.__name__}(weight=...) with cp > 1 is not supported; drop the class weights.")
    params.update(reduction="sum", size_average=None, reduce=None)
    local_sum = func(**params)
    local_count = (params["target"] != params["ignore_index"]).sum()
    return GlobalTokenReduction.apply(local_sum, local_count, group, cp_size, reduction == "mean")
