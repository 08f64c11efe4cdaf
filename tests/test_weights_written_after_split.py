"""Weights written between the split and the first training step (weights_written_after_split.py),
one process: what counts as written, what is refused on a split layout, what is let through, and the
main copies a write must reach. The launched habits (tp2, pp2 against DDP) are in
tests/test_user_habits_round8.py."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megastrategy.component import StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.ddp.distributed_optimizer import MainParamsOptimizer
from megastrategy.ddp.grad_buffer import GradientBuffer
from megastrategy.errors import MegatronConfigError
from megastrategy.weights_written_after_split import WeightsWrittenAfterSplit, fingerprints, written

TRAINING = StepInfo("training_step", 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.out = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.fc(x))


def _armed(net: nn.Module, optimizers=(), **layout) -> WeightsWrittenAfterSplit:
    guard = WeightsWrittenAfterSplit(MegatronConfig(**layout))
    guard.configure(SimpleNamespace(module=net))
    assert guard.wrap_optimizers(list(optimizers)) == list(optimizers)
    return guard


@pytest.mark.parametrize("write", [
    lambda p: nn.init.normal_(p, std=0.02),
    lambda p: p.data.normal_(),  # the version counter does not see it
    lambda p: p.data.mul_(0.5),
    lambda p: p.data.copy_(p.data.flip(0)),  # same sum and norm
])
def test_a_write_changes_the_fingerprint(write):
    p = nn.Parameter(torch.randn(6, 5))
    before = fingerprints([p])
    with torch.no_grad():
        write(p)
    assert written(before, fingerprints([p])) == [True]


def test_the_same_values_written_again_are_not_a_write():
    """An EMA's weights swapped in for validation and put back, a restore of the same checkpoint."""
    p = nn.Parameter(torch.randn(6, 5))
    p.data[0, 0] = float("nan")
    before, saved = fingerprints([p]), p.detach().clone()
    with torch.no_grad():
        p.zero_()
        p.copy_(saved)
    assert p._version > 0 and written(before, fingerprints([p])) == [False]


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}, {"ep": 2}])
def test_a_draw_on_a_split_layout_is_refused_by_name(layout):
    net = Net()
    guard = _armed(net, **layout)
    nn.init.normal_(net.out.weight, std=0.02)
    with pytest.raises(MegatronConfigError) as raised:
        guard.begin_step(net, TRAINING)
    message = str(raised.value)
    assert "weights were initialized between the split and the first training step" in message
    assert "rank 0: out.weight" in message and "fc.weight" not in message
    assert "__init__, setup() or configure_model()" in message and "on_fit_start" in message


def test_a_constant_fill_is_exact_on_any_layout_and_let_through():
    net = Net()
    guard = _armed(net, tp=2, pp=2)
    nn.init.zeros_(net.fc.bias)
    nn.init.constant_(net.out.weight, 0.5)
    guard.begin_step(net, TRAINING)


def test_a_replaced_parameter_counts_as_written():
    net = Net()
    guard = _armed(net, pp=2)
    net.fc.weight = nn.Parameter(torch.randn(8, 4))
    with pytest.raises(MegatronConfigError, match="rank 0: fc.weight"):
        guard.begin_step(net, TRAINING)


def test_checked_once_and_only_before_a_training_step():
    net = Net()
    guard = _armed(net, tp=2)
    nn.init.normal_(net.out.weight)
    guard.begin_step(net, StepInfo("validation_step", 1))  # the sanity check: still in the window
    with pytest.raises(MegatronConfigError):
        guard.begin_step(net, TRAINING)
    guard.begin_step(net, TRAINING)  # later steps: the optimizer writes every step


def test_the_strategys_own_restore_starts_a_new_window():
    """LearningRateFinder trains, then restores the weights; a resume loads them after setup."""
    net = Net()
    guard = _armed(net, pp=2)
    guard.begin_step(net, TRAINING)  # the finder's first step
    nn.init.normal_(net.fc.weight)  # the finder's training
    guard.on_weights_loaded()  # its restore
    guard.begin_step(net, TRAINING)
    guard.on_weights_loaded()
    nn.init.normal_(net.fc.weight)  # the user's on_fit_start, after the finder
    with pytest.raises(MegatronConfigError, match="fc.weight"):
        guard.begin_step(net, TRAINING)


def test_without_a_split_a_write_is_exact_and_nothing_is_watched():
    net = Net()
    guard = _armed(net, cp=2)
    nn.init.normal_(net.fc.weight)
    guard.begin_step(net, TRAINING)
    assert guard._baseline is None


def test_without_a_split_a_written_half_precision_weight_reaches_its_main_copy():
    """bf16-true: the optimizer steps fp32 copies made in setup; without a reload the first step would
    put the weights from before the write back (the user's write silently lost)."""
    net = Net().to(torch.bfloat16)
    buffer = GradientBuffer(list(net.parameters()), group=None, grad_reduce_in_fp32=True)
    opt = MainParamsOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3), buffer)
    guard = _armed(net, [opt])
    main_of_out = next(piece.main for piece in opt._pieces if piece.param is net.out.weight)
    main_of_fc = next(piece.main for piece in opt._pieces if piece.param is net.fc.weight)
    kept = main_of_fc.clone()
    nn.init.normal_(net.out.weight)
    guard.begin_step(net, TRAINING)
    assert torch.equal(main_of_out.view_as(net.out.weight), net.out.weight.float())
    assert torch.equal(main_of_fc, kept)  # an unwritten main copy keeps its own (fp32) values
    net(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    buffer.reduce()
    drawn = net.out.weight.detach().float().clone()
    opt.step()
    assert torch.equal(net.out.weight.float(), main_of_out.view_as(net.out.weight).bfloat16().float())
    assert (net.out.weight.float() - drawn).abs().max() < 0.05  # a step from the drawn weights, not the old ones


def test_a_parameter_without_values_is_never_written():
    """A stand-in left on the meta device beside real parameters."""
    stand_in, real = nn.Parameter(torch.empty(3, device="meta")), nn.Parameter(torch.ones(2))
    before = fingerprints([stand_in, real])
    with torch.no_grad():
        real.mul_(2)
    assert written(before, fingerprints([stand_in, real])) == [False, True]
