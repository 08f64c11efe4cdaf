"""Expert parallelism for Hugging Face's fused experts (Mixtral, Qwen3-MoE, OLMoE, ... in transformers 5.x).

transformers 5.x keeps a sparse block's experts in one module holding two 3-D parameters,
``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F], called as
``experts(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k])`` after the block's own
router. With ``ep > 1`` that module is replaced by :class:`FusedExpertsParallel`: the same
parameter names, holding this rank's ``E/ep`` experts (dim 0 split over the expert-parallel
group), and this project's all-to-all dispatcher moving each routed token to the rank of its
expert and back. The router, top-k, the weights and the auxiliary loss stay the Hugging Face
model's own code, so training equals one device's. Routed experts in another layout (GPT-OSS's
transposed, biased, interleaved ones) or with a gate of their own (``_apply_gate``: clamped or
soft-capped SwiGLUs) get :class:`RoutedExpertsParallel`: the same dispatch, and the module's own
forward on the rank's experts. Experts that are not routed per token (Llama 4)
are refused under ``ep > 1`` rather than left whole on every rank.
"""
from __future__ import annotations

import copy
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from megastrategy.errors import MegatronConfigError
from megastrategy.fused_experts import (
    FUSED_EXPERT_PARAMS, holds_unrouted_experts, is_fused_experts, is_routed_experts, num_experts_of,
)
from megastrategy.moe.dispatcher import (
    AllToAllDispatcher, narrow_rows, gather_tokens, group_rank, group_world_size, split_tokens,
)
from megastrategy.moe.expert_attr import EXPERT_ATTR
from megastrategy.moe.experts import ExpertParamInfo

__all__ = ["FusedExpertsParallel", "RoutedExpertsParallel", "fused_experts", "is_fused_experts", "plain_gating",
           "shard_fused_experts", "validate_fused_experts"]

def fused_experts(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every experts module expert parallelism splits: the fused convention and other routed layouts."""
    for name, m in module.named_modules():
        if is_fused_experts(m) or is_routed_experts(m):
            yield name, m


def validate_fused_experts(module: nn.Module, layout) -> None:
    """Refuse, before any group exists, fused experts that ``layout`` cannot split exactly."""
    if layout.ep == 1:
        return
    for name, m in module.named_modules():
        if holds_unrouted_experts(m):
            raise MegatronConfigError(
                f"ep={layout.ep}: the experts {name!r} ({type(m).__name__}) are not called with the routing "
                "(experts(hidden_states, top_k_index, top_k_weights)): their forward takes the tokens only and runs "
                "every expert on them, so they cannot be split by expert and would stay whole on every rank. Use ep=1 "
                "(pipeline and data parallelism work for this model), or build its MoE from megastrategy.moe.MoELayer.")
    for name, m in fused_experts(module):
        experts = num_experts_of(m)
        if experts % layout.ep:
            raise MegatronConfigError(
                f"ep={layout.ep}: the experts {name!r} hold {experts} experts, not divisible by ep (each expert-parallel "
                f"rank holds whole experts). Use ep among the divisors of {experts}.")
        if layout.etp != 1:
            raise MegatronConfigError(
                f"etp={layout.etp}: Hugging Face fused experts ({name!r}) are split over experts only; splitting each "
                f"expert's FFN (expert tensor parallelism) is not supported for them. Pass etp=1 (it defaults to tp).")


class FusedExpertsParallel(nn.Module):
    """This rank's slice of a fused-experts module, fed by an all-to-all over the EP group."""

    expert_parallel = True  # already split: not a candidate for splitting again

    def __init__(self, original: nn.Module, *, ep_group, tp_group=None) -> None:
        super().__init__()
        ep, rank = group_world_size(ep_group), group_rank(ep_group)
        self.num_experts = original.gate_up_proj.size(0)
        self.num_local_experts = self.num_experts // ep
        self.act_fn = original.act_fn
        for name in FUSED_EXPERT_PARAMS:
            full: Tensor = getattr(original, name)
            local = full.detach().narrow(0, rank * self.num_local_experts, self.num_local_experts).clone()
            p = nn.Parameter(local, requires_grad=full.requires_grad)
            setattr(p, EXPERT_ATTR, ExpertParamInfo(-1, name, None, ep_dim=0, ep_size=ep, ep_rank=rank))
            setattr(self, name, p)
        self.dispatcher = AllToAllDispatcher(self.num_experts, ep_group)
        self._tp_group = tp_group

    def _run_local_experts(self, rows: Tensor, tokens_per_expert: list[int]) -> Tensor:
        # every local expert runs, also on zero rows, so each parameter gets a gradient every step
        outs, start = [], 0
        for e, n in enumerate(tokens_per_expert):
            x = rows[start : start + int(n)]
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
            start += int(n)
        return torch.cat(outs, 0)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        tokens, indices, weights = hidden_states, top_k_index, top_k_weights
        split = group_world_size(self._tp_group) > 1
        if split:  # every TP rank holds all tokens: each dispatches its share
            tokens = split_tokens(hidden_states, self._tp_group)
            weights = split_tokens(top_k_weights, self._tp_group)
            indices = narrow_rows(top_k_index, self._tp_group)
        rows, counts, state = self.dispatcher.dispatch(tokens, indices, weights)
        out = self.dispatcher.combine(self._run_local_experts(rows, counts), state)
        if split:
            out = gather_tokens(out, hidden_states.size(0), self._tp_group)
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"local experts {self.num_local_experts} of {self.num_experts} (ep={self.dispatcher.ep_size})"


class RoutedExpertsParallel(FusedExpertsParallel):
    """This rank's slice of routed experts in a layout of their own (GPT-OSS): every per-expert
    parameter narrowed to the rank's experts under its own name, and the module's own forward (a
    copy sharing those parameters, not registered) run on the dispatched rows, each routed to its
    local expert with weight 1; the dispatcher applies the router's weights when it combines."""

    def __init__(self, original: nn.Module, *, ep_group, tp_group=None) -> None:
        nn.Module.__init__(self)
        ep, rank = group_world_size(ep_group), group_rank(ep_group)
        self.num_experts = num_experts_of(original)
        self.num_local_experts = n = self.num_experts // ep
        local = {}
        for name, full in original.named_parameters(recurse=False):
            p = nn.Parameter(full.detach().narrow(0, rank * n, n).clone(), requires_grad=full.requires_grad)
            setattr(p, EXPERT_ATTR, ExpertParamInfo(-1, name, None, ep_dim=0, ep_size=ep, ep_rank=rank))
            setattr(self, name, p)
            local[id(full)] = p
        twin = copy.deepcopy(original, local)  # the same code and settings, on the local parameters
        if isinstance(getattr(twin, "num_experts", None), int):
            twin.num_experts = n
        self._local = [twin]  # a list: its parameters are registered here, under the original names
        self.dispatcher = AllToAllDispatcher(self.num_experts, ep_group)
        self._tp_group = tp_group

    def _run_local_experts(self, rows: Tensor, tokens_per_expert: list[int]) -> Tensor:
        counts = torch.tensor(tokens_per_expert, device=rows.device)
        index = torch.repeat_interleave(torch.arange(len(tokens_per_expert), device=rows.device), counts)
        out = self._local[0](rows, index.unsqueeze(1), rows.new_ones(rows.size(0), 1))
        # every parameter in the graph, also when no row came here: each gets a gradient every step
        return out + sum(p.reshape(-1)[0] for p in self.parameters()) * 0.0


def plain_gating(m: nn.Module) -> bool:
    """Whether fused experts gate as :class:`FusedExpertsParallel` computes, ``act_fn(gate) * up``.
    Experts with a gate of their own (``_apply_gate``: clamped SwiGLU in DeepSeek-V4, Step-3.7, HunYuan-V4,
    MiniMax-M3; a two-input soft-capped one in Inkling-2) or without ``act_fn`` run their own code
    on the rank's experts instead (:class:`RoutedExpertsParallel`), rather than a different gate."""
    return callable(getattr(m, "act_fn", None)) and not hasattr(m, "_apply_gate")


def shard_fused_experts(module: nn.Module, parallel_state) -> int:
    """Replace every fused-experts module by its expert-parallel slice (``ep > 1``); returns how many."""
    if parallel_state.ep_size == 1:
        return 0
    found = list(fused_experts(module))
    for name, m in found:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        kind = FusedExpertsParallel if is_fused_experts(m) and plain_gating(m) else RoutedExpertsParallel
        setattr(parent, attr, kind(m, ep_group=parallel_state.ep_group, tp_group=parallel_state.tp_group))
    return len(found)
