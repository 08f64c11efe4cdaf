"""head_vector entries (megastrategy.layers.head_vectors): a per-head parameter vector kept whole on
every rank is read as this rank's heads in the forward, and its gradient is the full one on every rank."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed


class _Biased(nn.Module):
    """DeBERTa v1's pattern: a bias of all heads' width added to the local heads' activations."""

    def __init__(self, heads: int = 4, size: int = 3) -> None:
        super().__init__()
        self.num_heads, self.size = heads, size
        self.q_bias = nn.Parameter(torch.arange(heads * size, dtype=torch.float))

    def forward(self, x):  # x: [batch, local heads * size]
        return x.view(x.shape[0], self.num_heads, self.size) + self.q_bias.view(self.num_heads, self.size)


def _run(rank, world):
    import torch.distributed as dist

    from megastrategy.layers.head_vectors import narrow_head_vectors

    full = _Biased()
    x = torch.randn(2, 12, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want = full(x)
    (want * want).sum().backward()
    local = _Biased()
    local.num_heads = 2
    narrow_head_vectors(local, dist.group.WORLD, ("q_bias",))
    xs = x.detach()[:, rank * 6:(rank + 1) * 6].requires_grad_(True)
    got = local(xs)
    (got * got).sum().backward()
    with torch.no_grad():
        eval_out = local(xs)
    return {
        "out": torch.equal(got.detach(), want.detach()[:, rank * 2:(rank + 1) * 2]),
        "eval": torch.equal(eval_out, got.detach()),
        "grad": torch.allclose(local.q_bias.grad, full.q_bias.grad),
        "whole": isinstance(local.q_bias, nn.Parameter) and local.q_bias.shape == (12,),
    }


@pytest.mark.slow
def test_a_head_vector_reads_local_heads_and_gets_the_full_gradient_tp2():
    for res in run_distributed(_run, 2, timeout=120):
        assert res == {"out": True, "eval": True, "grad": True, "whole": True}


def test_an_indivisible_head_vector_is_refused_clearly():
    from megastrategy.layers import head_vectors

    class _Group:
        pass

    m = _Biased(heads=3, size=1)
    orig = head_vectors.dist.get_world_size
    head_vectors.dist.get_world_size = lambda group=None: 2
    try:
        with pytest.raises(ValueError, match=r"_Biased.q_bias .* tp=2 divides; got \(3,\)"):
            head_vectors.narrow_head_vectors(m, _Group(), ("q_bias",))
    finally:
        head_vectors.dist.get_world_size = orig
