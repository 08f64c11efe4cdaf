"""Per-head bias tables under tensor parallelism (T5's relative position bias).

T5's layer 0 looks its attention bias up in an ``nn.Embedding`` of ``[buckets, heads]`` and
hands the resulting ``[1, heads, q, k]`` bias to every later layer as ``position_bias``. With the
heads split over TP, each rank needs the columns of its own heads:

* ``head_table`` (on the Embedding, or a module holding a ``[positions, heads]`` table, as
  Swin's relative position bias): the table stays whole on every rank (checkpoints unchanged);
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


def narrow_head_table(table: nn.Module, group, heads: int) -> nn.Module:
    """``table``'s output keeps this rank's heads (an Embedding's last dimension; a bias module's
    ``[1, heads, q, k]``, as Swin's, by :func:`_narrow_heads`); its gradient is summed over TP."""
    ref = ProcessGroupRef(group)
    embedding = isinstance(table, nn.Embedding)

    def narrow(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        start, local = _local(ref, heads)
        if embedding:
            return output.narrow(-1, start, local)
        return _narrow_heads(output, heads, None, start, local)

    sum_grads_over_tp(table, group)
    table.register_forward_hook(narrow)
    return table


def _narrow_heads(bias: Tensor, heads: int, batch: int | None, start: int, local: int) -> Tensor | None:
    """``bias`` with only heads ``start .. start + local``, read where it holds all ``heads``:
    dimension 1 of ``[batch, heads, q, k]`` (T5), dimension 0 of ``[heads, q, k]`` (MPT's ALiBi, the
    same for every example), or ``[batch * heads, q, k]`` (Bloom's ALiBi, example-major); ``None``
    when it does not hold them all (already local)."""
    if bias.dim() >= 4:
        return bias.narrow(1, start, local) if bias.shape[1] == heads else None
    if bias.dim() != 3:
        return None
    if bias.shape[0] == heads:
        return bias.narrow(0, start, local)
    if batch is not None and batch > 1 and bias.shape[0] == batch * heads:
        return bias.unflatten(0, (batch, heads)).narrow(1, start, local).flatten(0, 1)
    return None


def narrow_head_bias_input(attention: nn.Module, group, heads: int, kwarg: str) -> nn.Module:
    """A ``kwarg`` tensor with all ``heads`` (see :func:`_narrow_heads`) is narrowed to this rank's
    heads; the batch size is read off the hidden states (the first argument)."""
    ref = ProcessGroupRef(group)

    def narrow(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        bias = kwargs.get(kwarg)
        if not isinstance(bias, Tensor):
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        batch = hidden.shape[0] if isinstance(hidden, Tensor) and hidden.dim() > 0 else None
        start, local = _local(ref, heads)
        narrowed = _narrow_heads(bias, heads, batch, start, local)
        return None if narrowed is None else (args, dict(kwargs, **{kwarg: narrowed}))

    attention.register_forward_pre_hook(narrow, with_kwargs=True)
    return attention
