"""The recorded data flow (megastrategy.layers.dataflow): which linear layer feeds which, what a
layer's output is first cut into, which layers see the very same input tensor."""
from __future__ import annotations

import torch
from torch import nn

from megastrategy.layers.dataflow import trace_dataflow


class _Attention(nn.Module):
    """Packed QKV viewed into [heads, 3, head_dim], an output projection, a side MLP."""

    def __init__(self):
        super().__init__()
        self.num_heads = 2
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, self.num_heads, 3, 4).unbind(3)
        a = torch.softmax(self.norm(q) @ k.transpose(-1, -2), -1) @ v
        h = x + self.out(a.reshape(b, s, 8))
        return h + self.down(torch.relu(self.up(h)))


def _trace(model, run):
    watched = {n: m for n, m in model.named_modules() if n}
    cuts = {n for n, m in watched.items() if isinstance(m, nn.Linear)}
    return trace_dataflow(model, watched, cuts, run)


def test_sources_first_uses_and_shared_inputs_are_recorded():
    model = _Attention().train()
    flow = _trace(model, lambda: model(torch.randn(2, 5, 8)))
    assert flow.sources["out"] == {"qkv"}
    assert flow.sources["norm"] == {"qkv"}  # a LayerNorm reads the tags without cutting them
    assert flow.sources["up"] == {"out"} and flow.sources["down"] == {"up"}
    assert flow.sources["qkv"] == frozenset()
    use = flow.first_use["qkv"]  # the .shape read before is metadata, not a use
    assert use.op == "view" and use.shape == (2, 5, 24) and use.results == ((2, 5, 2, 3, 4),)
    assert flow.input_id["up"] != flow.input_id["qkv"]
    assert model.training  # flags restored after the eval-mode trace


def test_a_forward_that_raises_gives_no_flow():
    model = _Attention()
    assert _trace(model, lambda: model(torch.randn(2, 5, 7))) is None
