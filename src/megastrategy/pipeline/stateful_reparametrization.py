"""Refuse reparametrizations that update their own state in every forward when pp runs the stages.

``torch.nn.utils.parametrizations.spectral_norm`` (and the older hook-based ``spectral_norm``) run one
power iteration per forward in training mode, updating the buffers ``_u``/``_v`` the weight is divided
by. One device runs the forward once per step; a pipeline stage runs it once per microbatch, and the
stage's set-up dry runs (which find the cut) run it too, so the weight of every step differs silently
from one device's (spectral_norm on an MLP Linear at pp2: 7e-3 off within 4 steps). Stateless ones
(``weight_norm``, ``orthogonal``) recompute the same weight each time and are exact: they pass (so
does a user's own parametrization: what its forward does to its buffers is not known here).
"""
from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.utils import parametrize

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_stateful_reparametrization"]


#: torch's parametrizations whose forward updates their buffers in training mode (``orthogonal`` holds a
#: ``base`` buffer it only reads: stateless)
_STATEFUL = ("_SpectralNorm",)


def _stateful(m: nn.Module) -> Optional[str]:
    """``"weight: _SpectralNorm"`` if ``m`` has a reparametrization updating its state, else None."""
    if parametrize.is_parametrized(m):
        for tensor, chain in m.parametrizations.items():
            for p in chain:
                if type(p).__name__ in _STATEFUL and type(p).__module__.startswith("torch.nn.utils"):
                    return f"{tensor}: {type(p).__name__}"
    for hook in m._forward_pre_hooks.values():
        if type(hook).__name__ == "SpectralNorm" and type(hook).__module__.startswith("torch.nn.utils"):
            return f"{getattr(hook, 'name', 'weight')}: SpectralNorm (hook)"
    return None


def refuse_stateful_reparametrization(module: nn.Module, pp: int) -> None:
    """Raise, naming the first such layer, if ``module`` has a stateful reparametrization."""
    for name, m in module.named_modules():
        found = _stateful(m)
        if found is None:
            continue
        raise MegatronConfigError(
            f"pp={pp}: {name!r} is reparametrized by {found}, which updates its own buffers in every forward "
            "(one power iteration per call); a pipeline stage runs the forward once per microbatch and in its "
            "set-up dry runs, one device once per step, so every step would differ silently from one "
            "device's. Use pp=1 (tensor parallelism with this layer replicated, or data parallelism), or a "
            "stateless reparametrization (torch.nn.utils.parametrizations.weight_norm)."
        )
