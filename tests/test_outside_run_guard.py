"""outside_run_guard.py and split_record.py: a split module's forward and state_dict refused outside runs."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.outside_run_guard import guard_outside_runs
from megastrategy.split_record import attach_record, record_of


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


def _guarded(sharding="tp=2", trainer=None):
    net = Net()
    strategy = SimpleNamespace(lightning_module=SimpleNamespace(_trainer=trainer))
    record = attach_record(net, strategy)
    guard_outside_runs(net, record, sharding)
    return net, record


def test_forward_and_state_dict_outside_a_run_are_refused_naming_what_works():
    net, _ = _guarded()
    with pytest.raises(MegatronConfigError, match=r"model\(\.\.\.\) outside a Trainer run of the MegatronStrategy that split it \(tp=2\).*trainer.predict"):
        net(torch.ones(1, 4))
    with pytest.raises(MegatronConfigError, match=r"model.body\(\.\.\.\) outside"):
        net.body(torch.ones(1, 4))
    with pytest.raises(MegatronConfigError, match=r"model.state_dict\(\) outside.*consolidate\('ckpt'\).*export_hf"):
        net.state_dict()


def test_inside_a_run_or_a_save_nothing_changes():
    net, record = _guarded(trainer=SimpleNamespace(state=SimpleNamespace(status="running")))
    assert net(torch.ones(1, 4)).shape == (1, 4) and "body.weight" in net.state_dict()
    net, record = _guarded(trainer=SimpleNamespace(state=SimpleNamespace(status="finished")))
    with record.use():
        assert "body.weight" in net.state_dict()
    with pytest.raises(MegatronConfigError):
        net.state_dict()


def test_a_module_every_rank_holds_whole_is_not_guarded():
    net, _ = _guarded(sharding="")
    assert net(torch.ones(1, 4)).shape == (1, 4) and "body.weight" in net.state_dict()


def test_a_deep_copy_shares_the_record_and_is_refused_the_same_way():
    net, record = _guarded()
    clone = copy.deepcopy(net)
    assert record_of(clone) is record
    with pytest.raises(MegatronConfigError, match="outside a Trainer run"):
        clone(torch.ones(1, 4))


def test_another_strategys_trainer_is_not_a_run_of_the_split():
    """``Trainer(devices=1).test(model)`` on rank 0 after fit: refused (at tp2 the forward would hang)."""
    trainer = SimpleNamespace(state=SimpleNamespace(status="running"), strategy=object())
    net, record = _guarded(trainer=trainer)
    with pytest.raises(MegatronConfigError, match="outside a Trainer run"):
        net(torch.ones(1, 4))
    trainer.strategy = record.strategy
    assert net(torch.ones(1, 4)).shape == (1, 4)


def test_pickling_a_split_module_is_refused_naming_what_works():
    import pickle

    net, _ = _guarded()
    with pytest.raises(MegatronConfigError, match=r"pickling a module split by MegatronStrategy \(tp=2\).*consolidate"):
        pickle.dumps(net)


def test_a_whole_module_pickles_without_its_record():
    import pickle

    net, _ = _guarded(sharding="")
    assert record_of(pickle.loads(pickle.dumps(net))) is None


class Lit(Net):
    """A LightningModule's shape: a ``setup`` hook and the ``_trainer`` Lightning attaches."""

    def __init__(self) -> None:
        super().__init__()
        self._trainer, self.set_up = None, []

    def setup(self, stage: str) -> None:
        self.set_up.append(stage)


def test_another_strategys_trainer_is_refused_in_setup_and_a_megatron_one_runs_the_users_hook():
    from lightning.pytorch.strategies import DDPStrategy

    from megastrategy import MegatronStrategy

    lit = Lit()
    guard_outside_runs(lit, attach_record(lit, SimpleNamespace(lightning_module=lit)), "pp=2")
    lit._trainer = SimpleNamespace(strategy=DDPStrategy())
    with pytest.raises(MegatronConfigError, match=r"a Trainer with DDPStrategy outside a Trainer run.*same arguments"):
        lit.setup("fit")
    assert lit.set_up == []
    lit._trainer = SimpleNamespace(strategy=MegatronStrategy(pp=2))
    lit.setup("fit")
    assert lit.set_up == ["fit"]
    clone = copy.deepcopy(lit)  # the copy's hook is the copy's
    clone.setup("test")
    assert clone.set_up == ["fit", "test"] and lit.set_up == ["fit"]
