"""The experts of one MoE layer: independent two-layer FFNs, optionally split over expert-TP.

``Experts`` is an ``nn.ModuleDict`` keyed by the **global** expert index (``"0"`` ... ``"E-1"``),
so after expert-parallel sharding a rank holding experts 2 and 3 has parameters named
``experts.2.w1`` and ``experts.3.w1``: state-dict names stay global, as for pipeline stages.

One expert holds ``w1`` [F, H], ``b1`` [F], ``w2`` [H, F], ``b2`` [H] (plain parameters, not
``nn.Linear``, so tensor-parallel plans never mistake them for dense layers). With expert-TP
size ``etp`` a rank keeps rows ``[r*F/etp, (r+1)*F/etp)`` of ``w1``/``b1`` and the same columns
of ``w2`` (column- then row-parallel); ``b2`` is replicated over expert-TP and added once, after
the partial outputs are reduced (by the dispatcher's combine).

Every expert parameter carries an :class:`ExpertParamInfo` in its ``megastrategy_expert``
attribute: which global expert it belongs to and how it relates to the full tensor (for
gradient reduction, clipping and checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from megastrategy.layers.linear import init_linear_full
from megastrategy.layers.mappings import ProcessGroupRef, copy_to_tensor_parallel_region
from megastrategy.moe.dispatcher import group_world_size
from megastrategy.moe.expert_attr import EXPERT_ATTR

__all__ = ["EXPERT_ATTR", "ExpertParamInfo", "ExpertMLP", "Experts", "get_expert_info", "is_expert_parameter"]


@dataclass(frozen=True)
class ExpertParamInfo:
    expert: int  # global expert index
    name: str  # w1 | b1 | w2 | b2
    etp_dim: Optional[int]  # dim of the full tensor split over expert-TP (None: replicated over etp)
    etp_size: int = 1
    etp_rank: int = 0
    ep_dim: Optional[int] = None  # fused experts (one [E, ...] tensor): dim 0 split over the EP group
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def etp_replicated(self) -> bool:
        """The same tensor on every expert-TP rank (count it once in norms)."""
        return self.etp_dim is None and self.etp_size > 1


def get_expert_info(p: Tensor) -> Optional[ExpertParamInfo]:
    return getattr(p, EXPERT_ATTR, None)


def is_expert_parameter(p: Tensor) -> bool:
    return get_expert_info(p) is not None


_SPLIT_DIM = {"w1": 0, "b1": 0, "w2": 1, "b2": None}


class ExpertMLP(nn.Module):
    """One expert: ``act(x w1^T + b1) w2^T + b2`` (its slice of it under expert-TP)."""

    def __init__(self, index: int, hidden_size: int, ffn_hidden_size: int, bias: bool = True) -> None:
        super().__init__()
        self.index = index
        w1, b1 = init_linear_full(ffn_hidden_size, hidden_size, bias)
        w2, b2 = init_linear_full(hidden_size, ffn_hidden_size, bias)
        for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
            if t is None:
                self.register_parameter(name, None)
            else:
                self._set(name, t, 1, 0)

    def _set(self, name: str, full_or_local: Tensor, etp_size: int, etp_rank: int) -> None:
        p = nn.Parameter(full_or_local.detach().clone(memory_format=torch.contiguous_format))
        dim = _SPLIT_DIM[name]
        setattr(p, EXPERT_ATTR, ExpertParamInfo(self.index, name, dim, etp_size, etp_rank))
        setattr(self, name, p)

    def shard(self, etp_size: int, etp_rank: int) -> None:
        """Keep this expert-TP rank's slice (of the full, one-device tensors; never re-initialized)."""
        for name in ("w1", "b1", "w2", "b2"):
            p = getattr(self, name)
            if p is None:
                continue
            dim = _SPLIT_DIM[name]
            t = p.data
            if dim is not None and etp_size > 1:
                size = t.size(dim) // etp_size
                t = t.narrow(dim, etp_rank * size, size)
            requires_grad = p.requires_grad
            self._set(name, t, etp_size, etp_rank)
            getattr(self, name).requires_grad_(requires_grad)

    def forward(self, x: Tensor, activation: Callable[[Tensor], Tensor], add_output_bias: bool = True) -> Tensor:
        h = activation(F.linear(x, self.w1, self.b1))
        return F.linear(h, self.w2, self.b2 if add_output_bias else None)


class Experts(nn.ModuleDict):
    """This rank's experts (all of them before sharding), keyed by global index."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, bias: bool = True,
                 activation: Callable[[Tensor], Tensor] = F.gelu) -> None:
        super().__init__({str(e): ExpertMLP(e, hidden_size, ffn_hidden_size, bias) for e in range(num_experts)})
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.has_bias = bias
        # not registered even if it is an nn.Module: the dict's values must be the experts only
        self.__dict__["activation"] = activation
        self.etp_size = 1
        self._etp = ProcessGroupRef(None)

    @property
    def etp_group(self):
        return self._etp.group

    def shard(self, ep_size: int, ep_rank: int, etp_group=None, etp_rank: int = 0) -> None:
        """Keep experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``, each split over expert-TP."""
        etp_size = group_world_size(etp_group)
        local = self.num_experts // ep_size
        keep = set(range(ep_rank * local, (ep_rank + 1) * local))
        for key in list(self.keys()):
            if int(key) not in keep:
                del self[key]
        for m in self.values():
            m.shard(etp_size, etp_rank)
        self.etp_size = etp_size
        self._etp = ProcessGroupRef(etp_group)

    def forward(self, x: Tensor, tokens_per_expert: Sequence[int]) -> Tensor:
        """``x`` [R, H]: rows grouped by local expert, ``tokens_per_expert[i]`` rows for the i-th.

        Every local expert runs, also on zero rows, so that each expert parameter receives a
        gradient (zeros) in every backward: data-parallel wrappers and gradient hooks then see the
        same set of gradients every step. With expert-TP the outputs are partial sums, without
        the second bias (see :meth:`output_bias`).
        """
        add_b2 = self.etp_size == 1
        outs, start = [], 0
        for n, expert in zip(tokens_per_expert, self.values()):
            n = int(n)
            outs.append(expert(x[start : start + n], self.activation, add_output_bias=add_b2))
            start += n
        if start != x.size(0):
            raise RuntimeError(f"Experts: {x.size(0)} rows for {start} routed tokens")
        return torch.cat(outs, 0) if outs else x[:0]

    def output_bias(self) -> Optional[Tensor]:
        """[E_local, H]: the second biases, for the dispatcher to add after the expert-TP
        reduction (the gradient is all-reduced over expert-TP); None when etp == 1 or no bias."""
        if self.etp_size == 1 or not self.has_bias:
            return None
        b2 = torch.stack([m.b2 for m in self.values()])
        return copy_to_tensor_parallel_region(b2, self.etp_group)

    def extra_repr(self) -> str:
        return (f"local experts {[int(k) for k in self.keys()]} of {self.num_experts}, hidden={self.hidden_size}, "
                f"ffn={self.ffn_hidden_size}" + (f" (etp={self.etp_size})" if self.etp_size > 1 else ""))
