"""torch's checkpoint of a block carrying a pipeline stage's hooks runs plainly during a pipelined
step (its replay would run those hooks again in backward); other checkpoints stay torch's."""
import logging

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint  # bound at import, as users import it

from megastrategy.pipeline.stage import PipelineStage
from megastrategy.pipeline.user_checkpoint import UserCheckpoints, carries_stage_hooks


def _hooked_model():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    stage = PipelineStage(stack_path="", chunks=[[0, 1]], pp_rank=0, pp_size=2, vp_size=1)
    model[1].register_forward_hook(stage._post_hook)  # inactive stage: the hook does nothing
    calls = []
    model[1].register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
    return model, calls


def test_only_modules_with_a_stages_hooks_are_boundary_blocks():
    model, _ = _hooked_model()
    assert carries_stage_hooks(model[1]) and not carries_stage_hooks(model[0])
    assert not carries_stage_hooks(model[1].forward) and not carries_stage_hooks(lambda x: x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_boundary_block_runs_once_with_grad_and_warns_once(reentrant, caplog):
    model, calls = _hooked_model()
    x = torch.randn(2, 3, requires_grad=True)
    watch = UserCheckpoints()
    with caplog.at_level(logging.WARNING), watch.step("training_step", model):
        for _ in range(2):
            out = checkpoint(model[1], model[0](x), use_reentrant=reentrant)
            out.sum().backward()
    assert calls == [True, True]  # no replay in backward, and the forward kept its graph (reentrant too)
    messages = [r.getMessage() for r in caplog.records if r.name == "megastrategy.pipeline.user_checkpoint"]
    assert len(messages) == 1 and "torch.utils.checkpoint on 1," in messages[0]
    assert "activation_checkpointing='full'" in messages[0]


def test_other_checkpoints_recompute_as_torchs_and_torch_is_restored():
    model, _ = _hooked_model()
    generator, reentrant = torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction
    replays = []
    model[0].register_forward_pre_hook(lambda m, a: replays.append(1))
    with pytest.raises(RuntimeError):
        with UserCheckpoints().step("training_step", model):
            checkpoint(model[0], torch.randn(2, 3, requires_grad=True), use_reentrant=False).sum().backward()
            raise RuntimeError("the user's step failed")
    assert len(replays) == 2  # forward, then torch's recompute in backward
    assert torch_checkpoint._checkpoint_without_reentrant_generator is generator
    assert torch_checkpoint.CheckpointFunction is reentrant
