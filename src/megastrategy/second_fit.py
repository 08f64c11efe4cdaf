"""A second ``fit`` of a module a previous ``MegatronStrategy`` split, with a new Trainer and strategy.

Two-phase fine-tuning does it: phase 1 with the backbone frozen on one Trainer, phase 2 unfrozen on
a new Trainer (and a new strategy) with the same module instance. The module is already split; a
new strategy cannot split it again (its layers are shards and stage placeholders, which the model
checks then mistook for a badly ordered model under pp). With the same configuration the new
strategy takes over the previous one's split (its process groups, components, step runner): the
same path as a second ``fit`` on one Trainer (so what the components took from the first Trainer,
``sync_batchnorm`` and DDP's ``broadcast_buffers``, stays the first's). With another configuration
(tp2 then pp2) it is refused, naming what works: a fresh module loaded from a consolidated
checkpoint of the first phase.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megastrategy.errors import MegatronConfigError
from megastrategy.split_record import record_of

__all__ = ["adopt_earlier_split"]

_TAKEN_OVER = ("parallel_state", "components", "grad_buffers", "checkpoints", "_ctx", "_runner")


def adopt_earlier_split(strategy: Any, module: Any) -> None:
    """Make ``strategy`` continue the split ``module`` already has, or refuse a different one."""
    record = record_of(module)
    if record is None or record.strategy is strategy:
        return
    earlier = record.strategy
    if earlier.lightning_module is not module:
        raise MegatronConfigError(
            f"a Trainer's run of a copy (copy.deepcopy) of a {type(module).__name__} an earlier MegatronStrategy split: the "
            "copy holds the original's shards, and the strategy's parts (process groups, pipeline stage, gradient "
            "buffers) belong to the original. What works: fit the original module, or build a fresh module and load "
            "a consolidated checkpoint into it (trainer.save_checkpoint('ckpt'), then "
            "`from megastrategy.checkpoint import consolidate; model.load_state_dict(consolidate('ckpt'))`).")
    if earlier.config != strategy.config:
        raise MegatronConfigError(_refusal(module, earlier.config, strategy.config))
    for name in _TAKEN_OVER:
        setattr(strategy, name, getattr(earlier, name))
    strategy._model_validated = True
    record.strategy = strategy


def _refusal(module: Any, before: Any, now: Any) -> str:
    changed = [f"{f.name}={getattr(before, f.name)!r} -> {getattr(now, f.name)!r}" for f in dataclasses.fields(before)
               if getattr(before, f.name) != getattr(now, f.name)]
    name = type(module).__name__
    return (f"a new Trainer's fit/validate/test/predict of {name} with a MegatronStrategy that differs from the one an "
            f"earlier fit split this {name} instance with ({', '.join(changed)}): the module was split in place by the first fit (its "
            "layers are this rank's shards, other stages' layers are placeholders) and cannot be split again. "
            "What works: a new Trainer with MegatronStrategy of the same arguments on this instance; or, for another "
            "layout, trainer.save_checkpoint('phase1') at the end of the first phase (every rank), then a fresh "
            f"model = {name}.load_from_checkpoint('phase1') (or model.load_state_dict(consolidate('phase1')), with "
            "`from megastrategy.checkpoint import consolidate`) fitted by the new Trainer.")
