"""The outermost model call of a step is recorded on the last stage and answered from the record
elsewhere; inner calls and calls outside a step run unchanged."""
import pytest
import torch
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.model_calls import ModelCalls


class Counting(nn.Module):
    def __init__(self, inner=None):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x) + 1 if self.inner is not None else x * 2


def _model():
    inner = Counting()
    return Counting(inner), inner


def test_the_outermost_call_is_recorded_and_replayed_without_computing():
    outer, inner = _model()
    calls = ModelCalls([("", outer), ("inner", inner)])
    with calls.recording() as recorded:
        out = outer(torch.ones(2))
    assert len(recorded) == 1 and recorded[0] is out and (outer.calls, inner.calls) == (1, 1)  # inner: not outermost
    with torch.no_grad(), calls.replaying([torch.full((2,), 7.0)], "validation_step"):
        assert outer(torch.zeros(2)).tolist() == [7.0, 7.0]
    assert (outer.calls, inner.calls) == (1, 1)  # nothing computed
    assert outer(torch.ones(2)).tolist() == [3.0, 3.0]  # outside a step: the model itself


def test_a_step_calling_the_model_differently_than_on_the_last_stage_is_refused():
    outer, inner = _model()
    calls = ModelCalls([("model", outer)])
    with pytest.raises(MegatronConfigError, match="model was called more often"):
        with calls.replaying([torch.ones(1)], "training_step"):
            outer(torch.ones(1))
            outer(torch.ones(1))
    with pytest.raises(MegatronConfigError, match="made fewer model calls"):
        with calls.replaying([torch.ones(1)], "training_step"):
            pass


def test_a_runner_built_again_takes_over_the_wrapped_forward():
    outer, _ = _model()
    ModelCalls([("model", outer)])
    second = ModelCalls([("model", outer)])
    with second.recording() as recorded:
        outer(torch.ones(1))
    assert len(recorded) == 1


def test_the_wrapped_forward_keeps_its_signature():
    import inspect

    outer, _ = _model()
    ModelCalls([("model", outer)])
    assert list(inspect.signature(outer.forward).parameters) == ["x"]


def test_a_deep_copy_of_a_routed_module_shares_the_routing_and_runs_its_own_weights():
    """An EMA's ``AveragedModel`` or SWA's copy deep-copies a stage's module: the copy must not try
    to copy the per-thread modes (a ``threading.local``), and its forward is its own."""
    import copy

    lin = nn.Linear(2, 2)
    calls = ModelCalls([("", lin)])
    twin = copy.deepcopy(lin)
    with torch.no_grad():
        twin.weight.zero_(), twin.bias.fill_(1.0)
    assert twin.forward.calls is calls and twin(torch.ones(2)).tolist() == [1.0, 1.0]
    assert lin(torch.ones(2)).tolist() != [1.0, 1.0]


def test_a_second_pass_through_the_stack_in_one_microbatch_is_refused_by_name():
    """Two model calls per step (a dict of training loaders, each batch through the model): the
    last stage cannot run the first stage's layers, so the second pass is refused with the fix."""
    outer, inner = _model()
    calls = ModelCalls([("", outer), ("inner", inner)], stack_path="inner.layers")
    with calls.recording():
        outer(torch.ones(1))
        with pytest.raises(MegatronConfigError, match=r"called Counting .* 2 times for one microbatch.*torch.cat"):
            outer(torch.ones(1))
    with calls.recording() as recorded:  # the next microbatch starts over
        outer(torch.ones(1))
    assert len(recorded) == 1


def test_modules_after_the_stack_may_be_called_beside_it():
    outer, head = _model()
    calls = ModelCalls([("body", outer), ("head", head)], stack_path="body.layers")
    with calls.recording() as recorded:
        outer(torch.ones(1))
        head(torch.ones(1))
        head(torch.ones(1))
    assert len(recorded) == 3


def test_blocks_run_by_the_step_itself_outside_a_model_call_are_refused_while_recording_or_pausing():
    outer, inner = _model()
    calls = ModelCalls([("", outer)], stack_path="blocks")
    calls.refuse_stack_outside_calls()  # outside a step's record/pause: nothing to say
    with calls.recording():
        with pytest.raises(MegatronConfigError, match=r"the step ran the blocks of 'blocks' itself, not inside a "
                                                      r"call of a module holding them \(the LightningModule\)"):
            calls.refuse_stack_outside_calls()
        outer.inner = type("Checking", (nn.Module,), {"forward": lambda self, x: (calls.refuse_stack_outside_calls(), x)[1]})()
        outer(torch.ones(2))  # reached through the model call: fine
