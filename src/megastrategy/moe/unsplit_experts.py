"""Refuse ``ep > 1`` for a Hugging Face model that declares experts but holds none we can split.

Expert parallelism splits what it recognises: :class:`~megastrategy.moe.layer.MoELayer`\\ s and
Hugging Face experts modules called with the routing (:mod:`.hf_experts`). Other layouts (DBRX's
experts flattened into 2-D ``w1``/``v1``/``w2``; JetMoE's ``ParallelExperts`` called with
per-expert counts; LongCat-Flash's zero-computation experts; Doge's expert embeddings) would run
at ``ep > 1`` with every expert whole on every rank: the losses still equal DDP's, but the user
asked for the experts to be split and nothing is, silently. The expert sweep
(tests/scripts/hf_sweep_experts.py) found such models; they are refused in setup instead.
"""
from __future__ import annotations

from typing import Iterator, Optional

from torch import nn

from megastrategy.anatomy import find_hf_model
from megastrategy.errors import MegatronConfigError

__all__ = ["EXPERT_COUNT_FIELDS", "declared_experts", "refuse_unsplit_experts"]

#: config fields (of the config or a sub-config) that count a model's routed experts
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _counts(values: dict, prefix: str) -> Iterator[tuple[str, int]]:
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _counts(value, f"{prefix}{key}.")
        elif key in EXPERT_COUNT_FIELDS and isinstance(value, int) and not isinstance(value, bool) and value > 1:
            yield f"{prefix}{key}", value


def declared_experts(config) -> Optional[tuple[str, int]]:
    """The first field of ``config`` (sub-configs included) that declares more than one expert."""
    return next(_counts(config.to_dict(), ""), None) if hasattr(config, "to_dict") else None


def _expert_module(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The first module whose class name says it holds experts, to name in the refusal."""
    return next(((n, m) for n, m in module.named_modules() if "expert" in type(m).__name__.lower()), None)


def refuse_unsplit_experts(module: nn.Module, ep: int, splits_some: bool) -> None:
    """Raise when ``ep > 1``, nothing in ``module`` is split (``splits_some`` is False) and its
    Hugging Face config declares experts."""
    if ep == 1 or splits_some:
        return
    hf = find_hf_model(module)[1]
    declared = declared_experts(getattr(hf, "config", None))
    if declared is None:
        return
    field, count = declared
    found = _expert_module(module)
    where = f"; its experts are in {found[0]!r} ({type(found[1]).__name__})" if found else ""
    raise MegatronConfigError(
        f"ep={ep}: {type(hf).__name__}'s config declares {count} experts (config.{field}), but none of its modules "
        f"holds them in a layout expert parallelism splits{where}. Split are: Hugging Face experts holding "
        "gate_up_proj (or up_proj) and down_proj as [num_experts, ...] tensors, called as experts(hidden_states, "
        "top_k_index, top_k_weights), and megastrategy.moe.MoELayer. At ep > 1 these experts would stay whole on "
        "every rank. Use ep=1 (tensor, pipeline and data parallelism work for this model), or build its MoE from "
        "megastrategy.moe.MoELayer.")
