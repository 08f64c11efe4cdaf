"""Hugging Face's fused-experts convention, recognised by shape (shared by ``layers`` and ``moe``).

transformers 5.x keeps a sparse block's experts in one module with two 3-D parameters,
``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F], called as
``experts(hidden_states, top_k_index, top_k_weights)``. Tensor-parallel plans leave such a module
whole (every TP rank computes the same thing, which is exact); expert parallelism
(:mod:`megastrategy.moe.hf_experts`) splits it over ``ep``.

Other layouts of routed experts (GPT-OSS: ``gate_up_proj`` [E, H, 2F] with biases, gate and up
interleaved, a clamped activation; NemotronH: ``up_proj`` [E, F, H], no gate) are called the same way: :func:`is_routed_experts` finds them,
and expert parallelism runs the module's own code on the rank's experts. Experts that are not
called with the routing (Llama 4's run every expert on every token, scaled beforehand) cannot be
split by expert: :func:`holds_unrouted_experts` finds them, to be refused under ``ep > 1``.
"""
from __future__ import annotations

import inspect

from torch import nn

__all__ = ["FUSED_EXPERT_PARAMS", "FIRST_PROJECTIONS", "holds_expert_weights", "num_experts_of", "holds_unrouted_experts", "is_fused_experts", "is_routed_experts"]

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_fused_experts(m: nn.Module) -> bool:
    """Whether ``m`` follows the convention (and is not already split by expert parallelism)."""
    gate_up, down = (getattr(m, n, None) for n in FUSED_EXPERT_PARAMS)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)) or getattr(m, "expert_parallel", False):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.size(0) != down.size(0):
        return False
    _, two_f, h = gate_up.shape
    if tuple(down.shape[1:]) != (h, two_f // 2) or two_f % 2:
        return False
    return len(inspect.signature(m.forward).parameters) == 3


#: the first projection of routed experts: gate and up fused (most), or up alone (NemotronH's ungated MLP)
FIRST_PROJECTIONS = ("gate_up_proj", "up_proj")


def _expert_weights(m: nn.Module) -> list[nn.Parameter]:
    """``m``'s own parameters when it holds ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` as
    3-D tensors over the same number of experts and every other one of its parameters is per expert
    too; else []."""
    own = dict(m.named_parameters(recurse=False))
    name = next((n for n in FIRST_PROJECTIONS if n in own), None)
    if name == "up_proj" and len(inspect.signature(m.forward).parameters) != 3:
        return []  # stacked shared experts run on every token (Inkling's): dense, not routed experts
    first, down = own.get(name), own.get("down_proj")
    if first is None or down is None or first.dim() != 3 or down.dim() != 3 or getattr(m, "expert_parallel", False):
        return []
    experts = down.size(0)
    return list(own.values()) if all(p.dim() >= 2 and p.size(0) == experts for p in own.values()) else []


def num_experts_of(m: nn.Module) -> int:
    """How many experts an experts module holds (its ``down_proj``'s first dimension)."""
    return m.down_proj.size(0)


def holds_expert_weights(m: nn.Module) -> bool:
    """Any experts module, fused or not (its own ``gate_up_proj``/``down_proj`` [E, ...], every
    own parameter per expert): tensor-parallel plans leave it whole on every rank, which is exact."""
    return bool(_expert_weights(m))


def is_routed_experts(m: nn.Module) -> bool:
    """Experts in another layout than the fused convention, called as
    ``experts(hidden_states, top_k_index, top_k_weights)`` (GPT-OSS)."""
    return (not is_fused_experts(m) and bool(_expert_weights(m))
            and len(inspect.signature(m.forward).parameters) == 3)


def holds_unrouted_experts(m: nn.Module) -> bool:
    """Per-expert weights (``gate_up_proj``/``down_proj`` [E, ...]) in a module not called with the
    routing (Llama 4's experts take the tokens only): expert parallelism cannot split it."""
    return holds_expert_weights(m) and not is_fused_experts(m) and not is_routed_experts(m)
