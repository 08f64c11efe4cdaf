"""A non-last stage's resumed step whose loss has a gradient on the stage's own parameters (a term
outside the model call) is refused; a loss from the relayed (detached) outputs passes, and so does a
term whose gradient is zero everywhere (``0 * sum(p.sum() ...)``, DDP's trick for unused parameters)."""
import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.local_loss_terms import refuse_local_loss_terms

RELAYED = torch.tensor(2.0)  # what the last stage relayed: no gradient


def test_a_loss_with_a_penalty_over_the_stages_parameters_is_refused():
    stage = torch.nn.Linear(3, 1)
    with pytest.raises(MegatronConfigError) as e:
        refuse_local_loss_terms(RELAYED + 0.1 * stage.weight.pow(2).sum(), stage, "training_step", 0, 2)
    text = str(e.value)
    assert text.startswith("training_step on pipeline stage 0 of 2 returned a loss that depends on this stage's own")
    assert "AddBackward0" in text and "weight_decay" in text


@pytest.mark.parametrize("loss", [RELAYED, None])
def test_a_loss_from_the_relayed_outputs_passes(loss):
    refuse_local_loss_terms(loss, torch.nn.Linear(3, 1), "training_step", 0, 2)


def test_a_term_with_a_zero_gradient_passes_and_the_loss_can_still_be_backpropagated():
    stage = torch.nn.Linear(3, 1)
    loss = RELAYED + 0 * sum(p.sum() for p in stage.parameters())
    refuse_local_loss_terms(loss, stage, "training_step", 0, 2)
    loss.backward()
    assert all(not p.grad.any() for p in stage.parameters())
