"""Sum-reduced losses under pipeline microbatches, said out loud.

One device's ``F.cross_entropy(..., reduction="sum")`` sums over the whole batch. Under pp the
step runs once per microbatch and the microbatch losses are averaged, as Lightning's gradient
accumulation averages them, so a summed loss returned as it is gives ``1/m`` of one device's loss
and gradients. Divided by the step's own ``len(batch)`` it is exactly one device's mean, and a
summed term added to a mean is neither: the call alone cannot tell these apart, so nothing is
rewritten. Instead the first such call of each loss function in each kind of step warns once,
naming the function, the step and ``m``, and what is exact.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from megastrategy.rank_zero import log_on_rank_zero

__all__ = ["SummedLosses", "WATCHED"]

_log = logging.getLogger(__name__)
#: ``torch.nn.functional`` losses with a ``reduction`` argument (their ``nn.*Loss`` modules call them)
WATCHED = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
           "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div")


def _reduction(kwargs: dict[str, Any]) -> str:
    """The reduction a call asked for, the deprecated ``size_average``/``reduce`` included."""
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        return torch.nn._reduction.legacy_get_string(kwargs.get("size_average"), kwargs.get("reduce"))
    return kwargs.get("reduction", "mean")


class SummedLosses:
    """Warns once per (step, loss function) when a pipelined step with several microbatches calls a
    loss of ``torch.nn.functional`` with ``reduction="sum"``. Lives as long as the step runner."""

    def __init__(self) -> None:
        self._warned: set[tuple[str, str]] = set()

    @contextmanager
    def step(self, step_name: str, num_microbatches: int) -> Iterator[None]:
        """Around one pipelined step: the losses of ``F`` are watched while it runs."""
        originals = {name: getattr(F, name) for name in WATCHED}
        for name, func in originals.items():
            setattr(F, name, self._watched(name, func, step_name, num_microbatches))
        try:
            yield
        finally:
            for name, func in originals.items():
                setattr(F, name, func)

    def _watched(self, name: str, func: Callable, step_name: str, m: int) -> Callable:
        def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            if _reduction(kwargs) == "sum" and (step_name, name) not in self._warned:
                self._warned.add((step_name, name))
                self._warn(name, step_name, m)
            return func(*args, **kwargs)

        loss.__wrapped__ = func
        return loss

    @staticmethod
    def _warn(name: str, step_name: str, m: int) -> None:
        log_on_rank_zero(_log, logging.WARNING, (
            f"megastrategy: {step_name} calls F.{name}(..., reduction='sum') under pipeline parallelism with "
            f"{m} microbatches: each call sums over one microbatch (1/{m} of the batch) and the step's loss is the "
            f"mean of the microbatch losses, as Lightning's gradient accumulation averages them. Returned as it is, "
            f"the summed loss and its gradients are 1/{m} of one device's. Exact: a sum divided by the step's own "
            f"len(batch) (a mean), reduction='mean', or MegatronStrategy(num_microbatches=1)."))
