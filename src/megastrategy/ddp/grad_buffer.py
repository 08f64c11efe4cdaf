"""Megatron-style local data parallelism over one contiguous gradient buffer.

Instead of wrapping the module in ``DistributedDataParallel``, every trainable parameter gets a
``main_grad`` that is a view into one flat buffer per gradient dtype (fp32 by default, whatever
the parameter dtype). Autograd hooks move each freshly accumulated ``.grad`` into ``main_grad``,
so microbatches and gradient-accumulation steps add up in full precision in one place, and the
data-parallel reduction is one collective per bucket per optimizer step rather than one per
parameter or per backward.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_NUMEL = 40_000_000


class _Bucket:
    __slots__ = ("data", "params")

    def __init__(self, data: torch.Tensor, params: list[nn.Parameter]):
        self.data = data
        self.params = params


class GradientBuffer:
    """Contiguous gradient storage and its data-parallel reduction for a set of parameters.

    Args:
        params: the parameters whose gradients are reduced together (duplicates are ignored).
        group: the data-parallel group to average over (``None`` or size 1: no communication).
        grad_reduce_in_fp32: accumulate and reduce in fp32 whatever the parameter dtype.
        bucket_numel: gradients are reduced in buckets of about this many elements.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        group: Optional[dist.ProcessGroup],
        grad_reduce_in_fp32: bool = True,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    ) -> None:
        self.group = group
        self.dp_size = dist.get_world_size(group) if (group is not None and dist.is_initialized()) else 1
        unique: "OrderedDict[int, nn.Parameter]" = OrderedDict()
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._hooks = []
        self.has_grads = False

        by_dtype: "OrderedDict[tuple[torch.dtype, torch.device], list[nn.Parameter]]" = OrderedDict()
        for p in self.params:
            dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
            by_dtype.setdefault((dtype, p.device), []).append(p)
        for (dtype, device), group_params in by_dtype.items():
            total = sum(p.numel() for p in group_params)
            flat = torch.zeros(total, dtype=dtype, device=device)
            self.buffers[dtype] = flat
            offset, bucket_start, bucket_params = 0, 0, []
            # Reverse order: the last layers' gradients are ready first in backward.
            for p in reversed(group_params):
                n = p.numel()
                p.main_grad = flat[offset : offset + n].view_as(p)
                offset += n
                bucket_params.append(p)
                if offset - bucket_start >= bucket_numel:
                    self.buckets.append(_Bucket(flat[bucket_start:offset], bucket_params))
                    bucket_start, bucket_params = offset, []
            if bucket_params:
                self.buckets.append(_Bucket(flat[bucket_start:offset], bucket_params))
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    def _accumulate(self, param: nn.Parameter) -> None:
        """Move the gradient autograd just produced into ``main_grad`` and free ``.grad``."""
        param.main_grad.add_(param.grad)
        param.grad = None
        self.has_grads = True

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def reduce(self) -> None:
        """Average the accumulated gradients over the data-parallel group, one collective per bucket."""
        if self.dp_size == 1:
            return
        for bucket in self.buckets:
            bucket.data.div_(self.dp_size)
            dist.all_reduce(bucket.data, group=self.group)

    def expose_grads(self) -> None:
        """Point ``param.grad`` at the reduced gradient so optimizers and clipping see it."""
        for p in self.params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)

    def zero(self) -> None:
        """Start a new optimizer step: clear the buffer and drop ``.grad`` references."""
        for flat in self.buffers.values():
            flat.zero_()
        for p in self.params:
            p.grad = None
        self.has_grads = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p in self.params:
            if hasattr(p, "main_grad"):
                del p.main_grad
