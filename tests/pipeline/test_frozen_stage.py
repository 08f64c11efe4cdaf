"""A pipeline stage whose parameters are all frozen, under an optimizer over the trainable ones.

Torch refuses the empty list with "optimizer got an empty parameter list"; the strategy says which
stage holds nothing to train and what works (an optimizer over all parameters, which trains exactly
like DDP: tests/test_user_habits.py, frozen-layers-pp2). Every rank stops within the launch's time.
"""
import pytest
import torch
from torch import nn

from megastrategy import MegatronConfigError
from megastrategy.pipeline.frozen_stage import explain_empty_optimizer
from megastrategy.pipeline.stage import PipelineStage
from tests.helpers.habit_runs import FROZEN_FIRST_STAGE, LAYOUTS, SCRIPT
from tests.helpers.launch import run_script_to_the_end

STAGE = PipelineStage(stack_path="model.bert.encoder.layer", chunks=[[0, 1]], pp_rank=0, pp_size=2, vp_size=1)


def _empty_list_error() -> ValueError:
    with pytest.raises(ValueError) as err:
        torch.optim.AdamW([])
    return err.value


def test_a_stage_with_nothing_trainable_is_named_with_the_way_out():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    error = _empty_list_error()
    with pytest.raises(MegatronConfigError) as err:
        explain_empty_optimizer(frozen, STAGE, error)
    text = str(err.value)
    assert "stage 0 of 2" in text and "layers 0, 1 of model.bert.encoder.layer" in text
    assert "self.parameters()" in text and err.value.__cause__ is error


@pytest.mark.parametrize("module, stage", [(nn.Linear(2, 2), STAGE), (nn.Linear(2, 2).requires_grad_(False), None)])
def test_other_failures_are_left_as_they_are(module, stage):
    assert explain_empty_optimizer(module, stage, _empty_list_error()) is None  # something trainable, or no pp


@pytest.mark.slow
def test_every_rank_stops_with_the_message_before_training(tmp_path):
    nprocs, args = LAYOUTS["pp2"]
    ranks = run_script_to_the_end(SCRIPT, nprocs, [*args, "--dir", str(tmp_path), *FROZEN_FIRST_STAGE],
                                  timeout=120)
    for code, output, _ in ranks:
        assert code not in (None, 0), output[-2000:]
        assert "every parameter this stage holds" in output and "frozen" in output, output[-3000:]
    assert "Trainer.fit` stopped" not in ranks[0][1]
