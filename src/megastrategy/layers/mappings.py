"""Autograd-conjugate collectives for tensor and sequence parallelism.

Every function takes its process group explicitly and is the identity when the group has
a single rank. Each forward collective is paired with its conjugate in backward:

=============================================  ==========================  =========================
function                                       forward                     backward
=============================================  ==========================  =========================
copy_to_tensor_parallel_region                 identity                    all-reduce
reduce_from_tensor_parallel_region             all-reduce                  identity
scatter_to_tensor_parallel_region              keep own last-dim slice     all-gather last dim
gather_from_tensor_parallel_region             all-gather last dim         keep own last-dim slice
scatter_to_sequence_parallel_region            keep own slice of ``dim``   all-gather ``dim``
gather_from_sequence_parallel_region           all-gather ``dim``          reduce-scatter ``dim``
reduce_scatter_to_sequence_parallel_region     reduce-scatter ``dim``      all-gather ``dim``
=============================================  ==========================  =========================

All communication goes through three small functions (:func:`all_reduce`,
:func:`all_gather`, :func:`reduce_scatter`), so :func:`record_collectives` sees every
collective issued by the layers (forward and backward, any thread).
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from megastrategy.collectives import all_gather_single, reduce_scatter_single, try_fused
from megastrategy.exchange_all_reduce import exchange_all_reduce, exchange_applies

__all__ = [
    "CollectiveRecord",
    "record_collectives",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "group_world_size",
    "group_rank",
    "ProcessGroupRef",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "SharedInputCopy",
]


# ----------------------------------------------------------------------------------------
# group helpers
# ----------------------------------------------------------------------------------------
def group_world_size(group) -> int:
    """Size of ``group``; 1 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


class ProcessGroupRef:
    """Holds a process group so that ``copy.deepcopy`` of a module keeps the SAME group
    (a ProcessGroup cannot be copied or pickled)."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"ProcessGroupRef(world={group_world_size(self.group)})"


# ----------------------------------------------------------------------------------------
# recording
# ----------------------------------------------------------------------------------------
class CollectiveRecord(NamedTuple):
    """One collective issued by this process.

    ``numel``/``bytes`` are the size of the tensor this rank contributes: the reduced
    tensor for all-reduce, the local input for all-gather, the full input for
    reduce-scatter.
    """

    op: str
    numel: int
    bytes: int


# Active recorders. Only non-empty while a ``record_collectives()`` block is open. Not
# thread-local on purpose: backward of accelerator tensors runs on autograd worker threads.
_recorders: list[list[CollectiveRecord]] = []
_recorders_lock = threading.Lock()


@contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Record every collective issued through this module while the block is open.

    Yields a list that is filled with :class:`CollectiveRecord` ``(op, numel, bytes)``.
    Blocks may nest; each sees the collectives issued while it is open.
    """
    log: list[CollectiveRecord] = []
    with _recorders_lock:
        _recorders.append(log)
    try:
        yield log
    finally:
        with _recorders_lock:
            for i, entry in enumerate(_recorders):
                if entry is log:
                    del _recorders[i]
                    break


def _record(op: str, t: Tensor) -> None:
    if _recorders:
        rec = CollectiveRecord(op, t.numel(), t.numel() * t.element_size())
        with _recorders_lock:
            for log in _recorders:
                log.append(rec)


# ----------------------------------------------------------------------------------------
# the collectives (the only places that talk to torch.distributed)
# ----------------------------------------------------------------------------------------
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_unsupported: set[str] = set()  # fused collectives the backend turned down (checked once)
# module attributes (not direct calls) so that tests can stand in a refusing backend
_all_gather_single = all_gather_single
_reduce_scatter_single = reduce_scatter_single


def all_reduce(t: Tensor, group, op: str = "sum", *, in_place: bool = True) -> Tensor:
    """All-reduce ``t`` over ``group`` (``op`` in sum/max/min): IN PLACE, returning ``t``; or
    (``in_place=False``) into a new tensor, ``t`` untouched. Identity with one rank."""
    world = group_world_size(group)
    if world == 1:
        return t
    if not t.is_contiguous():
        raise ValueError("all_reduce needs a contiguous tensor")
    _record("all_reduce" if op == "sum" else f"all_reduce_{op}", t)
    if exchange_applies(t, group, world, op):
        return exchange_all_reduce(t, group, world, op, in_place=in_place)
    if not in_place:
        t = t.clone()
    dist.all_reduce(t, op=_REDUCE_OPS[op], group=group)
    return t


def all_gather(t: Tensor, group, dim: int = -1) -> Tensor:
    """Concatenate every rank's ``t`` (same shape everywhere) along ``dim``; new tensor."""
    world = group_world_size(group)
    if world == 1:
        return t
    dim = dim % t.dim()
    t = t.contiguous()
    _record("all_gather", t)
    if _all_gather_single is not None and "all_gather" not in _unsupported:
        out = torch.empty((world * t.numel(),), dtype=t.dtype, device=t.device)
        done, _ = try_fused("all_gather", _all_gather_single, _unsupported, out, t.reshape(-1), group=group)
        if done:
            stacked = out.view(world, *t.shape)  # [world, *shape]
            if dim == 0:
                return stacked.reshape(world * t.size(0), *t.shape[1:])
            return stacked.movedim(0, dim).reshape(
                *t.shape[:dim], world * t.size(dim), *t.shape[dim + 1 :]
            )
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(t: Tensor, group, dim: int = 0) -> Tensor:
    """Sum ``t`` over ``group`` and keep this rank's equal slice of ``dim``; new tensor."""
    world = group_world_size(group)
    if world == 1:
        return t
    dim = dim % t.dim()
    if t.size(dim) % world:
        raise ValueError(
            f"reduce_scatter: dim {dim} has size {t.size(dim)}, not divisible by the group "
            f"size {world}"
        )
    _record("reduce_scatter", t)
    front = t.movedim(dim, 0).contiguous()  # [world * k, ...]
    k = front.size(0) // world
    if _reduce_scatter_single is not None and "reduce_scatter" not in _unsupported:
        out = torch.empty((k, *front.shape[1:]), dtype=t.dtype, device=t.device)
        done, _ = try_fused("reduce_scatter", _reduce_scatter_single, _unsupported, out, front,
                            op=dist.ReduceOp.SUM, group=group)
        if done:
            return out.movedim(0, dim)
    summed = front.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    rank = group_rank(group)
    return summed.narrow(0, rank * k, k).movedim(0, dim).contiguous()


# ----------------------------------------------------------------------------------------
# local helpers
# ----------------------------------------------------------------------------------------
def _split(x: Tensor, group, dim: int) -> Tensor:
    world = group_world_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    if x.size(dim) % world:
        raise ValueError(
            f"cannot split dim {dim} of size {x.size(dim)} evenly over {world} "
            "tensor-parallel ranks"
        )
    k = x.size(dim) // world
    return x.narrow(dim, group_rank(group) * k, k).contiguous()


def _reduce(x: Tensor, group) -> Tensor:
    # never modify a tensor we do not own (autograd may hand the same gradient to
    # several consumers, and the forward input may be saved elsewhere)
    return all_reduce(x.contiguous(), group, in_place=False)


# ----------------------------------------------------------------------------------------
# autograd functions
# ----------------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, -1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, -1), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.group, ctx.dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


def copy_to_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """Forward identity; backward all-reduce of the gradient."""
    if group_world_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """Forward all-reduce (sum); backward identity."""
    if group_world_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """Forward: keep this rank's slice of the last dim; backward: all-gather the last dim."""
    if group_world_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: Tensor, group) -> Tensor:
    """Forward: all-gather the last dim; backward: keep this rank's slice."""
    if group_world_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: Tensor, group, dim: int = 0) -> Tensor:
    """Forward: keep this rank's slice of ``dim``; backward: all-gather ``dim``."""
    if group_world_size(group) == 1:
        return x
    return _ScatterToSP.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: Tensor, group, dim: int = 0) -> Tensor:
    """Forward: all-gather ``dim``; backward: reduce-scatter ``dim``."""
    if group_world_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group, dim: int = 0) -> Tensor:
    """Forward: reduce-scatter ``dim``; backward: all-gather ``dim``."""
    if group_world_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, group, dim)


class SharedInputCopy:
    """``copy_to_tensor_parallel_region`` shared by every layer fed the same tensor.

    Calling it twice with the same tensor object (unchanged since: same autograd
    version) returns the same output, so the gradients of all consumers are summed by
    autograd first and the backward all-reduce runs ONCE (e.g. q, k and v projections of
    one hidden state). Only the last input is remembered, through a weak reference: the
    memo dies with the input. Under ``torch.no_grad`` it is a plain pass-through.
    """

    def __init__(self, group):
        self._group_ref = ProcessGroupRef(group)
        self._ref: weakref.ReferenceType | None = None
        self._version = -1
        self._out: Tensor | None = None

    @property
    def group(self):
        return self._group_ref.group

    def __deepcopy__(self, memo):
        # a copy shares the group but not the memo (which holds a non-leaf tensor)
        return type(self)(self.group)

    def __getstate__(self):
        raise TypeError("SharedInputCopy holds a process group and cannot be pickled")

    def _forget(self, _ref=None) -> None:
        self._ref = None
        self._out = None

    def __call__(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or group_world_size(self.group) == 1:
            return x
        ref = self._ref
        if ref is not None and ref() is x and self._version == x._version and self._out is not None:
            return self._out
        out = copy_to_tensor_parallel_region(x, self.group)
        self._forget()
        try:
            self._ref = weakref.ref(x, self._make_callback())
        except TypeError:  # not weak-referenceable: no memo
            return out
        self._version = x._version
        self._out = out
        return out

    def _make_callback(self):
        me = weakref.ref(self)

        def _cb(dead_ref):
            obj = me()
            if obj is not None and obj._ref is dead_ref:
                obj._forget()

        return _cb

    def __repr__(self) -> str:
        return f"SharedInputCopy(world={group_world_size(self.group)})"
