"""B then W on unchanged modules gives exactly the gradients of one whole backward."""
import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from megastrategy.pipeline.split_backward import backward_input


class SharedTwice(nn.Module):
    """One Linear applied twice (a reused block), with a LayerNorm and a residual."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.norm(self.lin(h) + x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.pos = nn.Linear(8, 24), nn.Linear(8, 8, bias=False), nn.Embedding(4, 8)

    def forward(self, x):
        x = x + self.pos(torch.arange(x.shape[1]))  # a parameter off the input path entirely
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1)
        return torch.nn.functional.gelu(self.out(attn @ v))


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8))


class Recomputed(nn.Module):
    """Blocks under non-reentrant activation checkpointing (what activation_checkpointing uses)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([mlp(), mlp()])

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


MODELS = {"mlp": mlp, "shared": SharedTwice, "attention": Attention, "recomputed": Recomputed}


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse-saved", "replay"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("last", [False, True], ids=["middle", "last-stage-loss"])
def test_b_then_w_equals_whole_backward(name, reuse, last):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randn(2, 4, 8)
    dy = torch.randn(2, 4, 8)

    def run():
        inp = x.clone().requires_grad_(True)
        out = model(inp)
        return inp, (out.pow(2).mean() if last else out)

    inp, out = run()
    torch.autograd.backward(out, None if last else dy)
    expected_input, expected = inp.grad.clone(), grads(model)
    model.zero_grad(set_to_none=True)

    inp, out = run()
    w = backward_input(out, None if last else dy, inp, reuse_saved_gradients=reuse)
    assert all(p.grad is None for p in model.parameters())  # B computed no weight gradient
    torch.testing.assert_close(inp.grad, expected_input, rtol=0, atol=1e-6)
    w.run()
    for got, want in zip(grads(model), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_parameter_hooks_fire_once_per_w():
    """Each leaf accumulates once per W, even a weight applied twice (the DP buffer counts its hooks)."""
    torch.manual_seed(0)
    model = SharedTwice()
    calls = {id(p): 0 for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(id(p), calls[id(p)] + 1))
    inp = torch.randn(3, 8, requires_grad=True)
    w = backward_input(model(inp), torch.ones(3, 8), inp)
    assert set(calls.values()) == {0}
    w.run()
    assert set(calls.values()) == {1}


def test_first_stage_without_input_runs_whole_backward_in_w():
    model = mlp()
    out = model(torch.randn(2, 8))
    w = backward_input(out, torch.ones(2, 8), None)
    assert all(p.grad is None for p in model.parameters())
    w.run()
    assert all(p.grad is not None for p in model.parameters())


def test_output_independent_of_input():
    lin = nn.Linear(4, 4)
    inp = torch.randn(1, 4, requires_grad=True)
    out = lin(torch.ones(1, 4)) + 0 * inp.detach()
    w = backward_input(out, torch.ones(1, 4), inp)
    assert inp.grad is None and lin.weight.grad is None
    w.run()
    assert lin.weight.grad is not None


class _CountingIdentity(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _CountingIdentity.calls += 1
        return g


@pytest.mark.parametrize("reuse, runs", [(True, 1), (False, 2)])
def test_w_does_not_redo_the_input_path(reuse, runs):
    """With reuse_saved_gradients, W starts from the recorded gradients: the input path runs once."""
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    inp = torch.randn(2, 8, requires_grad=True)
    out = second(_CountingIdentity.apply(first(inp)))
    _CountingIdentity.calls = 0
    backward_input(out, torch.ones(2, 8), inp, reuse_saved_gradients=reuse).run()
    assert _CountingIdentity.calls == runs
    assert first.weight.grad is not None and second.weight.grad is not None
