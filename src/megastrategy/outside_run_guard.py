"""Refuse a split module's forward and ``state_dict()`` outside the strategy's Trainer runs.

After ``fit`` the module stays split (:mod:`megastrategy.split_record`). A script then calls
``model(batch)`` on rank 0, or ``torch.save(model.state_dict(), ...)``: under tp the forward's
collectives wait for ranks that are elsewhere (a hang), and the state dict holds this rank's shards
and stage (a file that looks like a model and is not one). Both raise instead, naming what gives
the whole model; inside a run (fit, validate, test, predict, a checkpoint save) nothing changes.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.split_record import SplitRecord

__all__ = ["guard_outside_runs"]

_WHOLE = ("for the whole model, trainer.save_checkpoint('ckpt') on every rank, then in any one process "
          "`from megastrategy.checkpoint import consolidate; state = consolidate('ckpt')` (the original full "
          "state_dict) or {cls}.load_from_checkpoint('ckpt'); trainer.strategy.export_hf('hf_out') (every rank) "
          "writes a Hugging Face model from_pretrained reads")


_FORWARD = ("{label}(...) {outside}: after fit this rank still holds only its share of the model, and its forward "
            "needs every rank at once (called on one rank it waits forever). What works: trainer.predict(model) / "
            "trainer.validate(model) on every rank; or {whole}.")
_STATE_DICT = ("{label}.state_dict() {outside}: after fit this rank holds only its shards and pipeline stage, so the "
               "dict (and a file saved from it) would not be the model. What works: {whole}.")


def guard_outside_runs(module: nn.Module, record: SplitRecord, sharding: str) -> None:
    """Hooks on ``module`` and its direct children: outside a run, forward and ``state_dict`` raise."""
    if not sharding or getattr(module, "_megastrategy_outside_guard", False):
        return
    facts = {"whole": _WHOLE.format(cls=type(module).__name__),
             "outside": f"outside a Trainer run of the MegatronStrategy that split it ({sharding})"}
    for name, m in [("", module), *module.named_children()]:
        label = f"model.{name}" if name else "model"
        m.register_forward_pre_hook(_Refusal(record, _FORWARD.format(label=label, **facts)))
        m.register_state_dict_pre_hook(_Refusal(record, _STATE_DICT.format(label=label, **facts)))
    record.sharding = sharding
    module.__dict__["_megastrategy_outside_guard"] = True


class _Refusal:
    """A forward or state-dict pre-hook raising ``message`` outside the record's runs (a class, not a
    closure, so that pickling the module reaches the record's own refusal)."""

    def __init__(self, record: SplitRecord, message: str) -> None:
        self.record, self.message = record, message

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if not self.record.running:
            raise MegatronConfigError(self.message)
