"""One DistributedOptimizer over several gradient buffers (with MoE layers: the dense buffer and
the experts'), one process: it steps like the user's optimizer, its state round-trips in torch's
format, and what has no meaning over several buffers is refused with the alternative."""
import pytest
import torch
from torch import nn

from megastrategy.ddp.distributed_optimizer import DistributedOptimizer
from megastrategy.ddp.grad_buffer import GradientBuffer


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 3e-3}]
    # the second layer in a buffer of its own, as experts are; the groups span both buffers
    buffers = [GradientBuffer(list(model[0].parameters()), group=None, distributed_optimizer=True),
               GradientBuffer(list(model[2].parameters()), group=None, distributed_optimizer=True)]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return model, buffers, DistributedOptimizer(opt, buffers), schedule


def _step(model, buffers, opt, schedule, x):
    model(x).pow(2).sum().backward()
    for b in buffers:
        b.reduce()
    opt.step()
    schedule.step()
    for b in buffers:
        b.zero()


def test_steps_both_buffers_like_the_users_optimizer_and_its_scheduler():
    model, buffers, opt, schedule = _setup()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    plain_opt = torch.optim.AdamW([{"params": list(plain[0].parameters())},
                                   {"params": list(plain[2].parameters()), "lr": 3e-3}], lr=1e-3)
    plain_schedule = torch.optim.lr_scheduler.LambdaLR(plain_opt, lambda step: 1.0 / (1 + step))
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        _step(model, buffers, opt, schedule, x)
        plain_opt.zero_grad()
        plain(x).pow(2).sum().backward()
        plain_opt.step()
        plain_schedule.step()
    for ours, ref in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(ours, ref, atol=1e-6)
    saved, expected = opt.state_dict(), plain_opt.state_dict()
    assert sorted(saved["state"]) == sorted(expected["state"]) == [0, 1, 2, 3]
    for i, values in expected["state"].items():
        assert torch.allclose(saved["state"][i]["exp_avg_sq"], values["exp_avg_sq"], atol=1e-7)

    fresh_model, fresh_buffers, fresh, fresh_schedule = _setup()
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(saved)
    fresh_schedule.load_state_dict(schedule.state_dict())
    x = torch.randn(5, 4)
    _step(model, buffers, opt, schedule, x)
    _step(fresh_model, fresh_buffers, fresh, fresh_schedule, x)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)


def test_what_one_buffer_means_is_refused_over_several():
    _, buffers, opt, _ = _setup()
    with pytest.raises(ValueError, match=r"sharded_state_dict\(\) over 2 gradient buffers.*Use state_dict\(\)"):
        opt.sharded_state_dict()
    with pytest.raises(ValueError, match=r"several gradient buffers: pass buffer=.*distributed_grad_norm_with_experts"):
        opt.grad_norm()
    assert opt.grad_norm(buffer=buffers[1]) == 0  # one named buffer: its own norm
