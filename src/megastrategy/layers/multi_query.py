"""Packed ``[q | k | v]`` projections whose key/value heads are too few to split over tensor
parallelism: multi-query attention (GPT-BigCode and Falcon with ``multi_query=True``, a user's
fused ``nn.Linear(d, (n_head + 2) * head_dim)``).

The packed output is ``[q: n_q·d | k: n_kv·d | v: n_kv·d]`` (``d`` the head size). The query heads
are split over TP as a column-parallel layer splits them; the one key/value head is needed by
every rank's queries, so each rank computes it whole (Megatron does the same when tp exceeds the
query groups). The projection's weight and bias stay whole on every rank (checkpoints, optimizer
state and exports unchanged); its forward reads rank r's rows ``[q_r | k | v]`` through an
identity whose backward sums the gradient over TP. A query row's gradient then comes from its one
rank, and a key/value row's is the sum of every rank's partial gradient (each rank's query heads
attend to the shared keys), which is the full model's gradient, so the replicas stay identical,
as :mod:`megastrategy.layers.grad_sum` keeps them. A multi-query attention with separate
projections (a declared ``colwise`` ``k_proj``/``v_proj`` of one head: Gemma-2B) keeps each key/value
projection whole the same way (``kv_whole``, :mod:`megastrategy.layers.hf_declared`); with several key/value
heads, fewer than tp (grouped-query: 2 at tp4), each rank reads the rows of the one head its query heads
read, the head replicated on tp/n_kv ranks (:mod:`megastrategy.layers.plan.kv_replication`). The input's gradient is summed over TP, as a
column-parallel layer's is; with sequence parallelism the input is gathered along the sequence as a
column-parallel layer gathers it (``sequence_parallel``, ``input_copy``: set by
:mod:`megastrategy.layers.sequence_parallel`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.linear import column_parallel_input
from megastrategy.layers.mappings import ProcessGroupRef, copy_to_tensor_parallel_region, group_rank, group_world_size
from megastrategy.layers.unit_types import is_conv1d

__all__ = ["MultiQueryLayout", "MultiQueryPackedLinear", "key_value_heads_of", "read_packed_qkv"]


@dataclass(frozen=True)
class MultiQueryLayout:
    """``q_heads`` query heads, then ``kv_heads`` key and ``kv_heads`` value heads, each ``head_dim`` wide;
    ``interleaved``: per key/value head its query heads, key and value instead (Falcon's grouped
    ``[kv_heads, q_heads/kv_heads + 2, head_dim]``)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    interleaved: bool = False

    @property
    def out_features(self) -> int:
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def sections(self) -> tuple[int, int, int]:
        """The output sizes of q, k and v."""
        kv = self.kv_heads * self.head_dim
        return (self.q_heads * self.head_dim, kv, kv)

    def local_rows(self, rank: int, world: int) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` segments of rank ``rank``'s rows: its query heads, then the key and the value
        rows of the key/value heads they read (adjacent segments merged)."""
        if self.q_heads % world:
            raise MegatronConfigError(
                f"tp={world} does not divide the {self.q_heads} query heads of a multi-query projection; "
                f"use a tensor-parallel size that divides {self.q_heads}."
            )
        if self.interleaved:
            return self._interleaved_rows(rank, world)
        q, kv, _ = self.sections
        local = q // world
        first, count = key_value_heads_of(rank, world, self.kv_heads)
        k = (q + first * self.head_dim, count * self.head_dim)
        return _merged(((rank * local, local), k, (k[0] + kv, k[1])))

    def _interleaved_rows(self, rank: int, world: int) -> tuple[tuple[int, int], ...]:
        """Rank ``rank``'s query rows inside its group's block, then that group's key and value rows; where
        ``world`` divides the groups, its whole groups."""
        first, count = key_value_heads_of(rank, world, self.kv_heads)
        per_group = self.q_heads // self.kv_heads
        block = (per_group + 2) * self.head_dim
        if count > 1 or world == self.kv_heads:
            return ((first * block, count * block),)
        local = self.q_heads // world * self.head_dim
        at = first * block
        return _merged(((at + rank % (world // self.kv_heads) * local, local), (at + per_group * self.head_dim, 2 * self.head_dim)))

    def as_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"q_heads": self.q_heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim}
        return {**extra, "interleaved": True} if self.interleaved else extra


def read_packed_qkv(op: str, width: int, parts: list[int], heads: set[int]) -> MultiQueryLayout | None:
    """The ``[q | k | v]`` layout of a packed projection ``width`` wide whose output the forward cuts
    first by ``op`` into ``parts`` (the last sizes of a ``split``; the last two of a ``view``), with
    the attention's head counts ``heads``; ``None`` when that is not such a layout.

    ``split`` into ``(n_q·d, n_kv·d, n_kv·d)`` (GPT-BigCode) or ``view`` as ``[n_q + 2·n_kv, d]``
    (Falcon's multi-query ``_split_heads``); ``n_q`` is one of the head counts, the largest that fits."""
    for q_heads in sorted(heads, reverse=True):
        layout = None
        if op == "split" and len(parts) == 3 and 0 < parts[1] == parts[2] < parts[0] and parts[0] % q_heads == 0:
            head_dim = parts[0] // q_heads
            if parts[1] % head_dim == 0:
                layout = MultiQueryLayout(q_heads, parts[1] // head_dim, head_dim)
        elif op == "view" and len(parts) == 2 and parts[0] > q_heads and (parts[0] - q_heads) % 2 == 0:
            kv_heads = (parts[0] - q_heads) // 2
            if kv_heads == 1 or kv_heads in heads:
                layout = MultiQueryLayout(q_heads, kv_heads, parts[1])
        if layout is not None and layout.out_features == width and q_heads % layout.kv_heads == 0:
            return layout
    return None


def key_value_heads_of(rank: int, world: int, kv_heads: int) -> tuple[int, int]:
    """``(first, count)`` of the key/value heads rank ``rank`` of ``world`` holds: its share where ``world``
    divides them, else the one head its query heads read (``world`` a multiple of them: replicated)."""
    if kv_heads % world == 0:
        return rank * (kv_heads // world), kv_heads // world
    if world % kv_heads == 0:
        return rank // (world // kv_heads), 1
    raise MegatronConfigError(
        f"tp={world} neither divides nor is a multiple of the {kv_heads} key/value heads: a rank's query heads "
        f"would read key/value heads of two ranks; use a tp that divides {kv_heads} or a multiple of it."
    )


def _merged(segments: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for start, length in segments:
        if out and sum(out[-1]) == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return tuple(out)


def _rows(t: Tensor, dim: int, segments: tuple[tuple[int, int], ...]) -> Tensor:
    return torch.cat([t.narrow(dim, *seg) for seg in segments], dim=dim)


class MultiQueryPackedLinear(nn.Module):
    """The user's packed projection (``nn.Linear``, or Hugging Face ``Conv1D`` stored ``[in, out]``)
    computing this rank's ``[q_r | k | v]``; its Parameters are the user's own, whole. With
    ``layout=None`` it is a key/value projection of its own (``k_proj`` of a grouped- or multi-query
    attention whose q/k/v are separate layers) holding ``kv_heads`` heads: every rank computes the
    rows of the head its query heads read (all rows for one head)."""

    def __init__(self, layer: nn.Module, layout: MultiQueryLayout | None, group, kv_heads: int = 1) -> None:
        super().__init__()
        self.transposed = is_conv1d(layer)
        out_features = layer.weight.shape[1 if self.transposed else 0]
        if layout is not None and out_features != layout.out_features:
            raise MegatronConfigError(
                f"a multi-query projection with {layout.q_heads} query and {layout.kv_heads} key/value heads of "
                f"size {layout.head_dim} has {layout.out_features} outputs, but this layer has {out_features}."
            )
        self.weight = layer.weight
        self.bias = layer.bias
        self.layout = layout
        self._group_ref = ProcessGroupRef(group)
        self.tp_rank, self.tp_size = group_rank(group), group_world_size(group)
        self.kv_heads = layout.kv_heads if layout is not None else kv_heads
        if layout is None:
            first, count = key_value_heads_of(self.tp_rank, self.tp_size, kv_heads)
            size = out_features // kv_heads
            self._segments = ((first * size, count * size),)
        else:
            self._segments = layout.local_rows(self.tp_rank, self.tp_size)
        self.input_copy: Any = None
        self.sequence_parallel, self.sequence_dim = False, 0

    @property
    def group(self):
        return self._group_ref.group

    def forward(self, x: Tensor) -> Tensor:
        x = column_parallel_input(self, x)
        weight = _rows(copy_to_tensor_parallel_region(self.weight, self.group), 1 if self.transposed else 0, self._segments)
        bias = None if self.bias is None else _rows(copy_to_tensor_parallel_region(self.bias, self.group), 0, self._segments)
        return F.linear(x, weight.t() if self.transposed else weight, bias)

    def extra_repr(self) -> str:
        lay = self.layout
        if lay is None:
            return f"key/value rows {self._segments}, kv_heads={self.kv_heads}, tp={self.tp_size}, rank={self.tp_rank}"
        return (f"q_heads={lay.q_heads} (local {lay.q_heads // self.tp_size}), kv_heads={lay.kv_heads}, rows {self._segments}, "
                f"head_dim={lay.head_dim}, tp={self.tp_size}, rank={self.tp_rank}")
