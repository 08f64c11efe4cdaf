"""Per-head bias tables under TP (megastrategy.layers.head_bias), on two processes: the table's
output keeps this rank's heads, its gradient is the full one on every rank, and a bias argument
with all heads (on dimension 1 of a 4-D bias, T5; on dimension 0 of a 3-D one, MPT's ALiBi) is
narrowed (and Bloom's [batch * heads, q, k]) while a local one passes through."""
from __future__ import annotations

from tests.helpers.dist import run_distributed


def _check(rank, world):
    import torch
    import torch.distributed as dist
    from torch import nn

    from megastrategy.layers.head_bias import narrow_head_bias_input, narrow_head_table

    torch.manual_seed(0)
    table = nn.Embedding(8, 4)
    reference = nn.Embedding(8, 4)
    reference.load_state_dict(table.state_dict())
    narrow_head_table(table, dist.group.WORLD, 4)
    buckets = torch.tensor([[0, 3], [5, 7]])
    out = table(buckets)
    out.pow(2).sum().backward()
    reference(buckets).pow(2).sum().backward()

    class PositionBias(nn.Module):  # Swin's: a [positions, heads] table, called for [1, heads, q, k]
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.arange(12.0).reshape(3, 4))

        def forward(self):
            return self.table[torch.tensor([0, 2, 1, 0])].view(2, 2, 4).permute(2, 0, 1).unsqueeze(0)

    swin, swin_reference = PositionBias(), PositionBias()
    narrow_head_table(swin, dist.group.WORLD, 4)
    swin_out = swin()
    swin_out.pow(2).sum().backward()
    swin_reference().pow(2).sum().backward()

    seen = []

    class Attention(nn.Module):
        def forward(self, x, position_bias=None):
            seen.append(tuple(position_bias.shape))
            return position_bias

    attention = narrow_head_bias_input(Attention(), dist.group.WORLD, 4, "position_bias")
    full = torch.arange(4.0).reshape(1, 4, 1, 1)
    attention(torch.zeros(1), position_bias=full)
    attention(torch.zeros(1), position_bias=full[:, :2])
    alibi = torch.arange(4.0).reshape(4, 1, 1).expand(4, 1, 3)  # MPT's [heads, q, k], no batch
    attention(torch.zeros(1), position_bias=alibi)
    flat = torch.arange(4.0).repeat(2).reshape(8, 1, 1)  # Bloom's [batch * heads, q, k], example-major
    flat_local = attention(torch.zeros(2, 5), position_bias=flat)
    return {
        "out": out.tolist(), "want": reference(buckets)[..., 2 * rank: 2 * rank + 2].tolist(),
        "grad_equal": bool(torch.allclose(table.weight.grad, reference.weight.grad)),
        "seen": seen, "flat": flat_local.flatten().tolist(),
        "swin": swin_out.tolist(), "swin_want": swin_reference()[:, 2 * rank: 2 * rank + 2].tolist(),
        "swin_grad_equal": bool(torch.allclose(swin.table.grad, swin_reference.table.grad)),
    }


def test_a_head_table_is_narrowed_and_its_gradient_summed_tp2():
    for rank, res in enumerate(run_distributed(_check, 2, timeout=120)):
        assert res["out"] == res["want"], rank
        assert res["grad_equal"], rank
        assert res["seen"] == [(1, 2, 1, 1), (1, 2, 1, 1), (2, 1, 3), (4, 1, 1)]
        assert res["flat"] == [2.0 * rank, 2.0 * rank + 1] * 2  # each example's own heads
        assert res["swin"] == res["swin_want"] and res["swin_grad_equal"], rank
