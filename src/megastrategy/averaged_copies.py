"""Copies of the model that weights are averaged into (SWA, EMA) must be copies of the rank's
sharded model, parameter for parameter.

Lightning's ``StochasticWeightAveraging`` deep-copies the module in its ``setup`` hook, which runs
before the strategy shards and cuts the module; its averaging then zips the unsharded copy's
parameters with the rank's shards (a shape error under tp, the wrong blocks averaged under pp).
:func:`copy_sharded_for_swa` makes that copy again from the sharded module: each rank averages its
own shards, which is elementwise, so it equals the average of the whole model. A resumed run loads
each rank's saved averaged weights into it (:mod:`megastrategy.checkpoint.swa_state`).

A ``torch.optim.swa_utils.AveragedModel`` the user builds in ``__init__`` (an EMA of a submodule) is
the same unsharded copy, but inside the module, where no plan shards it:
:func:`refuse_unsharded_averaged_models` names it before any work, and what works instead. One
built in ``on_fit_start`` trains right (each rank averages its shards), but its copies carry no
shard description (``copy.deepcopy`` of a parameter drops it) and, under pp, stage-local names, so a
sharded checkpoint would hold rank 0's part of it as if whole: :func:`warn_averaged_models_in_checkpoint`
says so when a checkpoint is written.
"""
from __future__ import annotations

import warnings
from copy import deepcopy
from typing import Any

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["copy_sharded_for_swa", "refuse_unsharded_averaged_models", "warn_averaged_models_in_checkpoint"]


def copy_sharded_for_swa(trainer: Any, module: nn.Module) -> None:
    """Point every ``StochasticWeightAveraging`` callback's average model at a copy of ``module`` as
    this rank holds it (after tensor and pipeline parallelism rewrote it)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from megastrategy.checkpoint.swa_state import HELD_ATTR

    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging) and getattr(callback, "_average_model", None) is not None:
            callback._average_model = deepcopy(module)
            held = callback.__dict__.pop(HELD_ATTR, None)  # this rank's averaged weights, resumed
            if held is not None:
                callback._average_model.load_state_dict(held)


def refuse_unsharded_averaged_models(module: nn.Module, tp: int, pp: int) -> None:
    """At tp > 1 or pp > 1, refuse an ``AveragedModel`` registered inside ``module``: it holds an
    unsharded copy of layers the rank holds sharded (or not at all), so its ``update_parameters``
    would fail on shapes or average the wrong layers."""
    if tp == 1 and pp == 1:
        return
    from torch.optim.swa_utils import AveragedModel

    found = [name for name, sub in module.named_modules() if isinstance(sub, AveragedModel)]
    if found:
        raise MegatronConfigError(
            f"module has an AveragedModel registered at {found[0]!r} (made before the strategy split the model); "
            f"at tp={tp}, pp={pp} it would stay an unsharded copy while the layers it averages are split over ranks, "
            "so update_parameters would mismatch shapes or layers. Build it once the strategy has set the model up, "
            "e.g. `def on_fit_start(self): self.ema = AveragedModel(self.net, ...)` (each rank then averages the "
            "shards it holds), or use Lightning's StochasticWeightAveraging callback; tp=1, pp=1 runs it as it is."
        )


def warn_averaged_models_in_checkpoint(module: nn.Module, tp: int, pp: int) -> None:
    """Once per module, on global rank 0, at tp > 1 or pp > 1: the checkpoint is about to store an
    ``AveragedModel`` built after the strategy split the model, whose entries are rank 0's part."""
    if (tp == 1 and pp == 1) or getattr(module, "_megastrategy_warned_averaged", False):
        return
    from torch.optim.swa_utils import AveragedModel

    from megastrategy.rank_zero import is_rank_zero

    found = [name for name, sub in module.named_modules() if isinstance(sub, AveragedModel)]
    if found and is_rank_zero():
        module._megastrategy_warned_averaged = True
        warnings.warn(
            f"MegatronStrategy: the checkpoint stores the AveragedModel at {found[0]!r} as global rank 0 holds it "
            f"(at tp={tp}, pp={pp} that is its tensor-parallel shards or pipeline stage, not the whole averaged "
            "model): training is right, but its weights in this checkpoint are not. Keep the average outside the "
            "module's state (e.g. evaluate or export it at the end of fit), or use the StochasticWeightAveraging "
            "callback, whose averaged weights each rank saves and resumes.",
            UserWarning, stacklevel=2,
        )
