"""The gradient buffer follows ``requires_grad`` changed after fit started (gradual unfreezing,
Lightning's ``BackboneFinetuning``), or says why it cannot. Training with the change equals DDP's
in tests/test_user_habits.py (unfreeze-tp2, unfreeze-pp2)."""
import pytest
from torch import nn

from megastrategy import MegatronConfigError
from megastrategy.ddp.trainable_set import refuse_change, trainable_change
from tests.helpers.habit_runs import LAYOUTS, SCRIPT, UNFREEZE
from tests.helpers.launch import run_script_to_the_end


def test_unfrozen_and_frozen_parameters_are_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    buffered = {id(p) for p in model[0].parameters()}  # built while model[1] was frozen
    model[0].weight.requires_grad_(False)
    assert trainable_change(model.named_parameters(), buffered) == (["1.weight", "1.bias"], ["0.weight"])
    model[0].weight.requires_grad_(True)
    model[1].requires_grad_(False)
    assert trainable_change(model.named_parameters(), buffered) == ([], [])


def test_the_refusal_names_what_changed_and_what_works():
    with pytest.raises(MegatronConfigError) as err:
        refuse_change([f"layer.{i}" for i in range(5)], ["head"], "the optimizer holds fp32 pieces")
    text = str(err.value)
    assert "unfrozen: layer.0, layer.1, layer.2 and 2 more; frozen: head" in text
    assert "the optimizer holds fp32 pieces" in text and "before trainer.fit" in text


@pytest.mark.slow
def test_unfreezing_under_the_distributed_optimizer_stops_every_rank_naming_it(tmp_path):
    nprocs, args = LAYOUTS["dp2-zero"]
    ranks = run_script_to_the_end(SCRIPT, nprocs, [*args, "--dir", str(tmp_path), *UNFREEZE], timeout=120)
    for code, output, _ in ranks:
        assert code not in (None, 0), output[-2000:]
        assert "parameters changed requires_grad after fit started (unfrozen: model.bert.embeddings" in output, output[-3000:]
