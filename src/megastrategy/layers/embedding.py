"""Vocab-parallel embedding: each tensor-parallel rank holds a contiguous block of rows.

The vocabulary ``V`` is padded with zero rows to ``Vp``, a multiple of the
tensor-parallel size ``tp``; rank ``r`` holds rows ``[r*Vp/tp, (r+1)*Vp/tp)``. Token ids
outside a rank's block look up row 0 and have their output zeroed, and the partial
outputs are summed with one all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.mappings import (
    ProcessGroupRef,
    group_rank,
    group_world_size,
    reduce_from_tensor_parallel_region,
)
from megastrategy.layers.shard_spec import (
    ShardSpec,
    padded_size_for,
    set_shard_spec,
    shard_full_tensor,
)

__all__ = ["VocabParallelEmbedding", "vocab_range"]


def vocab_range(padded_vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of the padded vocabulary owned by ``rank``."""
    per = padded_vocab_size // world
    return rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are split over the tensor-parallel group.

    Attributes: ``num_embeddings`` (the real vocab), ``padded_num_embeddings``,
    ``vocab_start_index``/``vocab_end_index`` (this rank's ``[start, end)`` in the padded
    vocab), ``embedding_dim``, ``padding_idx`` (non-negative, or None) and ``weight``
    (the local rows, ``[padded/tp, embedding_dim]``, with a ShardSpec).
    ``padding_idx`` behaves as in ``nn.Embedding``: its row gets no gradient.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group,
        padding_idx: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        padding_idx = self._norm_padding_idx(padding_idx, num_embeddings)
        full = torch.empty((num_embeddings, embedding_dim), device=device, dtype=dtype)
        nn.init.normal_(full)  # what nn.Embedding.reset_parameters does
        if padding_idx is not None:
            with torch.no_grad():
                full[padding_idx].fill_(0)
        self._setup(full, group=group, padding_idx=padding_idx, requires_grad=True)

    @staticmethod
    def _norm_padding_idx(padding_idx, num_embeddings):
        if padding_idx is None:
            return None
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise MegatronConfigError(
                f"padding_idx={padding_idx}: must be within [-{num_embeddings}, {num_embeddings})"
            )
        return padding_idx % num_embeddings

    def _setup(self, full: Tensor, *, group, padding_idx, requires_grad) -> None:
        num_embeddings, embedding_dim = full.shape
        tp = group_world_size(group)
        rank = group_rank(group)
        padded = padded_size_for(num_embeddings, tp)
        self._group_ref = ProcessGroupRef(group)
        self.tp_size = tp
        self.tp_rank = rank
        self.num_embeddings = num_embeddings
        self.padded_num_embeddings = padded
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.vocab_start_index, self.vocab_end_index = vocab_range(padded, rank, tp)
        spec = ShardSpec(dim=0, full_size=num_embeddings, padded_size=padded)
        local = shard_full_tensor(full, spec, rank, tp)
        self.weight = nn.Parameter(local.detach().clone(memory_format=torch.contiguous_format),
                                   requires_grad=requires_grad)
        set_shard_spec(self.weight, spec)
        if padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index:
            self._local_padding_idx = padding_idx - self.vocab_start_index
        else:
            self._local_padding_idx = None

    @property
    def group(self):
        """The tensor-parallel process group."""
        return self._group_ref.group

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, *, group) -> "VocabParallelEmbedding":
        """Shard ``emb`` (copies this rank's rows; never re-initializes)."""
        unsupported = {
            "max_norm": (emb.max_norm, None),
            "scale_grad_by_freq": (emb.scale_grad_by_freq, False),
            "sparse": (emb.sparse, False),
        }
        for name, (value, ok) in unsupported.items():
            if value != ok:
                raise MegatronConfigError(
                    f"nn.Embedding({name}={value!r}) cannot be vocab-parallel: {name} needs the "
                    f"whole vocabulary on one rank. Use {name}={ok!r} or replicate this embedding."
                )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(emb.weight, group=group, padding_idx=emb.padding_idx,
                    requires_grad=emb.weight.requires_grad)
        return self

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight, self._local_padding_idx)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local rows "
             f"[{self.vocab_start_index}, {self.vocab_end_index})), {self.embedding_dim}, "
             f"tp={self.tp_size}, rank={self.tp_rank}")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s
