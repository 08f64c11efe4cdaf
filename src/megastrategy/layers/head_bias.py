"""Per-head bias tables under tensor parallelism (T5's relative position bias).

T5's layer 0 looks its attention bias up in an ``nn.Embedding`` of ``[buckets, heads]`` and
hands the resulting ``[1, heads, q, k]`` bias to every later layer as ``position_bias``. With the
heads split over TP, each rank needs the columns of its own heads:

* ``head_table`` (on the Embedding): the table stays whole on every rank (checkpoints unchanged);
  its output is narrowed to this rank's heads, and its gradient -- nonzero only in those
  columns -- is summed over TP (:mod:`megastrategy.layers.grad_sum`), which is the full
  gradient, so the replicas stay identical.
* ``head_bias_input`` (on the attention module): a bias argument that arrives with all heads
  is narrowed to this rank's. In training the bias is already local (layer 0 computed it from
  the narrowed table); the setup-time block check feeds a later layer the unsharded run's
  full-head bias, which this makes comparable.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from megastrategy.layers.grad_sum import sum_grads_over_tp
from megastrategy.layers.mappings import ProcessGroupRef

__all__ = ["narrow_head_table", "narrow_head_bias_input"]


def _local(group_ref: ProcessGroupRef, heads: int) -> tuple[int, int]:
    """(first head, local heads) of this rank."""
    import torch.distributed as dist

    group = group_ref.group
    local = heads // dist.get_world_size(group)
    return dist.get_rank(group) * local, local


def narrow_head_table(table: nn.Embedding, group, heads: int) -> nn.Embedding:
    """``table``'s output keeps this rank's head columns; its gradient is summed over TP."""
    ref = ProcessGroupRef(group)

    def narrow(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        start, local = _local(ref, heads)
        return output.narrow(-1, start, local)

    sum_grads_over_tp(table, group)
    table.register_forward_hook(narrow)
    return table


def narrow_head_bias_input(attention: nn.Module, group, heads: int, kwarg: str) -> nn.Module:
    """A ``kwarg`` tensor with all ``heads`` on dimension 1 is narrowed to this rank's heads."""
    ref = ProcessGroupRef(group)

    def narrow(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        bias = kwargs.get(kwarg)
        if not isinstance(bias, Tensor) or bias.dim() < 2 or bias.shape[1] != heads:
            return None
        start, local = _local(ref, heads)
        return args, dict(kwargs, **{kwarg: bias.narrow(1, start, local)})

    attention.register_forward_pre_hook(narrow, with_kwargs=True)
    return attention
