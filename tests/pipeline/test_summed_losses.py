"""Sum-reduced losses inside a pipelined step warn once per step and function, and F is restored."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megastrategy.pipeline.summed_losses import WATCHED, SummedLosses


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megastrategy.pipeline.summed_losses"]


def test_a_summed_loss_warns_once_per_step_and_function_naming_m_and_what_is_exact(caplog):
    watcher, logits, target = SummedLosses(), torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # two steps: still one warning
            with watcher.step("training_step", 4):
                summed = F.cross_entropy(logits, target, reduction="sum")
                nn.MSELoss(reduction="sum")(logits, torch.zeros(4, 3))  # the module calls F.mse_loss
                F.cross_entropy(logits, target)  # a mean says nothing
        with watcher.step("validation_step", 4):
            F.cross_entropy(logits, target, reduction="sum")
    assert torch.equal(summed, torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
    messages = _warnings(caplog)
    assert len(messages) == 3, messages
    assert "training_step calls F.cross_entropy(..., reduction='sum')" in messages[0]
    assert "4 microbatches" in messages[0] and "1/4 of one device's" in messages[0]
    assert "len(batch)" in messages[0] and "num_microbatches=1" in messages[0]
    assert "F.mse_loss" in messages[1] and "validation_step" in messages[2]


def test_the_deprecated_size_average_spelling_of_a_sum_is_caught():
    watcher = SummedLosses()
    with watcher.step("training_step", 2):
        with pytest.warns(UserWarning):  # torch's own deprecation warning
            F.l1_loss(torch.ones(2), torch.zeros(2), size_average=False)
    assert ("training_step", "l1_loss") in watcher._warned


def test_the_functions_are_torchs_again_after_the_step_even_when_it_raises():
    originals = {name: getattr(F, name) for name in WATCHED}
    with pytest.raises(RuntimeError):
        with SummedLosses().step("training_step", 2):
            assert F.cross_entropy is not originals["cross_entropy"]
            raise RuntimeError("the user's step failed")
    assert all(getattr(F, name) is func for name, func in originals.items())
