"""A block called as ``block.forward(x)`` runs its hooks once, as ``block(x)`` does (pipeline stages
find their cut through hooks on the stack's blocks; SqueezeBERT's encoder calls ``layer.forward``)."""
import copy

import torch
from torch import nn

from megastrategy.pipeline.direct_forward import route_direct_forward_calls


class Stack(nn.Module):
    def __init__(self, direct: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.direct = direct

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x) if self.direct else layer(x)
        return x


def _count_hooks(stack: Stack) -> list:
    calls = []
    for i, layer in enumerate(stack.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: calls.append(("pre", i)))
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(("post", i)))
    return calls


def test_a_direct_call_runs_the_hooks_once_and_a_normal_call_still_does():
    x = torch.randn(2, 4)
    for direct in (True, False):
        torch.manual_seed(0)
        stack = Stack(direct)
        expected = stack(x)
        route_direct_forward_calls(stack.layers)
        route_direct_forward_calls(stack.layers)  # a second setup wraps nothing again
        calls = _count_hooks(stack)
        assert torch.equal(stack(x), expected)
        assert calls == [(kind, i) for i in range(3) for kind in ("pre", "post")], (direct, calls)


def test_a_hook_can_replace_the_input_of_a_direct_call():
    torch.manual_seed(0)
    stack = Stack(direct=True)
    route_direct_forward_calls(stack.layers)
    stack.layers[1].register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
    out = stack(torch.randn(2, 4))
    assert torch.equal(out, stack.layers[2](stack.layers[1](torch.zeros(2, 4))))


def test_a_deep_copy_routes_to_its_own_blocks():
    stack = Stack(direct=True)
    route_direct_forward_calls(stack.layers)
    twin = copy.deepcopy(stack)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    seen = []
    twin.layers[0].register_forward_pre_hook(lambda m, a: seen.append(m))
    assert torch.equal(twin(torch.randn(2, 4)), torch.zeros(2, 4))
    assert seen == [twin.layers[0]]


class _Checkpointed:
    """An instance-level forward under torch's checkpoint, as activation recompute installs one."""

    def __init__(self, module):
        self.module = module

    def __call__(self, x):
        fn = type(self.module).forward.__get__(self.module)
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)


def test_routing_over_a_recomputed_forward_runs_hooks_once_and_not_in_the_replay():
    """Installed last, over recompute's forward: the backward's replay calls the class forward and no
    hooks (installed first, the replay would re-enter __call__ and its hooks, without end)."""
    torch.manual_seed(0)
    stack = Stack(direct=True)
    x = torch.randn(2, 4, requires_grad=True)
    stack(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    for layer in stack.layers:
        layer.forward = _Checkpointed(layer)
    route_direct_forward_calls(stack.layers)
    calls = _count_hooks(stack)
    stack(x).sum().backward()
    assert torch.allclose(x.grad, expected)
    assert calls == [(kind, i) for i in range(3) for kind in ("pre", "post")], calls


def test_routing_for_the_dry_runs_is_undone():
    from megastrategy.pipeline.direct_forward import direct_forward_calls_routed

    stack = Stack(direct=True)
    layer = stack.layers[0]
    before = dict(layer._forward_pre_hooks)
    with direct_forward_calls_routed(stack.layers):
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__ and dict(layer._forward_pre_hooks) == before
