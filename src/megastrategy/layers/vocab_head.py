"""Vocab-parallel output head: a column-parallel linear over the padded vocabulary whose
output stays sharded, as :class:`VocabParallelLogits`."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.embedding import VocabParallelEmbedding, vocab_range
from megastrategy.layers.linear import init_linear_full
from megastrategy.layers.mappings import (
    ProcessGroupRef,
    SharedInputCopy,
    copy_to_tensor_parallel_region,
    group_rank,
    group_world_size,
)
from megastrategy.layers.shard_spec import (
    ShardSpec,
    padded_size_for,
    set_shard_spec,
    shard_full_tensor,
)
from megastrategy.layers.vocab_parallel_logits import VocabParallelLogits

__all__ = ["VocabParallelHead"]


class VocabParallelHead(nn.Module):
    """``logits_local = X W_local^T (+ b_local)`` over this rank's rows of the padded vocab.

    ``forward`` returns :class:`VocabParallelLogits` (never all-gathers b*s*V). Padding
    rows of the weight (and bias) are zeros. With ``tied_embedding`` the head uses the
    embedding's sharded ``weight`` Parameter itself, so tying survives sharding.

    Attributes: ``in_features``, ``out_features`` (= real vocab), ``padded_out_features``,
    ``vocab_start_index``, ``vocab_end_index``, ``weight``, ``bias``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group,
        bias: bool = True,
        input_copy: SharedInputCopy | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        full_w, full_b = init_linear_full(out_features, in_features, bias, device=device, dtype=dtype)
        self._setup(full_w, full_b, group=group, input_copy=input_copy, tied_embedding=None,
                    w_grad=True, b_grad=True)

    def _setup(self, full_w, full_b, *, group, input_copy, tied_embedding, w_grad, b_grad):
        vocab, in_features = full_w.shape
        tp = group_world_size(group)
        rank = group_rank(group)
        padded = padded_size_for(vocab, tp)
        self._group_ref = ProcessGroupRef(group)
        self.tp_size = tp
        self.tp_rank = rank
        self.in_features = in_features
        self.out_features = vocab
        self.padded_out_features = padded
        self.vocab_start_index, self.vocab_end_index = vocab_range(padded, rank, tp)
        self.input_copy = input_copy
        self.tied = tied_embedding is not None
        spec = ShardSpec(dim=0, full_size=vocab, padded_size=padded)
        if tied_embedding is not None:
            emb = tied_embedding
            if not isinstance(emb, VocabParallelEmbedding):
                raise MegatronConfigError(
                    f"tied_embedding={type(emb).__name__}: must be the VocabParallelEmbedding "
                    "the head's weight is tied to."
                )
            if (emb.num_embeddings, emb.embedding_dim, emb.tp_size, emb.tp_rank) != (vocab, in_features, tp, rank):
                raise MegatronConfigError(
                    f"tied_embedding is {emb.num_embeddings} x {emb.embedding_dim} on tp rank "
                    f"{emb.tp_rank}/{emb.tp_size}, the head is {vocab} x {in_features} on tp rank "
                    f"{rank}/{tp}: a tied head must match its embedding's vocab, hidden size and "
                    "tensor-parallel group."
                )
            self.weight = emb.weight  # the SAME Parameter object
        else:
            self.weight = nn.Parameter(
                shard_full_tensor(full_w, spec, rank, tp).detach().clone(memory_format=torch.contiguous_format),
                requires_grad=w_grad,
            )
            set_shard_spec(self.weight, spec)
        if full_b is not None:
            self.bias = nn.Parameter(
                shard_full_tensor(full_b, spec, rank, tp).detach().clone(memory_format=torch.contiguous_format),
                requires_grad=b_grad,
            )
            set_shard_spec(self.bias, spec)
        else:
            self.register_parameter("bias", None)

    @property
    def group(self):
        """The tensor-parallel process group."""
        return self._group_ref.group

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group,
        tied_embedding: VocabParallelEmbedding | None = None,
        input_copy: SharedInputCopy | None = None,
    ) -> "VocabParallelHead":
        """Shard ``linear`` ([vocab, hidden]) over the vocab; copies this rank's rows (or,
        with ``tied_embedding``, reuses that embedding's sharded weight Parameter)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        bias = linear.bias
        self._setup(linear.weight, bias, group=group, input_copy=input_copy,
                    tied_embedding=tied_embedding, w_grad=linear.weight.requires_grad,
                    b_grad=True if bias is None else bias.requires_grad)
        return self

    def forward(self, x: Tensor) -> VocabParallelLogits:
        if self.input_copy is not None:
            x = self.input_copy(x)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        local = F.linear(x, self.weight, self.bias)
        return VocabParallelLogits.from_local(
            local, vocab_size=self.out_features, vocab_start=self.vocab_start_index,
            padded_vocab_size=self.padded_out_features, group=self.group,
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab={self.out_features} (padded "
                f"{self.padded_out_features}, local rows [{self.vocab_start_index}, "
                f"{self.vocab_end_index})), bias={self.bias is not None}, tp={self.tp_size}, "
                f"rank={self.tp_rank}, tied={self.tied}")
