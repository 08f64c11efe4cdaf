"""A pipeline stage whose parameters are all frozen builds the user's optimizer over the trainable
ones with one empty group (torch refuses an empty list); elsewhere torch's rule stands. Training
such a stage against DDP is in tests/test_user_habits.py (frozen-first-stage-pp2) and, with
``BackboneFinetuning`` filling the group later, tests/test_user_habits_round7.py."""
import pytest
import torch
from torch import nn

from megastrategy.pipeline.frozen_stage import empty_optimizers_allowed
from megastrategy.pipeline.stage import PipelineStage

STAGE = PipelineStage(stack_path="model.bert.encoder.layer", chunks=[[0, 1]], pp_rank=0, pp_size=2, vp_size=1)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def test_a_stage_with_nothing_trainable_gets_one_empty_group_that_a_callback_fills():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with empty_optimizers_allowed(frozen, STAGE):
        optimizer = torch.optim.AdamW(_trainable(frozen), lr=0.5)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["params"] == []
    assert optimizer.param_groups[0]["lr"] == 0.5
    frozen.requires_grad_(True)
    optimizer.add_param_group({"params": list(frozen.parameters()), "lr": 0.1})  # what BackboneFinetuning does
    frozen(torch.ones(1, 2)).sum().backward()
    before = frozen.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, frozen.weight)


@pytest.mark.parametrize("module, stage", [(nn.Linear(2, 2), STAGE), (nn.Linear(2, 2).requires_grad_(False), None)])
def test_torchs_rule_stands_where_something_is_trainable_or_without_pp(module, stage):
    with empty_optimizers_allowed(module, stage), pytest.raises(ValueError, match="empty parameter list"):
        torch.optim.AdamW([], lr=0.5)


def test_torch_is_restored_after_configure_optimizers_even_when_it_raises():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError), empty_optimizers_allowed(frozen, STAGE):
        raise RuntimeError("the user's configure_optimizers failed")
    with pytest.raises(ValueError, match="empty parameter list"):
        torch.optim.AdamW([], lr=0.5)
