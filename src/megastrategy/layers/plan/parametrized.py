"""Refuse sharding a layer whose weight a reparametrization computes (weight_norm, spectral_norm, ...).

A sharded layer is built from the tensor the user's layer returns as ``weight``, so torch's
``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``/``spectral_norm``/``orthogonal``, or
the user's own ``register_parametrization``) and the older hook-based ``torch.nn.utils.weight_norm``/
``spectral_norm`` were dropped: the layer then trained its plain weight, silently other numbers than
one device's (weight_norm on an MLP Linear at tp2 gave the losses of the model without it). Nor could
a shard compute them alone: a norm over a sharded dimension, or a spectral norm, needs the whole
weight. So such a layer is refused by name while the plan is resolved, naming what keeps it exact.
"""
from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.utils import parametrize

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan.context import PlanContext
from megastrategy.layers.plan.drafts import Drafts

__all__ = ["refuse_parametrized", "reparametrizations"]

#: torch's hook-based (pre-``parametrize``) reparametrizations, found among a module's forward pre-hooks
_HOOK_CLASSES = ("WeightNorm", "SpectralNorm")


def reparametrizations(m: nn.Module) -> list[str]:
    """``"weight: _WeightNorm"`` for each reparametrized tensor of ``m`` itself (both APIs)."""
    found = []
    if parametrize.is_parametrized(m):
        for tensor, chain in m.parametrizations.items():
            found.append(f"{tensor}: {', '.join(type(p).__name__ for p in chain)}")
    for hook in m._forward_pre_hooks.values():
        if type(hook).__name__ in _HOOK_CLASSES and type(hook).__module__.startswith("torch.nn.utils"):
            found.append(f"{getattr(hook, 'name', 'weight')}: {type(hook).__name__} (hook)")
    return found


def _removal(found: list[str]) -> str:
    if any("(hook)" in f for f in found):
        return "torch.nn.utils.remove_weight_norm(module) / remove_spectral_norm(module)"
    return "torch.nn.utils.parametrize.remove_parametrizations(module, 'weight')"


def _first_reparametrized(m: nn.Module, name: str) -> Optional[tuple[str, list[str]]]:
    for sub, inner in m.named_modules(prefix=name):
        found = reparametrizations(inner)
        if found:
            return sub, found
    return None


def refuse_parametrized(ctx: PlanContext, drafts: Drafts) -> None:
    """Raise if a layer the plan shards (or a layer inside it) has a reparametrized tensor."""
    for n, d in drafts.items():
        if d.style == "replicate":
            continue
        hit = _first_reparametrized(ctx.modules[n], n)
        if hit is None:
            continue
        where, found = hit
        raise MegatronConfigError(
            f"tp={ctx.tp_size}: {where!r} is reparametrized ({'; '.join(found)}) and the plan shards {n!r} "
            f"({d.style}, from {d.source}): a shard is built from the computed weight, so the "
            "reparametrization would be dropped and every step would differ silently from one device's. "
            f"Keep it whole with tp_plan={{{n!r}: 'replicate'}} (and replicate the layers that read its "
            f"output or feed its input sharded), remove it before fit with {_removal(found)}, or use tp=1."
        )
