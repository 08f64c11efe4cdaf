"""Lightning's model summary of the whole model, not of this rank's shards and stage.

``ModelSummary`` (and ``RichModelSummary``, and the one ``enable_model_summary=True`` adds) counts
``p.numel()`` over ``pl_module.parameters()``. Under tensor parallelism those are this rank's
shards, under pipeline parallelism this rank's stage: rank 0 printed about half of a tp2 model's
parameters, and a user reads the table to check the model they built. The callback computes its
summary on every rank (only rank 0 prints), so the strategy gives it :class:`WholeModelSummary`,
whose counts are summed over the model-parallel ranks: each shard once (a padded vocabulary's
padding rows left out), a parameter replicated over tp once, the tied copy of an embedding that
the last stage holds once in the total (its row still shows it, as one device's does). Under pp
the summary does not run ``example_input_array`` through the model: a stage cannot run the whole
forward alone (the in and out sizes show "?"); under tp every rank runs it, as the callback does.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as SummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn

from megastrategy.layers.shard_spec import get_shard_spec

__all__ = ["WholeModelSummary", "summarize_whole_models"]


def whole_count(p: nn.Parameter) -> float:
    """This rank's part of ``p``'s one-device size: its numel, less the padding of a padded shard."""
    spec = get_shard_spec(p)
    return p.numel() * spec.full_size / spec.padded_size if spec is not None else float(p.numel())


class WholeModelSummary(ModelSummary):
    """Lightning's summary with every count summed over ``group`` (rows by layer name, as rank 0 names them).

    Args:
        counted: whether this rank adds a parameter to the total (the gradient norm's rule:
            :func:`~megastrategy.ddp.component.grad_counts_here`).
        replicated_here: whether this rank adds a parameter to its layer's row (tp rank 0 for a
            parameter replicated over tp, every rank for a shard).
        staged: the model is a pipeline stage (its example forward is skipped).
    """

    def __init__(self, model: Any, max_depth: int, *, counted: Callable, replicated_here: Callable, group: Any,
                 staged: bool = False) -> None:
        self._staged = staged
        super().__init__(model, max_depth=max_depth)
        mine = {"rows": {name: _sum(layer._module.parameters(), replicated_here) for name, layer in self._layer_summary.items()},
                "total": _sum(model.parameters(), counted),
                "trainable": _sum((p for p in model.parameters() if p.requires_grad), counted)}
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        self._rows = {name: round(sum(r["rows"].get(name, 0.0) for r in every)) for name in mine["rows"]}
        self._total = round(sum(r["total"] for r in every))
        self._trainable = round(sum(r["trainable"] for r in every))

    def _forward_example_input(self) -> None:
        if not self._staged:
            super()._forward_example_input()

    @property
    def param_nums(self) -> list[int]:
        return [self._rows[name] for name in self._layer_summary]

    @property
    def total_parameters(self) -> int:
        return self._total

    @property
    def trainable_parameters(self) -> int:
        return self._trainable


def _sum(params, counts: Callable) -> float:
    seen, total = set(), 0.0
    for p in params:
        if id(p) not in seen and counts(p):
            seen.add(id(p))
            total += whole_count(p)
    return total


def summarize_whole_models(callbacks: list, *, counted: Callable, replicated_here: Callable, group: Any,
                           staged: bool) -> None:
    """Give every model-summary callback the whole model's counts (an instance attribute over its ``_summary``)."""
    for callback in callbacks:
        if isinstance(callback, SummaryCallback):
            def whole(trainer, pl_module, callback=callback):
                return WholeModelSummary(pl_module, callback._max_depth, counted=counted, replicated_here=replicated_here,
                                         group=group, staged=staged)

            callback._summary = whole
