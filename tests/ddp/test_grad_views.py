"""During on_after_backward, p.grad is the gradient buffer itself (a view), and afterwards .grad
is None again so the next backward does not add into the buffer twice."""
import torch
from torch import nn

from megastrategy.ddp.grad_buffer import GradientBuffer
from megastrategy.ddp.grad_views import visible_grads


def _model_and_buffer(dtype=torch.float32):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(dtype)
    return model, GradientBuffer(model.parameters(), group=None)


def _backward(model, dtype=torch.float32):
    model(torch.ones(5, 3, dtype=dtype)).sum().backward()


def test_grads_are_views_that_take_in_place_edits_and_assignments():
    model, buffer = _model_and_buffer()
    _backward(model)
    first, second = model[0].weight, model[1].bias
    expected = first.main_grad.clone()
    with visible_grads([buffer]):
        assert all(p.grad is not None for p in model.parameters())
        assert first.grad.data_ptr() == first.main_grad.data_ptr()  # a view, not a copy
        first.grad.mul_(2)
        second.grad = torch.full_like(second.grad, 7.0)
        model[1].weight.grad = None
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(first.main_grad, 2 * expected)
    assert torch.equal(second.main_grad, torch.full_like(second.main_grad, 7.0))
    assert torch.count_nonzero(model[1].weight.main_grad) == 0


def test_next_backward_accumulates_once():
    model, buffer = _model_and_buffer()
    _backward(model)
    once = [p.main_grad.clone() for p in model.parameters()]
    with visible_grads([buffer]):
        pass
    _backward(model)
    for p, g in zip(model.parameters(), once):
        torch.testing.assert_close(p.main_grad, 2 * g)


def test_a_low_precision_parameter_sees_a_cast_copy():
    model, buffer = _model_and_buffer(torch.bfloat16)
    _backward(model, torch.bfloat16)
    p = model[0].weight
    with visible_grads([buffer]):
        assert p.grad.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.float(), p.main_grad, rtol=1e-2, atol=1e-2)
    assert p.grad is None
