"""Refuse a split module's forward, ``state_dict()`` and another strategy's Trainer outside the
strategy's own runs.

After ``fit`` the module stays split (:mod:`megastrategy.split_record`). A script then calls
``model(batch)`` on rank 0, or ``torch.save(model.state_dict(), ...)``: under tp the forward's
collectives wait for ranks that are elsewhere (a hang), and the state dict holds this rank's shards
and stage (a file that looks like a model and is not one). Both raise instead, naming what gives
the whole model; inside a run (fit, validate, test, predict, a checkpoint save) nothing changes.
A new Trainer with another strategy (``strategy="ddp"``, one device) is refused in the module's
``setup`` hook, before that strategy touches the weights: DDP's wrapper would broadcast rank 0's
shards over every other rank's, damaging the module in memory before any forward could refuse.
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
_FOREIGN = ("a Trainer with {strategy} {outside}: this rank holds only its share of the model, which {strategy} "
            "would take for the whole (DDPStrategy would also overwrite the other ranks' shards with rank 0's). "
            "What works: a Trainer with MegatronStrategy of the same arguments (it continues on the split); for "
            "another strategy or layout, {whole}, and load that state into a fresh module.")
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
    if callable(getattr(module, "setup", None)) and hasattr(module, "_trainer"):  # a LightningModule
        module.__dict__["setup"] = _ForeignTrainerRefusal(module, facts)
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


class _ForeignTrainerRefusal:
    """The LightningModule's ``setup`` hook, refusing a Trainer whose strategy is not a MegatronStrategy
    (which checks a second run itself: :mod:`megastrategy.second_fit`). Lightning calls it on every
    rank before the strategy's own setup, so no weight has been touched yet."""

    def __init__(self, module: nn.Module, facts: dict) -> None:
        self.module, self.facts = module, facts

    def __call__(self, stage: str) -> None:
        from megastrategy.strategy import MegatronStrategy

        strategy = getattr(getattr(self.module, "_trainer", None), "strategy", None)
        if strategy is not None and not isinstance(strategy, MegatronStrategy):
            raise MegatronConfigError(_FOREIGN.format(strategy=type(strategy).__name__, **self.facts))
        type(self.module).setup(self.module, stage)
