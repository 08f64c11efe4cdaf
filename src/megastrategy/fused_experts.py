"""Hugging Face's fused-experts convention, recognised by shape (shared by ``layers`` and ``moe``).

transformers 5.x keeps a sparse block's experts in one module with two 3-D parameters,
``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F], called as
``experts(hidden_states, top_k_index, top_k_weights)``. Tensor-parallel plans leave such a module
whole (every TP rank computes the same thing, which is exact); expert parallelism
(:mod:`megastrategy.moe.hf_experts`) splits it over ``ep``.
"""
from __future__ import annotations

import inspect

from torch import nn

__all__ = ["FUSED_EXPERT_PARAMS", "is_fused_experts"]

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
