"""``megastrategy.grad_norm``: Lightning's function outside a strategy fit; the shares merged by name."""
import torch

from megastrategy import grad_norm
from megastrategy.ddp.whole_grad_norm import _merge


def test_outside_a_fit_it_is_lightnings():
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(4, 3)).sum().backward()
    ours, theirs = grad_norm(layer, 2), lightning_grad_norm(layer, 2)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_shares_are_summed_by_name_and_replicas_counted_once():
    every = [[("w", 9.0), ("ln", 4.0)], [("w", 16.0), ("ln", None)], [("stage1", 1.0)]]  # p-th powers, p=2
    assert _merge(every, 2.0) == {"w": 5.0, "ln": 2.0, "stage1": 1.0}
    assert _merge([[("w", 3.0)], [("w", 5.0)]], float("inf")) == {"w": 5.0}
