"""Combine one ``self.log`` name's per-microbatch values into the whole batch's value.

Under pipeline parallelism the user's step runs once per microbatch, so a ``self.log`` call
is made ``num_microbatches`` times per step. One device running the whole batch logs once, and
its ``reduce_fx`` says how Lightning combines *steps* of an epoch; the same function combines
the microbatches of a step, with ``mean`` weighted by each microbatch's batch size (as Lightning
weights steps). Applied to per-microbatch means, sums, maxima and minima this gives exactly the
value of the whole batch.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence, Union

import torch

from megastrategy.errors import MegatronConfigError

__all__ = ["combine_microbatches", "microbatch_size"]

ReduceFx = Union[str, Callable[..., Any]]
_NAMES = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_FUNCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def reduction_name(reduce_fx: ReduceFx) -> str:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"``: the reductions Lightning itself accepts."""
    name = _NAMES.get(reduce_fx) if isinstance(reduce_fx, str) else _FUNCTIONS.get(reduce_fx)
    if name is None:
        raise MegatronConfigError(
            f"self.log(..., reduce_fx={reduce_fx!r}) under pipeline parallelism: use 'mean', 'sum', 'max' or 'min' "
            "(or torch.mean/sum/max/min), which can be combined over microbatches exactly."
        )
    return name


def combine_microbatches(name: str, values: Sequence[tuple[float, int]], reduce_fx: ReduceFx) -> tuple[float, int]:
    """``values`` are ``(value, batch_size)`` per microbatch; returns (whole batch's value, its size)."""
    how = reduction_name(reduce_fx)
    total = sum(size for _, size in values)
    numbers = [v for v, _ in values]
    if how == "sum":
        return sum(numbers), total
    if how == "max":
        return max(numbers), total
    if how == "min":
        return min(numbers), total
    if total <= 0:
        raise MegatronConfigError(f"self.log({name!r}, ..., batch_size=0) under pipeline parallelism: nothing to average.")
    return sum(v * size for v, size in values) / total, total


def microbatch_size(microbatch: Any) -> int:
    """The batch size Lightning would infer for ``microbatch`` (1 when it cannot tell, as Lightning)."""
    from lightning.pytorch.utilities.data import extract_batch_size
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning warns about the whole batch itself
            return int(extract_batch_size(microbatch))
    except MisconfigurationException:
        return 1
