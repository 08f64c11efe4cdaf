"""Loading the wrong checkpoint fails clearly, naming the first differing tensors or the optimizer,
before anything of the running job is overwritten."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from megastrategy.checkpoint import load_model_, load_optimizer_states, save_sharded
from megastrategy.errors import CheckpointMismatchError
from tests.helpers import checkpoint_runs as runs
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def _mlp(hidden: int, depth: int = 2) -> nn.Sequential:
    sizes = [3] + [hidden] * (depth - 1) + [2]
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])


@pytest.fixture
def adamw_checkpoint(tmp_path) -> Path:
    model = _mlp(4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    with pytest.warns(UserWarning, match="single process"):
        save_sharded(tmp_path / "ckpt", module=model, optimizers=[opt])
    return tmp_path / "ckpt"


def test_a_checkpoint_of_another_width_lists_the_tensors_that_differ_and_loads_nothing(adamw_checkpoint):
    other = _mlp(5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as err:
        load_model_(adamw_checkpoint, other)
    assert "3 tensor(s) differ in shape: 0.weight: (4, 3) in the checkpoint, (5, 3) in this model; 0.bias: (4,)" \
        in str(err.value)
    assert "Nothing was loaded" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # untouched


def test_a_checkpoint_of_a_deeper_model_names_the_missing_tensors(adamw_checkpoint):
    deeper = _mlp(4, depth=3)  # 0.* matches; 1.weight is 4->4 here, 4->2 saved; 2.* is new
    with pytest.raises(CheckpointMismatchError) as err:
        load_model_(adamw_checkpoint, deeper)
    assert "1.weight: (2, 4) in the checkpoint, (4, 4) in this model" in str(err.value)
    assert "2 of this model's tensors are not in it: ['2.weight', '2.bias']" in str(err.value)


def test_another_optimizer_is_refused_instead_of_silently_ignoring_the_state(adamw_checkpoint):
    model = _mlp(4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer 0 in the checkpoint is AdamW with 1 parameter "
                       r"group\(s\); the configured one is SGD with 1"):
        load_optimizer_states(adamw_checkpoint, model, [sgd])
    groups = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}])
    with pytest.raises(CheckpointMismatchError, match=r"AdamW with 1 parameter group\(s\); the configured one is AdamW with 2"):
        load_optimizer_states(adamw_checkpoint, model, [groups])
    assert load_optimizer_states(adamw_checkpoint, model, [torch.optim.AdamW(model.parameters())])[0]["state"]


@pytest.mark.slow
@pytest.mark.parametrize("change, expected", [
    (["--layers", "3"], "is a checkpoint of another model: 16 of this model's tensors are not in it: "
                        "['model.bert.encoder.layer.2."),
    (["--optimizer", "sgd"], "optimizer 0 in the checkpoint is AdamW with 1 parameter group(s); the configured one is SGD"),
], ids=["deeper-model", "sgd-instead-of-adamw"])
def test_fit_from_the_checkpoint_of_another_model_or_optimizer_stops_before_training(change, expected):
    _, folder = runs.bert_tp2()
    with pytest.raises(AssertionError) as err:
        run_script(SCRIPT, 1, runs.BERT + ["--epochs", "2", *change, "--resume", str(folder / runs.EPOCH0)])
    assert expected in str(err.value), str(err.value)[-3000:]
