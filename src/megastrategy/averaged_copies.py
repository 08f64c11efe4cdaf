"""Copies of the model that weights are averaged into (SWA, EMA) must be copies of the rank's
sharded model, parameter for parameter.

Lightning's ``StochasticWeightAveraging`` deep-copies the module in its ``setup`` hook, which runs
before the strategy shards and cuts the module; its averaging then zips the unsharded copy's
parameters with the rank's shards (a shape error under tp, the wrong blocks averaged under pp).
:func:`copy_sharded_for_swa` makes that copy again from the sharded module: each rank averages its
own shards, which is elementwise, so it equals the average of the whole model. A resumed run loads
each rank's saved averaged weights into it (:mod:`megastrategy.checkpoint.swa_state`).

A ``torch.optim.swa_utils.AveragedModel`` the user builds before the split (in ``__init__``, or in
``on_load_checkpoint`` so that a resumed ``fit`` loads the saved average into it, as DDP needs) is
the same unsharded copy, inside the module, where no plan shards it: :func:`hold_averaged_copies`
takes it out before the split and :func:`remake_averaged_copies` copies its source again after it,
cutting the held averaged values like the source's. Its source is the one submodule of the same
structure (:mod:`megastrategy.checkpoint.averaged_layout`); none or several: refused by name
(:func:`refuse_unsharded_averaged_models`). One built in ``on_fit_start`` is a copy of the split
source already; the checkpoint describes its tensors by its source's.
"""
from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch
from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["copy_sharded_for_swa", "refuse_unsharded_averaged_models", "hold_averaged_copies", "remake_averaged_copies"]


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
    """At tp > 1 or pp > 1, refuse an ``AveragedModel`` registered inside ``module`` before the split
    whose copy matches no single submodule: it could not be split like what it averages, so its
    ``update_parameters`` would mismatch shapes or layers."""
    if tp == 1 and pp == 1:
        return
    from megastrategy.checkpoint.averaged_layout import averaged_candidates

    for path, found in averaged_candidates(module).items():
        if len(found) != 1:
            raise MegatronConfigError(
                f"module has an AveragedModel registered at {path!r} (made before the strategy split the model) "
                f"whose copy has the structure of {len(found)} of its submodules ({found}); at tp={tp}, pp={pp} it "
                "must be split like the one it averages, which cannot be told. Build it once the strategy has set "
                "the model up, e.g. `def on_fit_start(self): self.ema = AveragedModel(self.net, ...)` (each rank then "
                "averages the shards it holds), or use Lightning's StochasticWeightAveraging callback."
            )


def hold_averaged_copies(module: nn.Module) -> list[tuple[str, str, dict, set]]:
    """Before the split: take each ``AveragedModel``'s unsharded copy out of ``module`` (a placeholder
    takes its place, so no plan sees it), keeping its path, its source's path, its values and which
    of its parameters are frozen (``requires_grad_(False)``, usual for an EMA)."""
    from megastrategy.checkpoint.averaged_layout import averaged_candidates

    held = []
    for path, found in averaged_candidates(module).items():
        averaged = module.get_submodule(path)
        values = {k: v.detach().clone() for k, v in averaged.module.state_dict().items()}
        frozen = {k for k, p in averaged.module.named_parameters() if not p.requires_grad}
        averaged.module = nn.Module()
        held.append((path, found[0], values, frozen))
    return held


def remake_averaged_copies(module: nn.Module, held: list[tuple[str, str, dict, set]], layout_of) -> None:
    """After the split: each held ``AveragedModel`` copies its source as this rank holds it, and its
    saved averaged values are cut the same way (``layout_of(module)``: the checkpoint's description)."""
    for path, source, _values, frozen in held:
        copy = module.get_submodule(path).module = deepcopy(module.get_submodule(source))
        for name, p in copy.named_parameters():
            p.requires_grad_(name not in frozen)
    layout = layout_of(module)
    for path, _source, values, _frozen in held:
        copy = f"{path}.module."
        with torch.no_grad():
            for t, lay in layout.tensors.values():
                if lay.name.startswith(copy):
                    t.copy_(lay.shard_full(values[lay.name[len(copy):]]).to(t.device, t.dtype))
