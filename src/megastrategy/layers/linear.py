"""Column- and row-parallel linear layers (Megatron-style tensor parallelism).

A column-parallel layer holds rows ``[r*out/tp, (r+1)*out/tp)`` of the user's weight
``A`` ([out, in]) and computes its slice of ``Y = X A^T + b``. A row-parallel layer holds
columns ``[r*in/tp, (r+1)*in/tp)`` of ``A``, multiplies its slice of the input, and the
partial products are summed with one all-reduce; its bias is replicated and added after
the reduction.

A sharded layer holds exactly the user's slice of the full weight: ``from_linear`` /
``from_weight`` copy it, and the plain constructor initializes the FULL weight the way
``nn.Linear`` does (so, for a given seed, independently of the tensor-parallel size) and
keeps its slice.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.mappings import (
    ProcessGroupRef,
    SharedInputCopy,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_world_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megastrategy.layers.shard_spec import ShardSpec, set_shard_spec, shard_full_tensor

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "init_linear_full", "column_parallel_input"]


def init_linear_full(
    out_features: int, in_features: int, bias: bool, *, device=None, dtype=None
) -> tuple[Tensor, Tensor | None]:
    """The full weight/bias ``nn.Linear(in_features, out_features)`` would initialize
    (same distribution and same RNG draws, in the same order)."""
    weight = torch.empty((out_features, in_features), device=device, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    b = None
    if bias:
        b = torch.empty((out_features,), device=device, dtype=dtype)
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(b, -bound, bound)
    return weight, b


def _param_from(src: Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(src.detach().clone(memory_format=torch.contiguous_format),
                        requires_grad=requires_grad)


def _check_divisible(arg: str, value: int, world: int, what: str) -> None:
    if value % world:
        raise MegatronConfigError(
            f"{arg}={value}: {what} must be divisible by the tensor-parallel size {world}; "
            f"use a tensor-parallel size that divides {value} or replicate this layer."
        )


def _check_packing(out_features: int, chunks: int, sections: tuple[int, ...], tp: int) -> int:
    """The number of packed projections, after checking that each one splits evenly over ``tp``:
    ``chunks`` equal ones, or the explicit (possibly unequal) ``sections``."""
    if sections:
        if sum(sections) != out_features or min(sections) < 1:
            raise MegatronConfigError(
                f"packed_sections={sections}: must be positive and sum to out_features={out_features}."
            )
        for i, size in enumerate(sections):
            _check_divisible(f"packed_sections[{i}]", size, tp, "each packed section of a column-parallel layer")
        return len(sections)
    if chunks < 1 or out_features % chunks:
        raise MegatronConfigError(f"packed_chunks={chunks}: must be >= 1 and divide out_features={out_features}.")
    _check_divisible(
        "out_features" if chunks == 1 else f"out_features/packed_chunks ({chunks})",
        out_features // chunks, tp, "the output size of a column-parallel layer",
    )
    return chunks


def column_parallel_input(layer: nn.Module, x: Tensor) -> Tensor:
    """The input of a layer whose outputs are split over TP, replicated on every rank (its gradient summed
    over TP in backward): through ``layer.input_copy`` when layers fed one tensor share it, gathered along
    the sequence under sequence parallelism, else the identity/all-reduce copy."""
    if layer.input_copy is not None:
        return layer.input_copy(x)
    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(x, layer.group, layer.sequence_dim)
    return copy_to_tensor_parallel_region(x, layer.group)


def _requires_grad(t: Tensor | None) -> bool:
    return True if t is None else bool(t.requires_grad)


class ColumnParallelLinear(nn.Module):
    """``Y_local = X A_local^T (+ b_local)`` with ``A_local`` = this rank's rows of ``A``.

    The input is replicated over the group (its gradient is all-reduced in backward,
    through ``input_copy`` when given so that layers fed the same tensor share one
    all-reduce). The output is this rank's slice of the last dim, or the full output
    with ``gather_output=True``. With ``skip_bias_add=True`` forward returns
    ``(output, bias)`` and leaves the addition to the caller (bias is None without one).

    ``packed_chunks=c`` treats the output dim as ``c`` concatenated projections (fused
    QKV) and shards each separately: rank r holds ``[q_r | k_r | v_r]``. ``packed_sections``
    gives the projections' sizes when they differ (grouped-query ``[q | k | v]``); each section
    must be divisible by the tensor-parallel size.

    ``sequence_parallel=True``: the input is split along ``sequence_dim`` over the group
    (sequence parallelism) and is all-gathered along it before the matmul (backward:
    reduce-scatter) instead of the identity/all-reduce copy. A given ``input_copy`` still
    takes precedence (a shared gather, see :mod:`megastrategy.layers.sequence_parallel`).
    """

    @property
    def group(self):
        """The tensor-parallel process group."""
        return self._group_ref.group

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        packed_chunks: int = 1,
        packed_sections: tuple[int, ...] = (),
        input_copy: SharedInputCopy | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        full_w, full_b = init_linear_full(out_features, in_features, bias, device=device, dtype=dtype)
        self._setup(full_w, full_b, group=group, gather_output=gather_output,
                    skip_bias_add=skip_bias_add, packed_chunks=packed_chunks,
                    packed_sections=packed_sections, input_copy=input_copy, w_grad=True, b_grad=True)
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)

    # -- construction ----------------------------------------------------------------
    def _setup(self, full_w, full_b, *, group, gather_output, skip_bias_add, packed_chunks,
               packed_sections, input_copy, w_grad, b_grad) -> None:
        out_features, in_features = full_w.shape
        tp = group_world_size(group)
        packed_sections = tuple(int(x) for x in packed_sections)
        packed_chunks = _check_packing(out_features, packed_chunks, packed_sections, tp)
        self.in_features = in_features
        self.out_features = out_features
        self._group_ref = ProcessGroupRef(group)
        self.tp_size = tp
        self.tp_rank = group_rank(group)
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.packed_chunks = packed_chunks
        self.packed_sections = packed_sections
        self.input_copy = input_copy
        self.sequence_parallel = False
        self.sequence_dim = 0
        self.output_size_per_partition = out_features // tp
        spec = ShardSpec(dim=0, full_size=out_features, padded_size=out_features,
                         packed_chunks=packed_chunks, packed_sections=packed_sections)
        self.weight = _param_from(shard_full_tensor(full_w, spec, self.tp_rank, tp), w_grad)
        set_shard_spec(self.weight, spec)
        if full_b is not None:
            self.bias = _param_from(shard_full_tensor(full_b, spec, self.tp_rank, tp), b_grad)
            set_shard_spec(self.bias, spec)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_weight(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        *,
        group,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        packed_chunks: int = 1,
        packed_sections: tuple[int, ...] = (),
        input_copy: SharedInputCopy | None = None,
    ) -> "ColumnParallelLinear":
        """Shard a full ``weight`` [out, in] (and ``bias`` [out]); copies this rank's slice,
        keeping dtype, device and ``requires_grad``."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape != (weight.size(0),):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(weight, bias, group=group, gather_output=gather_output,
                    skip_bias_add=skip_bias_add, packed_chunks=packed_chunks,
                    packed_sections=packed_sections, input_copy=input_copy, w_grad=_requires_grad(weight),
                    b_grad=_requires_grad(bias))
        return self

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        packed_chunks: int = 1,
        packed_sections: tuple[int, ...] = (),
        input_copy: SharedInputCopy | None = None,
    ) -> "ColumnParallelLinear":
        """Shard ``linear`` (copies this rank's slice; never re-initializes)."""
        return cls.from_weight(linear.weight, linear.bias, group=group, gather_output=gather_output,
                               skip_bias_add=skip_bias_add, packed_chunks=packed_chunks,
                               packed_sections=packed_sections, input_copy=input_copy)

    # -- forward -----------------------------------------------------------------------
    def _gather(self, t: Tensor) -> Tensor:
        t = gather_from_tensor_parallel_region(t, self.group)
        if self.packed_chunks > 1 and self.tp_size > 1:
            # [r0: c0 c1 c2 | r1: c0 c1 c2 ...] -> [c0: r0 r1 .. | c1: ... ]
            local = self.weight.megastrategy_shard.sections()
            sizes = [padded // self.tp_size for _, _, padded in local]
            per_rank = t.unflatten(-1, (self.tp_size, self.output_size_per_partition)).split(sizes, dim=-1)
            t = torch.cat([c.flatten(-2) for c in per_rank], dim=-1)
        return t

    def forward(self, x: Tensor):
        x = column_parallel_input(self, x)
        add_bias = self.bias is not None and not self.skip_bias_add
        out = F.linear(x, self.weight, self.bias if add_bias else None)
        if self.gather_output:
            out = self._gather(out)
        if not self.skip_bias_add:
            return out
        bias = self.bias
        if bias is not None and self.gather_output:
            bias = self._gather(bias)
        return out, bias

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features} "
             f"(local {self.output_size_per_partition}), bias={self.bias is not None}, "
             f"tp={self.tp_size}, rank={self.tp_rank}")
        if self.packed_sections:
            s += f", packed_sections={self.packed_sections}"
        elif self.packed_chunks > 1:
            s += f", packed_chunks={self.packed_chunks}"
        if self.sequence_parallel:
            s += f", sequence_parallel=True (dim {self.sequence_dim})"
        if self.gather_output:
            s += ", gather_output=True"
        if self.skip_bias_add:
            s += ", skip_bias_add=True"
        return s


class RowParallelLinear(nn.Module):
    """``Y = all_reduce(X_local A_local^T) + b`` with ``A_local`` = this rank's columns.

    With ``input_is_parallel=False`` the (replicated) input is split over the last dim
    first. The bias is replicated and added after the all-reduce (returned separately
    with ``skip_bias_add=True``).

    ``sequence_parallel=True``: the partial products are reduce-scattered along
    ``sequence_dim`` (backward: all-gather) instead of all-reduced, so the output holds
    this rank's slice of the sequence; the bias is added to that slice (its gradient is
    then partial over the group and must be summed, see
    :func:`megastrategy.layers.sequence_parallel.allreduce_sequence_parallel_grads`).
    """

    @property
    def group(self):
        """The tensor-parallel process group."""
        return self._group_ref.group

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        full_w, full_b = init_linear_full(out_features, in_features, bias, device=device, dtype=dtype)
        self._setup(full_w, full_b, group=group, input_is_parallel=input_is_parallel,
                    skip_bias_add=skip_bias_add, w_grad=True, b_grad=True)
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)

    def _setup(self, full_w, full_b, *, group, input_is_parallel, skip_bias_add, w_grad, b_grad):
        out_features, in_features = full_w.shape
        tp = group_world_size(group)
        _check_divisible("in_features", in_features, tp, "the input size of a row-parallel layer")
        self.in_features = in_features
        self.out_features = out_features
        self._group_ref = ProcessGroupRef(group)
        self.tp_size = tp
        self.tp_rank = group_rank(group)
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = False
        self.sequence_dim = 0
        self.input_size_per_partition = in_features // tp
        spec = ShardSpec(dim=1, full_size=in_features, padded_size=in_features)
        self.weight = _param_from(shard_full_tensor(full_w, spec, self.tp_rank, tp), w_grad)
        set_shard_spec(self.weight, spec)
        if full_b is not None:
            self.bias = _param_from(full_b, b_grad)  # replicated: no ShardSpec
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_weight(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        *,
        group,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
    ) -> "RowParallelLinear":
        """Shard a full ``weight`` [out, in] over its input dim; ``bias`` [out] is copied
        whole. Keeps dtype, device and ``requires_grad``."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape != (weight.size(0),):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(weight, bias, group=group, input_is_parallel=input_is_parallel,
                    skip_bias_add=skip_bias_add, w_grad=_requires_grad(weight),
                    b_grad=_requires_grad(bias))
        return self

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
    ) -> "RowParallelLinear":
        """Shard ``linear`` (copies this rank's slice; never re-initializes)."""
        return cls.from_weight(linear.weight, linear.bias, group=group,
                               input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add)

    def forward(self, x: Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.group, self.sequence_dim)
        else:
            out = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        if self.skip_bias_add:
            return out, self.bias
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)  # like nn.Linear under autocast: the output keeps its dtype
        return out

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features} (local {self.input_size_per_partition}), "
             f"out_features={self.out_features}, bias={self.bias is not None}, "
             f"tp={self.tp_size}, rank={self.tp_rank}")
        if not self.input_is_parallel:
            s += ", input_is_parallel=False"
        if self.sequence_parallel:
            s += f", sequence_parallel=True (dim {self.sequence_dim})"
        if self.skip_bias_add:
            s += ", skip_bias_add=True"
        return s
