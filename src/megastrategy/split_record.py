"""Which ``MegatronStrategy`` split a module in place, and whether one of its Trainer runs is under way.

A fit rewrites the user's module in place (layers sharded over tp, other stages' layers replaced by
placeholders under pp), and the module stays that way after the fit: the same Trainer's
``validate``/``test``/``predict`` run on it as it is. A user's script keeps using the module after
that, on its own (a forward on rank 0, ``state_dict()``) or with a new Trainer (two-phase
fine-tuning). Both need to know what split the module and whether a run is active; this record,
kept on the module, says it (:mod:`megastrategy.second_fit`, :mod:`megastrategy.outside_run_guard`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["SplitRecord", "record_of", "attach_record"]

_ATTRIBUTE = "_megastrategy_split_record"


class SplitRecord:
    """The strategy that split the module, and whether it is using the module now: while a Trainer
    of this strategy runs (``fit`` to its ``teardown`` hooks, ``validate``, ...; not another
    strategy's Trainer) or inside :meth:`use` (a save or an export called after the fit).

    Copies of the module (``copy.deepcopy``) share the record: a copy holds the same shards, and
    copying the strategy (its process groups) is neither possible nor wanted.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.active = 0
        self.sharding = ""  # "tp=2, pp=2" where ranks hold parts (outside_run_guard.py sets it)

    @property
    def running(self) -> bool:
        if self.active > 0:
            return True
        trainer = getattr(getattr(self.strategy, "lightning_module", None), "_trainer", None)
        if trainer is None or trainer.state.status != "running":
            return False
        # a plain Trainer's run (Trainer(devices=1).test(model) on rank 0) is not the strategy's
        return getattr(trainer, "strategy", self.strategy) is self.strategy

    @contextmanager
    def use(self) -> Iterator[None]:
        """A span in which the strategy uses the module on every rank (a save after the fit, an export)."""
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    def __deepcopy__(self, memo: dict) -> "SplitRecord":
        return self

    def __reduce__(self) -> Any:
        """A pickle (``torch.save(model)``) of a split module would hold this rank's parts: refused.
        A module every rank holds whole pickles without the record (the strategy is not picklable)."""
        if not self.sharding:
            return (type(None), ())
        raise MegatronConfigError(
            f"pickling a module split by MegatronStrategy ({self.sharding}), e.g. torch.save(model, path): the file "
            "would hold this rank's shards and pipeline stage, not the model. What works: trainer.save_checkpoint('ckpt') "
            "on every rank, then `from megastrategy.checkpoint import consolidate; torch.save(consolidate('ckpt'), path)` "
            "in one process (the original full state_dict), or trainer.strategy.export_hf('hf_out') on every rank.")


def record_of(module: Optional[nn.Module]) -> Optional[SplitRecord]:
    return None if module is None else module.__dict__.get(_ATTRIBUTE)


def attach_record(module: nn.Module, strategy: Any) -> SplitRecord:
    """Record ``strategy`` as what split ``module`` (a plain attribute: not a submodule or buffer)."""
    record = SplitRecord(strategy)
    module.__dict__[_ATTRIBUTE] = record
    return record
