"""DDP's ``broadcast_buffers``: the data-parallel replicas run on the first replica's buffers.

Buffers such as BatchNorm's running statistics change in every training forward from the local
batch, so data-parallel replicas drift apart. torch's DistributedDataParallel (and so Lightning's
``DDPStrategy``) broadcasts rank 0's buffers at the start of a forward whenever the previous forward
ran with gradients outside an accumulation step (``no_sync``), and before the first forward. So
rank 0's checkpointed ``running_mean`` is its own, and every rank validates with rank 0's
statistics: ``val_loss`` with ``sync_dist`` depends on that. MegatronStrategy has no DDP wrapper,
so the :class:`BufferBroadcast` component does the same at the start of each step, over the
gradient-reduction group (dp, times cp), from its first rank; ``MegatronStrategy(broadcast_buffers=False)``
turns it off as it does for DDP. Buffers of modules holding experts stay each rank's own (expert parallelism splits
the data-parallel replicas over different experts).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megastrategy.component import Component, SetupContext, StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.moe.experts import is_expert_parameter

__all__ = ["BufferBroadcast", "BufferSync"]


class BufferBroadcast(Component):
    """The component: a fresh :class:`BufferSync` per fit (Lightning wraps the model in DDP, which
    broadcasts, only to fit, and unwraps it after), asked at the start of every step."""

    def __init__(self, config: MegatronConfig, broadcast_buffers: bool = True) -> None:
        self.config = config
        self.enabled = bool(broadcast_buffers)
        self._sync: Optional[BufferSync] = None

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        ps = ctx.parallel_state
        self._sync = BufferSync(ps.dp_cp_group, list(ps.dp_cp_ranks))

    def begin_step(self, module: nn.Module, step: StepInfo) -> None:
        if self._sync is None:
            return
        self._sync.before_step(module)
        # as DDP: the next forward broadcasts after one that ran with gradients and reduced them
        trainer = getattr(module, "_trainer", None)
        accumulating = (step.training and module.automatic_optimization and trainer is not None
                        and trainer.fit_loop._should_accumulate())
        self._sync.after_step(torch.is_grad_enabled() and not accumulating)

    def teardown(self) -> None:
        self._sync = None


class BufferSync:
    """``before_step(module)`` broadcasts when due; ``after_step(again)`` says whether the next step
    must (its forward ran with gradients and reduced them). The buffers are looked up at the first
    broadcast, not every step: the sync lives for one fit, and training updates buffers in place."""

    def __init__(self, group: Optional[dist.ProcessGroup], ranks: list[int], enabled: bool = True) -> None:
        self.group, self.src = group, ranks[0] if ranks else 0
        self.enabled = enabled and group is not None and len(ranks) > 1
        self._due = True  # DDP broadcasts before its first forward
        self._by_dtype: Optional[dict[torch.dtype, list[torch.Tensor]]] = None  # found once: updated in place

    def before_step(self, module: nn.Module) -> None:
        if not (self.enabled and self._due):
            return
        if self._by_dtype is None:
            self._by_dtype = {}
            for b in _replicated_buffers(module):
                self._by_dtype.setdefault(b.dtype, []).append(b)
        with torch.no_grad():
            for group in self._by_dtype.values():  # one broadcast per dtype, the buffers packed flat
                flat = torch.cat([b.reshape(-1) for b in group])
                dist.broadcast(flat, src=self.src, group=self.group)
                offset = 0
                for b in group:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()

    def after_step(self, again: bool) -> None:
        self._due = again


def _replicated_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers data-parallel peers hold copies of: not those of a module holding experts (under
    expert parallelism the dense dp group spans ranks holding different experts), nor placeholders."""
    found = []
    for sub in module.modules():
        if any(is_expert_parameter(p) for p in sub.parameters(recurse=False)):
            continue
        found += [b for b in sub.buffers(recurse=False) if b.device.type != "meta" and b.numel() > 0]
    return found
