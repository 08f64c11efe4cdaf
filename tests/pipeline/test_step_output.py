"""A step's per-microbatch outputs join into what one device returns for the whole batch."""
import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.step_output import join_step_outputs


def test_each_leaf_joins_as_one_device_computes_it_for_the_batch():
    from transformers.modeling_outputs import SequenceClassifierOutput

    logits = torch.randn(4, 3)
    labels = torch.tensor([0, 2, 1, 2])
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    halves = [slice(0, 2), slice(2, 4)]
    outputs = [
        {"loss": losses[h].mean(), "correct": (logits[h].argmax(-1) == labels[h]).sum(), "out":
         SequenceClassifierOutput(logits=logits[h]), "name": "cls", "pair": (labels[h], 1.5), "n": 2}
        for h in halves
    ]
    joined = join_step_outputs(outputs, "validation_step")
    assert torch.allclose(joined["loss"], losses.mean())  # a mean over equal microbatches
    assert joined["correct"] == (logits.argmax(-1) == labels).sum()  # a count: summed
    assert type(joined["out"]) is SequenceClassifierOutput and torch.equal(joined["out"].logits, logits)
    assert torch.equal(joined["pair"][0], labels) and joined["pair"][1] == 1.5
    assert joined["name"] == "cls" and joined["n"] == 4


def test_nothing_returned_stays_nothing_and_mixed_structures_are_refused():
    assert join_step_outputs([None, None], "validation_step") is None
    with pytest.raises(MegatronConfigError, match="differently structured"):
        join_step_outputs([torch.tensor(1.0), {"loss": torch.tensor(1.0)}], "training_step")
    with pytest.raises(MegatronConfigError, match="differently structured"):
        join_step_outputs([None, torch.tensor(1.0)], "validation_step")


def test_a_single_microbatch_is_returned_detached_as_it_is():
    loss = torch.tensor(2.0, requires_grad=True) * 1
    joined = join_step_outputs([{"loss": loss}], "training_step")
    assert joined["loss"].item() == 2.0 and not joined["loss"].requires_grad


def test_a_shaped_value_for_the_whole_microbatch_is_averaged_not_concatenated():
    """``loss.reshape(1)`` per microbatch of 2 (BoringModel-style predict_step): one value, as one device returns."""
    joined = join_step_outputs([torch.tensor([2.0]), torch.tensor([4.0])], "predict_step", sizes=[2, 2])
    assert joined.shape == (1,) and joined.item() == 3.0
    counts = join_step_outputs([torch.tensor([2, 1]), torch.tensor([3, 1])], "predict_step", sizes=[3, 3])
    assert counts.tolist() == [5, 2]


def test_per_example_tensors_are_concatenated_when_the_sizes_say_so():
    joined = join_step_outputs([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], "predict_step", sizes=[2, 2])
    assert joined.tolist() == [1.0, 2.0, 3.0, 4.0]
    ragged = join_step_outputs([torch.zeros(3, 2), torch.zeros(2, 2)], "predict_step", sizes=[3, 2])
    assert ragged.shape == (5, 2)
