"""fp32 main weights for half-precision parameters (``precision="bf16-true"``), one process."""
import torch
from torch import nn

from megastrategy.ddp.distributed_optimizer import MAIN_PARAM_KEY, MainParamsOptimizer
from megastrategy.ddp.grad_buffer import GradientBuffer


def _model_and_optimizer(lr=1e-3):
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    buffer = GradientBuffer(list(model.parameters()), group=None, grad_reduce_in_fp32=True)
    opt = MainParamsOptimizer(torch.optim.SGD(model.parameters(), lr=lr), buffer)
    return model, buffer, opt


def _step(model, buffer, opt, x):
    model(x).float().sum().backward()
    buffer.reduce()
    opt.step()
    buffer.zero()


def test_updates_too_small_for_bf16_accumulate_in_the_main_weights():
    model, buffer, opt = _model_and_optimizer(lr=1e-4)
    with torch.no_grad():  # weights near 1: bf16's spacing there is 2**-7, far above one 2e-4 update
        model.weight.fill_(1.0)
    opt.reload_main_params()
    plain = nn.Linear(4, 4).to(torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    start = model.weight.detach().clone()
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    for _ in range(50):
        _step(model, buffer, opt, x)
        plain_opt.zero_grad()
        plain(x).float().sum().backward()
        plain_opt.step()
    expected = start.float() - 50 * 1e-4 * 2.0  # d(sum)/dW = 2 per element for this input: 0.99
    assert torch.equal(plain.weight, start)  # each 2e-4 update rounds away in bf16
    assert (model.weight.float() - expected).abs().max() < 2**-8  # the fp32 main copy kept them
    assert (opt._pieces[0].main - expected).abs().max() < 1e-5
    assert all(piece.main.dtype == torch.float32 for piece in opt._pieces)


def test_the_main_weights_travel_in_the_optimizer_state():
    model, buffer, opt = _model_and_optimizer()
    _step(model, buffer, opt, torch.randn(3, 4, dtype=torch.bfloat16))
    state = opt.state_dict()
    mains = {i: s[MAIN_PARAM_KEY] for i, s in state["state"].items()}
    assert all(m.dtype == torch.float32 for m in mains.values()) and len(mains) == 2

    fresh_model, fresh_buffer, fresh_opt = _model_and_optimizer()
    fresh_model.load_state_dict(model.state_dict())  # bf16 weights: the low bits are gone
    fresh_opt.load_state_dict(state)
    for piece, old in zip(fresh_opt._pieces, opt._pieces):
        assert torch.equal(piece.main, old.main)  # ... and come back from the optimizer state
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    _step(model, buffer, opt, x)
    _step(fresh_model, fresh_buffer, fresh_opt, x)
    assert torch.equal(fresh_model.weight, model.weight)


def test_the_strategy_wraps_optimizers_only_for_half_parameters_over_every_buffer():
    from megastrategy.ddp.optimizer_wrapping import wrap_optimizers

    model, buffer, _ = _model_and_optimizer()
    user = torch.optim.AdamW(model.parameters())
    wrapped = wrap_optimizers([user], [buffer], distributed=False)
    assert isinstance(wrapped[0], MainParamsOptimizer) and wrapped[0].param_groups is user.param_groups

    fp32 = nn.Linear(2, 2)
    plain = torch.optim.AdamW(fp32.parameters())
    assert wrap_optimizers([plain], [GradientBuffer(list(fp32.parameters()), group=None)], distributed=False) == [plain]

    # bf16-true with MoE layers: one wrapper keeps fp32 main weights of the expert buffer's parameters too
    experts = nn.Linear(4, 4).to(torch.bfloat16)
    expert_buffer = GradientBuffer(list(experts.parameters()), group=None, grad_reduce_in_fp32=True)
    both = torch.optim.SGD([*model.parameters(), *experts.parameters()], lr=1e-4)
    wrapped = wrap_optimizers([both], [buffer, expert_buffer], distributed=False)[0]
    assert isinstance(wrapped, MainParamsOptimizer)
    assert {piece.buffer for piece in wrapped._pieces} == {buffer, expert_buffer}
    assert all(piece.main.dtype == torch.float32 for piece in wrapped._pieces)


def test_learning_rate_monitor_names_the_users_optimizer():
    """Lightning's LearningRateMonitor reads a wrapped optimizer's ``.optimizer`` (as for DeepSpeed):
    the column is ``lr-SGD``, as under DDP, and a scheduler on the user's optimizer covers the wrapper."""
    from collections import defaultdict

    from lightning.pytorch.callbacks import LearningRateMonitor

    _, _, opt = _model_and_optimizer()
    assert opt.optimizer is opt.user_optimizer
    names, unscheduled = LearningRateMonitor()._find_names_from_optimizers([opt], [], defaultdict(int))
    assert names == [["lr-SGD"]] and unscheduled == [opt.user_optimizer]
    assert LearningRateMonitor()._find_names_from_optimizers([opt], [opt.user_optimizer], defaultdict(int)) == ([], [])
