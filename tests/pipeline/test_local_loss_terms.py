"""A non-last stage's resumed step whose loss still requires grad (a term from the stage's own
parameters, outside the model call) is refused; a loss from the relayed (detached) outputs passes."""
import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.local_loss_terms import refuse_local_loss_terms


def test_a_loss_with_a_penalty_over_the_stages_parameters_is_refused():
    relayed = torch.tensor(2.0)  # what the last stage relayed: no gradient
    weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(MegatronConfigError) as e:
        refuse_local_loss_terms(relayed + 0.1 * weight.pow(2).sum(), "training_step", 0, 2)
    text = str(e.value)
    assert text.startswith("training_step on pipeline stage 0 of 2 returned a loss that depends on this stage's own")
    assert "AddBackward0" in text and "weight_decay" in text


@pytest.mark.parametrize("loss", [torch.tensor(2.0), None])
def test_a_loss_from_the_relayed_outputs_passes(loss):
    refuse_local_loss_terms(loss, "training_step", 0, 2)
