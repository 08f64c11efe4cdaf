"""SWA's averaged weights leave Lightning's part of the checkpoint (written by rank 0 alone) for each
rank's own record, and come back to the same rank on a resume (the tp2 resume against DDP is in
tests/test_user_habits_round3.py)."""
import pytest
import torch
from torch import nn

from megastrategy.checkpoint.swa_state import HELD_ATTR, SWA_KEY, hold_swa_states, take_swa_states
from megastrategy.errors import MegatronCheckpointError


class FakeSWA:
    state_key = "StochasticWeightAveraging{'swa_lrs': 0.01}"

    def __init__(self):
        self._average_model = nn.Linear(2, 2)


class FakeTrainer:
    def __init__(self):
        self.callbacks = [FakeSWA()]


def _saved(weights):
    lightning = {"callbacks": {FakeSWA.state_key: {"n_averaged": 2, "average_model_state": weights}, "Other": {"x": 1}}}
    return lightning, take_swa_states(lightning)


def test_the_averaged_weights_go_to_the_rank_record_and_come_back_after_setup():
    weights = {"weight": torch.full((1, 2), 3.0), "bias": torch.zeros(1)}  # this rank's shard
    lightning, taken = _saved(weights)
    assert taken == {FakeSWA.state_key: weights}
    assert isinstance(lightning["callbacks"][FakeSWA.state_key]["average_model_state"], str)
    trainer = FakeTrainer()
    hold_swa_states(lightning, trainer, {SWA_KEY: taken}, True, "same")
    swa = trainer.callbacks[0]
    placeholder = lightning["callbacks"][FakeSWA.state_key]["average_model_state"]
    swa._average_model.load_state_dict(placeholder)  # what Lightning then does: loads cleanly
    assert getattr(swa, HELD_ATTR) is weights and lightning["callbacks"]["Other"] == {"x": 1}


def test_validate_with_the_callback_attached_loads_a_placeholder_and_holds_nothing():
    lightning, _ = _saved({"weight": torch.ones(1, 2)})
    trainer = FakeTrainer()
    hold_swa_states(lightning, trainer, None, False, "other")
    assert not hasattr(trainer.callbacks[0], HELD_ATTR)
    trainer.callbacks[0]._average_model.load_state_dict(lightning["callbacks"][FakeSWA.state_key]["average_model_state"])


def test_resuming_them_on_another_layout_is_refused_with_what_works():
    lightning, taken = _saved({"weight": torch.ones(1, 2)})
    with pytest.raises(MegatronCheckpointError, match="layout that wrote it, or without the StochasticWeightAveraging"):
        hold_swa_states(lightning, FakeTrainer(), {SWA_KEY: taken}, False, "tp2 -> tp1")
