"""The user's own ``torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)``, made exact on a split model.

A common habit (Hugging Face scripts, manual optimization, ``on_before_optimizer_step``) is to clip
with torch's function instead of Trainer's ``gradient_clip_val``. Under tensor or pipeline
parallelism ``self.parameters()`` is this rank's shards and stage, so torch computes a local norm:
smaller than one device's, clipping less, and different on every rank (the replicas drift apart).

While the strategy trains, :class:`UserNormClipping` puts a function in torch's place that, when
the parameters belong to the split model, clips by the true global norm
(:func:`~megastrategy.ddp.grad_clip.clip_grad_norm_`: each shard and stage once, replicated
parameters and the tied copy of an embedding not twice) and returns that norm, as one device would.
Other parameters (not the model's) go to torch's own function. A call bound before the fit
(``from torch.nn.utils import clip_grad_norm_`` at import time) keeps torch's function: the
README says to call it through ``torch.nn.utils`` or to use ``self.clip_gradients``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.nn.utils import clip_grad as _clip_grad_module

from megastrategy.errors import MegatronConfigError

__all__ = ["UserNormClipping", "refuse_without_visible_grads"]

ClipFn = Callable[[list, float, float], torch.Tensor]


class UserNormClipping:
    """Replaces ``torch.nn.utils.clip_grad_norm_`` between :meth:`install` and :meth:`remove`.

    Args:
        model_params: the ids of the split model's parameters (this rank's), asked at each call.
        clip: ``(params, max_norm, norm_type) -> total norm``, collective over the model-parallel ranks.
    """

    def __init__(self, model_params: Callable[[], set], clip: ClipFn) -> None:
        self._model_params, self._clip = model_params, clip
        self._original: Optional[Callable[..., torch.Tensor]] = None

    def install(self) -> None:
        if self._original is not None:
            return
        self._original = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = self.clip_grad_norm_
        _clip_grad_module.clip_grad_norm_ = self.clip_grad_norm_

    def remove(self) -> None:
        if self._original is None:
            return
        for namespace in (torch.nn.utils, _clip_grad_module):
            if getattr(namespace, "clip_grad_norm_", None) == self.clip_grad_norm_:
                namespace.clip_grad_norm_ = self._original
        self._original = None

    def clip_grad_norm_(self, parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                        norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
        """torch's signature; the split model's parameters are clipped by their global norm."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ours = self._model_params()
        if not any(id(p) in ours for p in params):
            return self._original(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        total = self._clip(params, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped (error_if_nonfinite=True).")
        return total


def refuse_without_visible_grads(distributed_optimizer: bool) -> None:
    """With the distributed optimizer ``p.grad`` is not set (each rank holds a piece of the reduced
    gradient), so torch's clipping of ``p.grad`` would silently do nothing."""
    if distributed_optimizer:
        raise MegatronConfigError(
            "torch.nn.utils.clip_grad_norm_(model parameters) with use_distributed_optimizer=True: each rank holds "
            "only its piece of the reduced gradient, not p.grad, so clipping p.grad would change nothing. Clip through "
            "Lightning instead: Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm'), or "
            "self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm='norm') in the module.")


def parameter_ids(module: Any) -> set:
    """The ids of ``module``'s parameters (this rank's shards and stage)."""
    return {id(p) for p in module.parameters()} if module is not None else set()
