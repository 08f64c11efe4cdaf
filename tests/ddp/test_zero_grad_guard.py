"""``guard_zero_grad``: ``zero_grad(set_to_none=False)`` drops views of unreduced buffered gradients
instead of zeroing the buffer (Lightning calls it after the step runner's backward); the rest as torch."""
from types import SimpleNamespace

import torch

from megastrategy.ddp.zero_grad_guard import guard_zero_grad


def _setup(has_grads=True, is_reduced=False):
    buffered, plain = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    buffered.main_grad = torch.full((3,), 2.0)
    buffered.grad, plain.grad = buffered.main_grad, torch.full((2,), 5.0)
    buffer = SimpleNamespace(params=[buffered], has_grads=has_grads, is_reduced=is_reduced)
    opt = guard_zero_grad(torch.optim.SGD([buffered, plain], lr=0.1), lambda: [buffer])
    return opt, buffered, plain


def test_unreduced_buffer_views_are_dropped_not_zeroed():
    opt, buffered, plain = _setup()
    opt.zero_grad(set_to_none=False)
    assert buffered.grad is None and buffered.main_grad.tolist() == [2.0, 2.0, 2.0]
    assert plain.grad.tolist() == [0.0, 0.0]  # not the buffer's: zeroed as torch does


def test_reduced_gradients_are_zeroed_as_torch_does():
    opt, buffered, _ = _setup(is_reduced=True)
    opt.zero_grad(set_to_none=False)
    assert buffered.main_grad.tolist() == [0.0, 0.0, 0.0]


def test_set_to_none_and_idempotence():
    opt, buffered, plain = _setup()
    guarded = opt.zero_grad
    assert guard_zero_grad(opt, lambda: []).zero_grad is guarded
    opt.zero_grad()
    assert buffered.grad is None and plain.grad is None and buffered.main_grad.tolist() == [2.0, 2.0, 2.0]
