"""``MoELayer``: a mixture-of-experts FFN that is an ordinary ``nn.Module`` on one device and
becomes expert-parallel in place when the strategy calls :meth:`MoELayer.shard`.

Forward on ``x`` [..., H]:

1. the router scores every token (all tokens of this data-parallel replica: under tensor
   parallelism the input is replicated over TP, so every TP rank routes the same tokens);
2. with a TP group of size > 1 the tokens are split over it (each TP rank dispatches its share:
   no token is processed twice, as with Megatron's sequence-parallel MoE);
3. the dispatcher sends each routed token to the rank of its expert (all-to-all over EP, plus
   all-gather over expert-TP), the local experts run, and the combine brings the outputs back
   weighted by the router;
4. the TP shares are all-gathered into the replicated output;
5. the auxiliary losses are attached to the output: their gradient, times
   :attr:`aux_loss_scale`, joins the backward pass without the user adding them to the loss.

Gradients of the router (a dense parameter) come out identical on every TP rank, and the
experts' gradients hold every token of the EP group exactly once; see
:mod:`megastrategy.moe.integration` for how they are reduced.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.mappings import ProcessGroupRef
from megastrategy.moe.dispatcher import (
    DISPATCHERS,
    narrow_rows,
    gather_tokens,
    group_rank,
    group_world_size,
    make_dispatcher,
    split_tokens,
)
from megastrategy.moe.experts import Experts
from megastrategy.moe.router import TopKRouter, attach_aux_loss

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """Top-k routed mixture of ``num_experts`` FFNs ``H -> ffn_hidden_size -> H``.

    Args:
        hidden_size, ffn_hidden_size: sizes of every expert's two linear layers.
        num_experts, top_k: experts, and experts per token.
        score: ``"softmax"`` (top-k probabilities, not renormalized) or ``"sigmoid"``
            (renormalized over the top k when k > 1).
        aux_loss_coeff: load-balancing loss ``E*coeff/(k*T^2) * sum_i P_i f_i`` (0 disables).
        z_loss_coeff: router z-loss ``coeff * mean logsumexp(logits)^2`` (0 disables).
        capacity_factor: each expert takes at most ``ceil(T*k/E*capacity_factor)`` tokens,
            dropping the lowest-scored; ``None`` = dropless.
        activation: the experts' nonlinearity (elementwise).
        bias: biases in the experts' linear layers.
        dispatcher: ``"alltoall"`` (default) or ``"allgather"``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        score: str = "softmax",
        aux_loss_coeff: float = 1e-2,
        z_loss_coeff: float = 0.0,
        capacity_factor: Optional[float] = None,
        activation: Callable[[Tensor], Tensor] = F.gelu,
        bias: bool = True,
        dispatcher: str = "alltoall",
    ) -> None:
        super().__init__()
        if dispatcher not in DISPATCHERS:
            raise MegatronConfigError(f"dispatcher={dispatcher!r}: use one of {sorted(DISPATCHERS)}.")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.dispatcher_kind = dispatcher
        self.router = TopKRouter(hidden_size, num_experts, top_k, score, aux_loss_coeff, z_loss_coeff, capacity_factor)
        self.experts = Experts(num_experts, hidden_size, ffn_hidden_size, bias, activation)
        self.dispatcher = make_dispatcher(dispatcher, num_experts)
        self._tp = ProcessGroupRef(None)  # group over which the (replicated) input is split
        #: Multiplies the auxiliary losses' gradient; the strategy sets it to the main loss's factor.
        self.aux_loss_scale = 1.0
        self.sharded = False
        self._recorded: dict[str, list[Tensor]] = {"aux": [], "z": []}
        self.last_tokens_per_expert: Optional[Tensor] = None

    # -- parallelism -----------------------------------------------------------------
    @property
    def ep_size(self) -> int:
        return self.dispatcher.ep_size

    @property
    def etp_size(self) -> int:
        return self.dispatcher.etp_size

    @property
    def tp_group(self):
        return self._tp.group

    def shard(self, *, ep_group=None, etp_group=None, tp_group=None) -> None:
        """Become expert-parallel in place: keep this rank's experts (its expert-TP slice of each),
        copied from the current one-device weights; dispatch over ``ep_group``/``etp_group``;
        split the replicated input over ``tp_group``. Collective-free."""
        if self.sharded:
            raise RuntimeError("MoELayer.shard: already sharded")
        ep, etp = group_world_size(ep_group), group_world_size(etp_group)
        if self.num_experts % ep:
            raise MegatronConfigError(
                f"num_experts={self.num_experts} is not divisible by ep={ep}: every expert-parallel rank holds "
                f"num_experts/ep experts. Use ep among the divisors of {self.num_experts}."
            )
        if self.ffn_hidden_size % etp:
            raise MegatronConfigError(
                f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by etp={etp}: every expert's FFN is split "
                f"over the expert-tensor-parallel ranks. Use etp among the divisors of {self.ffn_hidden_size}."
            )
        self.experts.shard(ep, group_rank(ep_group), etp_group, group_rank(etp_group))
        self.dispatcher = make_dispatcher(self.dispatcher_kind, self.num_experts, ep_group, etp_group)
        self._tp = ProcessGroupRef(tp_group)
        self.sharded = True

    # -- forward ---------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer: expected last dim {self.hidden_size}, got input of shape {tuple(shape)}")
        tokens = x.reshape(-1, self.hidden_size)
        route = self.router(tokens)
        self.last_tokens_per_expert = route.tokens_per_expert.detach()

        weights, indices, keep = route.weights, route.indices, route.keep
        local = tokens
        split = group_world_size(self.tp_group) > 1
        if split:  # every TP rank holds all tokens: each dispatches its share
            local = split_tokens(tokens, self.tp_group)
            weights = split_tokens(weights, self.tp_group)
            indices = narrow_rows(indices, self.tp_group)
            keep = narrow_rows(keep, self.tp_group) if keep is not None else None

        expert_in, counts, state = self.dispatcher.dispatch(local, indices, weights, keep)
        expert_out = self.experts(expert_in, counts)
        out = self.dispatcher.combine(expert_out, state, output_bias=self.experts.output_bias())
        if split:
            out = gather_tokens(out, tokens.size(0), self.tp_group)

        aux = [l for l in (route.aux_loss, route.z_loss) if l is not None]
        if aux:
            total = aux[0] if len(aux) == 1 else aux[0] + aux[1]
            out = attach_aux_loss(out, total, self.aux_loss_scale)
            if self.training and torch.is_grad_enabled():
                if route.aux_loss is not None:
                    self._recorded["aux"].append(route.aux_loss.detach())
                if route.z_loss is not None:
                    self._recorded["z"].append(route.z_loss.detach())
        return out.reshape(shape).to(x.dtype)

    # -- recorded losses ---------------------------------------------------------------
    def pop_recorded(self, kind: str = "aux") -> Optional[Tensor]:
        """Mean of the ``kind`` ("aux" or "z") losses of the training forwards since the last call; clears them."""
        values, self._recorded[kind] = self._recorded[kind], []
        if not values:
            return None
        return torch.stack([v.float() for v in values]).mean()

    def extra_repr(self) -> str:
        s = f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, experts={self.num_experts}, top_k={self.top_k}"
        if self.sharded:
            s += f", ep={self.ep_size}, etp={self.etp_size}, tp-split={group_world_size(self.tp_group)}"
        return s
