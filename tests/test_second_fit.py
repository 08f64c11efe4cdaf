"""second_fit.py: a new strategy's fit of a module an earlier one split: taken over, or refused by name."""
from types import SimpleNamespace

import pytest
from torch import nn

from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.second_fit import adopt_earlier_split
from megastrategy.split_record import attach_record


class Tiny(nn.Module):
    pass


def _strategy(module, **config):
    parts = {k: object() for k in ("parallel_state", "components", "grad_buffers", "checkpoints", "_ctx", "_runner")}
    return SimpleNamespace(config=MegatronConfig(**config), lightning_module=module, _model_validated=False, **parts)


def test_the_same_arguments_take_over_the_earlier_split():
    module = Tiny()
    earlier, later = _strategy(module, tp=2), _strategy(module, tp=2)
    record = attach_record(module, earlier)
    adopt_earlier_split(later, module)
    assert later.components is earlier.components and later._runner is earlier._runner
    assert later.parallel_state is earlier.parallel_state and later._model_validated
    assert record.strategy is later


def test_another_layout_is_refused_naming_the_change_and_the_checkpoint_route():
    module = Tiny()
    attach_record(module, _strategy(module, tp=2))
    with pytest.raises(MegatronConfigError, match=r"tp=2 -> 1.*pp=1 -> 2.*save_checkpoint\('phase1'\).*Tiny.load_from_checkpoint"):
        adopt_earlier_split(_strategy(module, pp=2), module)


def test_a_copy_of_a_split_module_is_refused():
    module, copy = Tiny(), Tiny()
    record = attach_record(module, _strategy(module, tp=2))
    copy.__dict__["_megastrategy_split_record"] = record  # what copy.deepcopy leaves
    with pytest.raises(MegatronConfigError, match="copy.deepcopy"):
        adopt_earlier_split(_strategy(copy, tp=2), copy)


def test_a_module_no_strategy_split_is_left_alone():
    module = Tiny()
    later = _strategy(module, tp=2)
    adopt_earlier_split(later, module)
    assert not later._model_validated
