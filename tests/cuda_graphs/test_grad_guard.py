"""The static-gradient guard: a graph's backward returns views of ONE set of gradient buffers,
and ``AccumulateGrad`` adopts such a view as ``.grad`` when ``.grad`` is None; without the guard the
next replay of that graph overwrites the gradient accumulated so far."""
from __future__ import annotations

import torch
from torch import nn

from megastrategy.cuda_graphs.grad_guard import StaticGradGuard


class _StaticGrad(torch.autograd.Function):
    """y = x * w; dL/dw lands in one static buffer and is returned as a detached view of it."""

    @staticmethod
    def forward(ctx, x, w, buffer):
        ctx.save_for_backward(x)
        ctx.buffer = buffer
        return x * w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        ctx.buffer.copy_((g * x).sum(0))
        return None, ctx.buffer.detach(), None


def _accumulate(guarded: bool, main_grad: bool = False):
    w = nn.Parameter(torch.ones(3))
    if main_grad:
        w.main_grad = torch.zeros(3)
    guard = StaticGradGuard()
    if guarded:
        guard.cover([nn.ParameterList([w])])
    buffer = torch.zeros(3)
    xs = [torch.full((2, 3), v) for v in (1.0, 5.0, 2.0)]
    for x in xs:
        _StaticGrad.apply(x, w, buffer).sum().backward()
    guard.remove()
    return w.grad, buffer, sum(x.sum(0) for x in xs)


def test_without_the_guard_the_accumulated_gradient_is_overwritten():
    grad, buffer, expected = _accumulate(guarded=False)
    assert grad.data_ptr() == buffer.data_ptr()  # adopted: .grad IS the static buffer
    assert not torch.equal(grad, expected)


def test_guard_keeps_a_private_grad_and_the_exact_sum():
    grad, buffer, expected = _accumulate(guarded=True)
    assert grad.data_ptr() != buffer.data_ptr()
    torch.testing.assert_close(grad, expected)


def test_guard_copies_nothing_for_a_gradient_buffer_parameter():
    """With ``main_grad`` the buffer's own hook folds each gradient away at once: no copy needed."""
    grad, buffer, _ = _accumulate(guarded=True, main_grad=True)
    assert grad.data_ptr() == buffer.data_ptr()


def test_cover_counts_each_parameter_once_and_remove_takes_the_hooks_off():
    shared = nn.Linear(2, 2)
    guard = StaticGradGuard()
    guard.cover([shared, nn.Sequential(shared)])
    assert guard.num_params == 2
    guard.remove()
    assert guard.num_params == 0 and not shared.weight._backward_hooks
