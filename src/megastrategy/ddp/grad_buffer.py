"""Megatron-style local data parallelism over one contiguous gradient buffer.

Instead of wrapping the module in ``DistributedDataParallel``, every trainable parameter gets a
``main_grad`` that is a view into one flat buffer per gradient dtype (fp32 by default, whatever
the parameter dtype). Autograd hooks move each freshly accumulated ``.grad`` into ``main_grad``
(inside :meth:`GradientBuffer.gradient_views`, a pipeline step, ``.grad`` then stays that view so
autograd adds the later microbatches itself),
so microbatches and gradient-accumulation steps add up in full precision in one place, and the
data-parallel reduction is one collective per bucket per optimizer step rather than one per
parameter or per backward.

Two options change how the reduction runs:

``distributed_optimizer=True``
    every bucket is zero-padded to a multiple of the data-parallel size and split into ``dp``
    equal contiguous shards; :meth:`GradientBuffer.reduce` *reduce-scatters* each bucket, so
    that afterwards only this rank's shard (:meth:`GradientBuffer.shard_of`) holds the averaged
    gradient. That shard is what :class:`~megastrategy.ddp.distributed_optimizer.DistributedOptimizer`
    updates. With a single bucket the shard is exactly a contiguous ``1/dp`` slice of the buffer.

``overlap_grad_reduce=True`` (what ``MegatronStrategy`` uses by default, see :mod:`.overlap_policy`)
    during the backward of the last microbatch before an optimizer step (announced with
    :meth:`GradientBuffer.set_is_last_microbatch` or :meth:`GradientBuffer.last_microbatch`),
    the hooks count how many of each bucket's gradients are final; a bucket whose count is
    complete starts its reduction asynchronously right away, while backward is still computing
    the earlier layers. :meth:`GradientBuffer.reduce` then starts whatever has not started (a
    bucket with an unused parameter, a deferred bucket) and waits. The collectives and their
    order of arithmetic are the same as without overlap, so the results are bit-identical.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megastrategy.collectives import reduce_scatter_single, try_fused

DEFAULT_BUCKET_NUMEL = 40_000_000

# Fused collectives a backend turned down (checked once per process; shared with the distributed optimizer).
_unsupported: set[str] = set()


class _Bucket:
    """A contiguous range of one flat buffer whose gradients are reduced by one collective.

    ``data`` is the bucket's view of the flat buffer (padding included); ``ranges`` maps
    ``id(param)`` to the parameter's ``[start, end)`` inside ``data``.
    """

    __slots__ = ("data", "params", "ranges", "index", "deferred", "pending", "work", "started", "started_early", "flat_offset")

    def __init__(self, data: torch.Tensor, params: list[nn.Parameter], ranges: dict[int, tuple[int, int]], index: int, flat_offset: int):
        self.data = data
        self.params = params
        self.ranges = ranges
        self.index = index
        self.flat_offset = flat_offset  # where ``data`` starts in its flat buffer
        self.deferred = False  # holds a parameter whose gradient is changed after backward
        self.pending = 0  # hook calls still expected before the bucket is final
        self.work = None  # the async collective in flight
        self.started = False  # reduction started in this optimizer step
        self.started_early = False  # ... from a backward hook (overlapped)

    def numel(self) -> int:
        return self.data.numel()


def _bucket_plans(params: list[nn.Parameter], bucket_numel: int) -> list[list[nn.Parameter]]:
    """Parameters in reverse order (the last layers' gradients are ready first in backward),
    cut into buckets of at least ``bucket_numel`` elements (the last one may be smaller)."""
    plans: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        current.append(p)
        size += p.numel()
        if size >= bucket_numel:
            plans.append(current)
            current, size = [], 0
    if current:
        plans.append(current)
    return plans


class GradientBuffer:
    """Contiguous gradient storage and its data-parallel reduction for a set of parameters.

    Args:
        params: the parameters whose gradients are reduced together (duplicates are ignored).
        group: the data-parallel group to average over (``None`` or size 1: no communication).
        grad_reduce_in_fp32: accumulate and reduce in fp32 whatever the parameter dtype.
        bucket_numel: gradients are reduced in buckets of about this many elements.
        overlap_grad_reduce: start each bucket's reduction asynchronously as soon as its
            gradients are final in the last microbatch's backward (see the module docstring).
        distributed_optimizer: pad buckets to a multiple of the data-parallel size and
            reduce-scatter them, for :class:`~megastrategy.ddp.distributed_optimizer.DistributedOptimizer`.
        deferred_params: parameters whose gradient is still changed between backward and
            :meth:`reduce` (e.g. a pipeline's tied embedding, summed over the embedding group);
            their buckets never start early.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        group: Optional[dist.ProcessGroup],
        grad_reduce_in_fp32: bool = True,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        overlap_grad_reduce: bool = False,
        distributed_optimizer: bool = False,
        deferred_params: Iterable[nn.Parameter] = (),
    ) -> None:
        self.group = group
        distributed = group is not None and dist.is_initialized()
        self.dp_size = dist.get_world_size(group) if distributed else 1
        self.dp_rank = dist.get_rank(group) if distributed else 0
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.distributed_optimizer = bool(distributed_optimizer)
        self._overlapping = self.overlap_grad_reduce and self.dp_size > 1  # one replica: nothing to start early
        unique: "OrderedDict[int, nn.Parameter]" = OrderedDict()
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.param_ids = frozenset(unique)  # membership test for the trainable-set check, every step
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._hooks = []
        self.has_grads = False
        self.is_reduced = False  # reduce() has run since the last zero() / backward
        # overlap bookkeeping
        self._last_microbatch = False
        self._backward_passes = 1
        self._calls: dict[int, int] = {}
        self._any_started = False  # some bucket's reduction is in flight (a late gradient is an error)
        self._keep_views = False  # inside gradient_views()
        self.num_early_starts = 0  # buckets whose reduction a backward hook started (cumulative)

        by_dtype: "OrderedDict[tuple[torch.dtype, torch.device], list[nn.Parameter]]" = OrderedDict()
        for p in self.params:
            dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
            by_dtype.setdefault((dtype, p.device), []).append(p)
        for (dtype, device), group_params in by_dtype.items():
            self._allocate(dtype, device, _bucket_plans(group_params, bucket_numel))
        deferred = {id(p) for p in deferred_params}
        for bucket in self.buckets:
            bucket.deferred = any(id(p) in deferred for p in bucket.params)
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    def _allocate(self, dtype: torch.dtype, device: torch.device, plans: list[list[nn.Parameter]]) -> None:
        """One flat buffer for ``plans``' buckets; each parameter's ``main_grad`` is a view of it."""
        sizes = [self._padded(sum(p.numel() for p in plan)) for plan in plans]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        if dtype in self.buffers:  # same dtype on two devices: keep both reachable
            self.buffers[(dtype, device)] = flat  # type: ignore[index]
        else:
            self.buffers[dtype] = flat
        start = 0
        for plan, bucket_size in zip(plans, sizes):
            ranges: dict[int, tuple[int, int]] = {}
            offset = 0
            for p in plan:
                n = p.numel()
                p.main_grad = flat[start + offset : start + offset + n].view_as(p)
                ranges[id(p)] = (offset, offset + n)
                offset += n
            bucket = _Bucket(flat[start : start + bucket_size], plan, ranges, len(self.buckets), start)
            self.buckets.append(bucket)
            for p in plan:
                self._bucket_of[id(p)] = bucket
            start += bucket_size

    def _padded(self, n: int) -> int:
        if not self.distributed_optimizer:
            return n
        return -(-n // self.dp_size) * self.dp_size

    # ------------------------------------------------------------------ layout
    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def bucket_of(self, param: nn.Parameter) -> _Bucket:
        return self._bucket_of[id(param)]

    def shard_range(self, bucket: _Bucket, rank: Optional[int] = None) -> tuple[int, int]:
        """``[start, end)`` inside ``bucket.data`` of ``rank``'s shard (this rank by default)."""
        rank = self.dp_rank if rank is None else rank
        if not self.distributed_optimizer:
            return (0, bucket.numel()) if rank == self.dp_rank or self.dp_size == 1 else (0, 0)
        size = bucket.numel() // self.dp_size
        return rank * size, (rank + 1) * size

    def shard_of(self, bucket: _Bucket) -> torch.Tensor:
        """This rank's shard of ``bucket`` (after :meth:`reduce`: the averaged gradient)."""
        lo, hi = self.shard_range(bucket)
        return bucket.data[lo:hi]

    # ------------------------------------------------------------------ backward
    def set_is_last_microbatch(self, flag: bool, backward_passes: int = 1) -> None:
        """Announce that the coming backward pass(es) are the last before :meth:`reduce`.

        With ``overlap_grad_reduce``, while the flag is set each parameter's hook counts;
        a bucket starts its reduction after each of its parameters received
        ``backward_passes`` gradients (``num_microbatches`` under pipeline parallelism, where
        every microbatch of the step runs its backward inside one training step).
        """
        if backward_passes < 1:
            raise ValueError(f"backward_passes={backward_passes} must be >= 1")
        if flag and not self._last_microbatch:
            if any(b.started for b in self.buckets):
                raise RuntimeError(
                    "GradientBuffer: a new last microbatch began while the previous one's reduction is still "
                    "in flight; call reduce() (or zero()) once per optimizer step."
                )
            self._reset_counts(backward_passes)
        self._last_microbatch = bool(flag)
        self._backward_passes = backward_passes

    @contextmanager
    def last_microbatch(self, backward_passes: int = 1) -> Iterator["GradientBuffer"]:
        """``with buffer.last_microbatch(): closure()``: see :meth:`set_is_last_microbatch`."""
        self.set_is_last_microbatch(True, backward_passes)
        try:
            yield self
        finally:
            self.set_is_last_microbatch(False, backward_passes)

    @contextmanager
    def gradient_views(self) -> Iterator["GradientBuffer"]:
        """Around several backward passes of one optimizer step (a pipeline's microbatches):
        ``.grad`` of a parameter whose dtype matches the buffer's is ``main_grad`` from its first
        gradient on, as ``DistributedDataParallel(gradient_as_bucket_view=True)`` keeps it, so the
        later passes accumulate in autograd's own code. Outside, ``.grad`` is ``None`` as before."""
        self._keep_views = True
        try:
            yield self
        finally:
            self._keep_views = False
            for p in self.params:
                if p.grad is not None and p.grad is p.main_grad:
                    p.grad = None

    @property
    def keeps_views(self) -> bool:
        """Inside :meth:`gradient_views`: a ``.grad`` that is ``main_grad`` is the buffer, not an exposure."""
        return self._keep_views

    def _reset_counts(self, backward_passes: int) -> None:
        self._calls.clear()
        self._any_started = False
        for bucket in self.buckets:
            bucket.pending = len(bucket.params) * backward_passes
            bucket.started = bucket.started_early = False
            bucket.work = None

    def _accumulate(self, param: nn.Parameter) -> None:
        """Move the gradient autograd just produced into ``main_grad`` and free ``.grad``.

        Runs once per parameter per microbatch: the microbatches before the last one take the
        short path (no bucket bookkeeping can apply to them). Inside :meth:`gradient_views`
        ``.grad`` stays pointed at ``main_grad`` after the first gradient, so autograd adds the
        later microbatches' gradients into the buffer itself and there is nothing left to move."""
        grad, main = param.grad, param.main_grad
        if grad is not main:
            main.add_(grad)
            param.grad = main if self._keep_views and main.dtype == param.dtype else None
        self.has_grads = True
        self.is_reduced = False
        if not self._overlapping or not (self._last_microbatch or self._any_started):
            return
        self._count_toward_reduction(param)

    def _count_toward_reduction(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.started:
            raise RuntimeError(
                f"overlap_grad_reduce: a parameter of shape {tuple(param.shape)} received a gradient after "
                f"the reduction of its bucket {bucket.index} had started (more backward passes in the last "
                f"microbatch than the {self._backward_passes} announced, or a parameter reached twice in one backward, "
                "e.g. by reentrant activation checkpointing); use MegatronStrategy(overlap_grad_reduce=False), or "
                "pass the right backward_passes to set_is_last_microbatch."
            )
        if not self._last_microbatch:
            return
        calls = self._calls.get(id(param), 0) + 1
        self._calls[id(param)] = calls
        if calls > self._backward_passes:
            return  # more passes than announced; its bucket has not started (checked above)
        bucket.pending -= 1
        if bucket.pending == 0 and not bucket.deferred and self.dp_size > 1:
            self._start(bucket, async_op=True)
            bucket.started_early = True
            self.num_early_starts += 1

    # ------------------------------------------------------------------ reduction
    def _start(self, bucket: _Bucket, *, async_op: bool) -> None:
        """Average ``bucket`` over the group: all-reduce, or reduce-scatter into this rank's shard."""
        bucket.started = True
        self._any_started = True
        bucket.data.div_(self.dp_size)
        if self.distributed_optimizer:
            done, work = try_fused(
                "reduce_scatter", reduce_scatter_single, _unsupported,
                self.shard_of(bucket), bucket.data, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op,
            )
            if done:
                bucket.work = work
                return
        # all-reduce (also the fallback for a backend without reduce-scatter: every shard is valid)
        bucket.work = dist.all_reduce(bucket.data, group=self.group, async_op=async_op)

    def wait_for_reductions(self) -> None:
        """Wait for reductions started early (``overlap_grad_reduce``), so the buffer may be read."""
        self._wait_all()

    def _wait_all(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    def reduce(self) -> None:
        """Average the accumulated gradients over the data-parallel group, one collective per bucket.

        With ``distributed_optimizer`` only this rank's shard of each bucket is reduced. With
        ``overlap_grad_reduce`` the buckets already started in backward are only waited for.
        """
        if self.dp_size > 1:
            if self.overlap_grad_reduce:
                for bucket in self.buckets:
                    if not bucket.started:
                        self._start(bucket, async_op=True)
                self._wait_all()
            else:
                for bucket in self.buckets:
                    self._start(bucket, async_op=False)
                    bucket.work = None
        self._reset_counts(self._backward_passes)
        self.is_reduced = True

    def expose_grads(self) -> None:
        """Point ``param.grad`` at the reduced gradient so optimizers and clipping see it."""
        if self.distributed_optimizer and self.dp_size > 1:
            raise RuntimeError(
                "GradientBuffer(distributed_optimizer=True) reduces only this rank's shard of each bucket; "
                "whole gradients do not exist. Step a DistributedOptimizer instead of exposing grads."
            )
        for p in self.params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)

    def zero(self) -> None:
        """Start a new optimizer step: clear the buffer and drop ``.grad`` references."""
        self._wait_all()  # nothing may still write into the buffer
        for flat in self.buffers.values():
            flat.zero_()
        for p in self.params:
            p.grad = None
        self.has_grads = False
        self.is_reduced = False
        self._reset_counts(self._backward_passes)

    def remove(self) -> None:
        self._wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p in self.params:
            if hasattr(p, "main_grad"):
                del p.main_grad
