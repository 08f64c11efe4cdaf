"""A buffer a module updates in its training forward is refused at the first pipelined training step with
several microbatches (pipeline/running_buffers.py); unchanged buffers, one microbatch, evaluation and this
package's own modules pass."""
import pytest
import torch
from torch import nn

from megastrategy.component import StepInfo
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.running_buffers import RunningBuffers


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("fixed", torch.ones(3))


def _step(check, module, step, update=True):
    with check.step(module, step):
        if update:
            module.counter.seen += 1


def test_a_buffer_changed_by_the_first_training_step_is_refused_by_name():
    module = nn.Module()
    module.counter = Counter()
    with pytest.raises(MegatronConfigError, match=r"pp=2 with num_microbatches=4: the buffer 'counter.seen' changed"):
        _step(RunningBuffers(2), module, StepInfo("training_step", 4))


def test_what_passes():
    module = nn.Module()
    module.counter = Counter()
    _step(RunningBuffers(2), module, StepInfo("training_step", 1))  # one microbatch: the whole batch
    _step(RunningBuffers(2), module, StepInfo("validation_step", 4))
    _step(RunningBuffers(2), module, StepInfo("training_step", 4), update=False)
    checked = RunningBuffers(2)
    _step(checked, module, StepInfo("training_step", 4), update=False)
    _step(checked, module, StepInfo("training_step", 4))  # only the first training step is compared
    own = type("Own", (Counter,), {"__module__": "megastrategy.fake"})
    module.counter = own()
    _step(RunningBuffers(2), module, StepInfo("training_step", 4))
