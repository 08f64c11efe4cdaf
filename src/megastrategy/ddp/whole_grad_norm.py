"""``grad_norm(module, norm_type)`` with one device's keys and values, for the documented logging recipe.

Lightning documents ``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step``
(``from lightning.pytorch.utilities import grad_norm``). Under tensor or pipeline parallelism that
function sees only this rank's tensors: a tp rank's per-parameter entries are norms of shards, a pp
stage has only its own parameters' keys, and the ``_total`` entry is this rank's norm. Rank 0 logs
what it computed, so the logged dict differed from one device's (README, "Gradient norms").

The name is bound when the user's file imports it, before any fit, so the strategy cannot put
another function in its place (as :mod:`megastrategy.ddp.user_clip` does for ``clip_grad_norm_``,
which is called through ``torch.nn.utils``). This function has the same signature and returns one
device's dict: ``from megastrategy import grad_norm`` instead. Each rank adds the ``p``-th powers
of what it counts (sharded parameters on every tp rank, replicated ones on tp rank 0, the last
stage's copy of a tied embedding never: the strategy's ``grad_counts_here``), the model-parallel
ranks exchange them by name, and every rank gets every parameter's whole norm and the total. Outside
a :class:`~megastrategy.MegatronStrategy` fit it is Lightning's own function.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import weakref

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["grad_norm", "TrainedModels"]


class TrainedModels:
    """The models a MegatronStrategy fit is training, each with its setup context, held weakly: the
    user may pass any submodule (``grad_norm(self.blocks, "inf")``), which knows no trainer."""

    _live: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()

    @classmethod
    def add(cls, model: nn.Module, ctx: Any) -> None:
        cls._live[model] = ctx

    @classmethod
    def remove(cls, model: nn.Module) -> None:
        cls._live.pop(model, None)

    @classmethod
    def context_of(cls, module: nn.Module) -> Any:
        """The setup context of the fit training ``module`` (or a model holding it), else None."""
        for model, ctx in list(cls._live.items()):
            if module is model or any(m is module for m in model.modules()):
                return ctx
        return None


def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict[str, torch.Tensor]:
    """Lightning's ``grad_norm`` over the whole model: ``{"grad_{p}_norm/<name>": norm, ..., "grad_{p}_norm_total": norm}``.

    Collective over the model-parallel ranks while a MegatronStrategy trains: call it on every rank
    (``on_before_optimizer_step`` runs on every rank)."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    from megastrategy.ddp.component import grad_counts_here

    ctx = TrainedModels.context_of(module)
    if ctx is None or ctx.parallel_state is None or ctx.parallel_state.tp_size * ctx.parallel_state.pp_size == 1:
        return lightning_grad_norm(module, norm_type, group_separator)
    if ctx.parallel_state.ep_size > 1:
        from megastrategy.errors import MegatronConfigError

        raise MegatronConfigError(
            f"megastrategy.grad_norm with ep={ctx.parallel_state.ep_size}: expert parameters differ between the "
            "expert-parallel ranks and are not gathered by name here. Log trainer.strategy.grad_norm() (the global "
            "norm, experts included), or Lightning's grad_norm(module) for this rank's tensors.")
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {p}")
    counts_here = grad_counts_here(ctx)
    mine = [(name, _power(prm.grad, p) if counts_here(prm) else None)
            for name, prm in module.named_parameters() if prm.grad is not None]
    merged = _merge(_gather(mine, ctx.parallel_state.mp_group), p)
    device = next((prm.grad.device for prm in module.parameters() if prm.grad is not None), torch.device("cpu"))
    norms = {f"grad_{p}_norm{group_separator}{name}": torch.tensor(v, device=device) for name, v in merged.items()}
    if norms:
        norms[f"grad_{p}_norm_total"] = torch.tensor(list(merged.values())).norm(p).to(device)
    return norms


def _power(grad: torch.Tensor, p: float) -> float:
    """What this rank adds for one parameter: ``|g|_p ** p``, or ``max |g|`` for the inf-norm."""
    g = grad.detach().float()
    return float(g.abs().max()) if p == float("inf") else float(g.norm(p) ** p)


def _gather(mine: list, group: Optional[dist.ProcessGroup]) -> list:
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return every


def _merge(every: list, p: float) -> dict:
    """Each parameter's norm from every rank's share, in the order the ranks name them (stage by stage)."""
    total: dict = {}
    for shares in every:
        for name, value in shares:
            if value is None:
                total.setdefault(name, None)
            elif total.get(name) is None:
                total[name] = value
            else:
                total[name] = max(total[name], value) if p == float("inf") else total[name] + value
    return {name: (v if p == float("inf") else v ** (1.0 / p)) for name, v in total.items() if v is not None}
