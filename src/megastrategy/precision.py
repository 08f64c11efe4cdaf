"""Mixed precision under model parallelism.

Lightning's precision plugins work unchanged for ``bf16-mixed`` (autocast) because gradients
accumulate in the fp32 buffer anyway. Dynamic loss scaling (``16-mixed``) needs one more
guarantee: the decision to skip a step after an overflow must be the same on every rank,
or the shards of one model drift apart. Each rank only sees its own shards' gradients, so the
overflow flags are OR-ed over all ranks before the scaler decides.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def loss_scaler(precision_plugin) -> Optional["torch.amp.GradScaler"]:
    return getattr(precision_plugin, "scaler", None)


def install_overflow_agreement(precision_plugin, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make ``precision_plugin``'s GradScaler skip a step on every rank when any rank overflowed.

    Lightning unscales, then calls ``_after_closure`` (hooks, clipping), then lets the scaler step;
    the agreement is inserted at the start of ``_after_closure`` so clipping sees it too.
    """
    scaler = loss_scaler(precision_plugin)
    if scaler is None or getattr(precision_plugin, "_megastrategy_overflow_agreement", False):
        return
    original = precision_plugin._after_closure

    def after_closure(model, optimizer) -> None:
        state = scaler._per_optimizer_states[id(optimizer)]
        found = list(state["found_inf_per_device"].values())
        device = found[0].device if found else torch.device("cpu")
        flag = torch.stack([f.float() for f in found]).sum().reshape(1) if found else torch.zeros(1, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        for f in found:
            f.fill_(float(flag.item() > 0))
        original(model, optimizer)

    precision_plugin._after_closure = after_closure
    precision_plugin._megastrategy_overflow_agreement = True
